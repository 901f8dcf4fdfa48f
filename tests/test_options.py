"""The option table (numalign.session.options), the one place every option is declared, and its one
validation (Settings.from_options), shared by the plugin and the CLI's run and nightly."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from numalign.session.option_values import DEFAULT_CACHE_IMPLEMENTATIONS
from numalign.session.options import BY_NAME, INI_TYPES, OPTIONS, Option, add_to, command_values
from numalign.session.settings import Settings


def test_every_option_of_the_table_is_validated_and_its_default_is_valid() -> None:
    settings = Settings.from_options({o.name: o.default for o in OPTIONS})
    assert settings.device == "auto" and settings.tier == "pr" and settings.tp == 1
    assert settings.cache_implementations == DEFAULT_CACHE_IMPLEMENTATIONS
    assert settings.truth_cache_max_bytes == 4 * 10**9 and settings.keep_runs == 10
    assert len({o.name for o in OPTIONS}) == len({o.ini for o in OPTIONS}) == len(OPTIONS)
    assert all(o.ini_type in INI_TYPES and o.ini.startswith("numalign_") for o in OPTIONS)


def test_every_settings_field_is_set_by_one_option() -> None:
    fields = [f.name for f in dataclasses.fields(Settings)]
    assert sorted(o.setting for o in OPTIONS) == sorted(fields)


@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: o.flag)
def test_each_options_default_reads_as_the_settings_default(option: Option) -> None:
    """What a session gets without the flag or the ini key is what ``Settings()`` holds (the
    truth cache's folder, which the plugin resolves against the rootdir, reads as off)."""
    assert option.read(option.default) == getattr(Settings(), option.setting)


def test_a_text_option_needs_a_parser_and_no_other_has_one() -> None:
    with pytest.raises(ValueError, match="--x: a text option has a parser"):
        Option("--x", "numalign_x", "x", setting="x")
    with pytest.raises(ValueError, match="--x: a text option has a parser"):
        Option("--x", "numalign_x", "x", setting="x", ini_type="bool", parse=str)
    with pytest.raises(ValueError, match="--x: ini type 'int' is not one of"):
        Option("--x", "numalign_x", "x", setting="x", ini_type="int", parse=int)


def test_a_command_takes_the_suites_options_from_the_table() -> None:
    parser = argparse.ArgumentParser()
    add_to(parser, ["device", "compile", "tp"])
    add_to(parser, ["tier"], defaults=True, choices=("pr",))
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    for name in ("device", "compile", "tp", "tier"):
        option, action = BY_NAME[name], actions[name]
        assert action.option_strings == [option.flag] and action.help == option.help
        assert (action.metavar, action.nargs, action.const) == (
            option.metavar, option.nargs, option.const
        )  # fmt: skip
    assert actions["device"].default is None and actions["tier"].default == "pr"
    assert actions["tier"].choices == ("pr",) and actions["device"].choices is None
    args = parser.parse_args(["--compile", "--tp", "2"])
    values = {"device": None, "compile": "inductor", "tp": "2", "tier": "pr"}
    assert command_values(args) == values
    assert Settings.from_options(values) == Settings(compile_backend="inductor", tp=2)


def test_absent_options_keep_the_defaults_and_unknown_names_are_refused() -> None:
    assert Settings.from_options({}) == Settings()
    assert Settings.from_options({"dtype": None, "tp": "2"}) == Settings(tp=2)
    with pytest.raises(ValueError, match=r"unknown option.* dtypes; known: device"):
        Settings.from_options({"dtypes": "float32"})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"dtype": "bf16"}, "--dtype 'bf16': unknown dtype bf16; allowed: float32, bfloat16"),
        ({"device": "gpu"}, "unknown device 'gpu'; allowed: auto, cpu, cuda"),
        ({"tp": "0"}, "--tp '0': give the number of tensor-parallel ranks, e.g. --tp 2"),
        ({"regression_factor": "1"}, "--regression-factor must be a number above 1"),
        ({"golden_only": True}, "--golden-only replays the --golden sets alone, and none"),
        ({"golden": ["no/such"]}, "--golden no/such: no such folder; pass a golden set folder"),
        ({"drift_baseline": "no/such"}, "--drift-baseline no/such: no such run folder or"),
        ({"shard": "3/2"}, "--shard '3/2': write I/N with 1 <= I <= N, e.g. 1/2"),
    ],
)
def test_bad_values_say_which_option_and_how_to_fix_it(
    values: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError) as raised:
        Settings.from_options(values)
    assert str(raised.value).startswith(message)


def test_a_baseline_that_is_no_run_fails_before_any_test(tmp_path: Path) -> None:
    bad = tmp_path / "records.jsonl"
    bad.write_text("not json\n{}\n")
    with pytest.raises(ValueError, match=r"--drift-baseline .*records.jsonl:1: not a JSON record"):
        Settings.from_options({"drift_baseline": str(bad)})
