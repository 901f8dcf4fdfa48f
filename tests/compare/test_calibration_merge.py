"""Each calibration statistic is declared once, with the direction of its worst, and every
merge (a member's requests and calls, the ensemble's members, a control's own and borrowed
calibrations) keeps that worst whatever the order of its samples."""

from __future__ import annotations

import itertools
import math
from dataclasses import fields

import pytest

from numalign.compare.calibration import (
    STATISTICS,
    ControlStats,
    merge_statistics,
    worst_of,
)
from numalign.replay.ensemble import merge

#: Two samples of a statistic by the direction of its worst: the better, then the worse.
_BETTER = {"largest": (0.01, 0.05), "smallest": (0.05, 0.01),
           "farthest_from_one": (1.001, 0.995)}  # fmt: skip


def _pair(name: str) -> tuple[float, float]:
    return _BETTER[STATISTICS[name]]


def test_every_stored_statistic_is_declared_once_with_its_worst() -> None:
    stored = {f.name for f in fields(ControlStats)} - {"extra", "keys"}
    assert stored == set(STATISTICS)


@pytest.mark.parametrize("name", list(STATISTICS))
def test_a_merge_keeps_the_worst_in_either_order(name: str) -> None:
    better, worse = _pair(name)
    forward = merge_statistics([{name: better}, {name: worse}])
    backward = merge_statistics([{name: worse}, {name: better}])
    assert forward == backward == {name: worse}


def test_flips_merge_to_the_largest_fraction() -> None:
    """The case the ensemble got wrong: it kept the first member's flips."""
    assert merge([{"p": {"routing": {"isolated": {"flips": 0.01}}}},
                  {"p": {"routing": {"isolated": {"flips": 0.05}}}}])["p"]["routing"][
        "isolated"]["flips"] == 0.05  # fmt: skip
    assert merge([{"p": {"routing": {"isolated": {"flips": 0.05}}}},
                  {"p": {"routing": {"isolated": {"flips": 0.01}}}}])["p"]["routing"][
        "isolated"]["flips"] == 0.05  # fmt: skip


def test_the_ensemble_merge_is_the_same_in_every_order_of_its_members() -> None:
    # three members, each worst at some statistics: the merge takes every statistic's worst
    members = []
    for shift in range(3):
        sample = {}
        for i, name in enumerate(s for s in STATISTICS if s not in ("members",)):
            better, worse = _pair(name)
            sample[name] = worse if (i + shift) % 3 == 0 else better
        members.append({"model.layers.0": {"0": {"isolated": sample}}})
    merged = [merge(list(order)) for order in itertools.permutations(members)]
    assert all(m == merged[0] for m in merged)
    stats = merged[0]["model.layers.0"]["0"]["isolated"]
    for name in STATISTICS:
        if name not in ("members", "max_abs_spread", "rel_l2_spread"):
            assert stats[name] == _pair(name)[1], name
    assert stats["members"] == 3


def test_missing_and_nan_samples_are_not_measurements() -> None:
    assert merge_statistics([{"max_abs": None}, {"max_abs": 0.2}]) == {"max_abs": 0.2}
    assert merge_statistics([{"max_abs": math.nan}, {"max_abs": 0.2}]) == {"max_abs": 0.2}
    assert merge_statistics([{"max_abs": 0.2}, {"max_abs": math.nan}]) == {"max_abs": 0.2}
    assert merge_statistics([{"max_abs": None}]) == {"max_abs": None}
    # a statistic only a later sample has is kept (the per-request merge dropped it)
    assert merge_statistics([{"max_abs": 0.1}, {"max_abs": 0.1, "flips": 0.02}])["flips"] == 0.02


def test_an_unknown_statistic_merges_to_its_largest_in_either_order() -> None:
    assert worst_of("not_a_statistic", [0.3, 0.1]) == worst_of("not_a_statistic", [0.1, 0.3])
    assert worst_of("not_a_statistic", [0.3, 0.1]) == 0.3


def test_a_norm_ratio_tie_is_broken_the_same_way_in_either_order() -> None:
    assert worst_of("norm_ratio", [0.99, 1.01]) == worst_of("norm_ratio", [1.01, 0.99]) == 1.01
