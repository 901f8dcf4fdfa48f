"""The one grammar of the suites' test ids: every id a suite gives its tests is formatted here,
and every reader (records of tests that raised or crashed, the plugin's replay groups) parses
it here. Baselines match records by test id, so a format never changes: tests/test_testids.py
pins today's ids.

The ids (pytest's node id is ``PATH::FUNCTION[PARAMS]``):

- operators: ``suites/operators/test_operators.py::test_OP[CANDIDATE-DTYPE-CASE]``
- layers: ``suites/models/test_layers.py::test_layer[SET/POINT-DTYPE]``, and
  ``test_layer[SET/(unreadable)]`` for a set whose manifest cannot be read
- models: ``suites/models/test_model.py::test_model[SET-DTYPE]``, and
  ``test_model[SET-DTYPE-SERVING]`` served in an arrangement other than the default
- decode: ``suites/models/test_decode.py::test_decode[SET-DTYPE-CACHE]``, and
  ``test_decode[SET-DTYPE-CACHE-SERVING]`` likewise (a cache name holds no hyphen)
- replay groups (the ``replay_group`` mark of a model-suite test): ``SET_PATH-DTYPE``

Parameters are split at their first dtype name (``numalign.core.dtypes.NAMES``): a candidate, a
set or a point may hold hyphens, a dtype name never appears before the dtype.

A suite's parameter is a :class:`Param`: the text pytest and Allure show (a ``str``), with
the structured values behind it, so a test reads its values and never re-parses its id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from numalign.core.dtypes import NAMES

#: The layer case of a set whose manifest cannot be read: its points are unknown.
UNREADABLE = "(unreadable)"
#: The folder the suites live in: the word after it in a test's path names its suite.
SUITES_FOLDER = "suites"


def format_operator(candidate: str, dtype: str, case: str) -> str:
    """``fused-bfloat16-unaligned-33x4097``: an operator test's parameters."""
    return f"{candidate}-{dtype}-{case}"


def format_layer(set_name: str, point: str, dtype: str) -> str:
    """``tiny-llama/model.layers.1.mlp-bfloat16``: a layer test's parameters."""
    return f"{set_name}/{point}-{dtype}"


def format_unreadable_layer(set_name: str) -> str:
    """``tiny-llama/(unreadable)``: the one layer test of a set that cannot be read."""
    return f"{set_name}/{UNREADABLE}"


def format_model(set_name: str, dtype: str, serving: str | None = None) -> str:
    """``tiny-llama-bfloat16``: a whole-model test's parameters (``-SERVING`` appended for a
    serving arrangement other than the default)."""
    return f"{set_name}-{dtype}" + _serving(serving)


def format_decode(set_name: str, dtype: str, cache: str, serving: str | None = None) -> str:
    """``tiny-llama-bfloat16-static``: a decode test's parameters (``-SERVING`` appended as
    for a model test)."""
    return f"{set_name}-{dtype}-{cache}" + _serving(serving)


def _serving(serving: str | None) -> str:
    from numalign.runtime.serving import DEFAULT_SERVING

    return "" if serving in (None, DEFAULT_SERVING) else f"-{serving}"


def format_replay_group(set_path: str, dtype: str) -> str:
    """The replay group of a model-suite test: its set (folder) and dtype. An engine that
    serves one model at a time runs a group's tests one after another."""
    return f"{set_path}-{dtype}"


def parse_replay_group(group: str) -> tuple[str, str]:
    """``"golden/sets/tiny-llama-bfloat16"`` -> ``("golden/sets/tiny-llama", "bfloat16")``."""
    set_path, _, dtype = group.rpartition("-")
    return set_path, dtype


@dataclass(frozen=True)
class TestId:
    """What a suite's test id says of its test; None where it does not say (a test outside
    the suites, a set that could not be read)."""

    __test__ = False  # not a pytest test class

    path: str
    function: str
    #: The suite: the folder under ``suites/`` (``operators``, ``models``).
    suite: str | None = None
    dtype: str | None = None
    #: operators: the operator (the test function without ``test_``), candidate and case.
    operator: str | None = None
    candidate: str | None = None
    case: str | None = None
    #: models: the golden set's name, the capture point (layers), the cache (decode) and
    #: the serving arrangement (models and decode; None: the default).
    model: str | None = None
    point: str | None = None
    cache: str | None = None
    serving: str | None = None


def parse(test_id: str) -> TestId:
    """The parts of a test id (see the module's docstring); an id of no suite gives what it
    can (its path and function)."""
    path, _, name = test_id.partition("::")
    function, _, params = name.partition("[")
    words = params.removesuffix("]").split("-")
    at = next((i for i, w in enumerate(words) if w in NAMES), None)
    suite = _suite(path)
    if at is None:
        return TestId(path, function, suite)
    before, dtype, after = "-".join(words[:at]), words[at], "-".join(words[at + 1 :])
    if suite == "models":
        model, _, point = before.partition("/")
        cache, serving = (None, after) if function == "test_model" else after.partition("-")[::2]
        return TestId(path, function, suite, dtype, model=model, point=point or None,
                      cache=cache or None, serving=serving or None)  # fmt: skip
    return TestId(path, function, suite, dtype, operator=function.removeprefix("test_") or None,
                  candidate=before or None, case=after or None)  # fmt: skip


def _suite(path: str) -> str | None:
    parts = path.replace("\\", "/").split("/")
    if SUITES_FOLDER in parts and parts.index(SUITES_FOLDER) + 1 < len(parts) - 1:
        return parts[parts.index(SUITES_FOLDER) + 1]
    return None


class Param(str):
    """A suite test's parameter: the text pytest and Allure show (a ``str``, the id's
    parameter as ``format`` writes it), and ``values``, the structured values behind it (an
    operator's candidate, dtype and case; a replay's set folder, dtype, point, cache)."""

    values: Any

    def __new__(cls, text: str, values: Any) -> Param:
        self = super().__new__(cls, text)
        self.values = values
        return self


@dataclass(frozen=True)
class ReplayCase:
    """The values of a model-suite test: the golden set's folder and the dtype; the capture
    point of a layer test (None: a set that could not be read), the cache of a decode test,
    the serving arrangement of a model or decode test (None: the engine's default)."""

    path: str
    dtype: str | None = None
    point: str | None = None
    cache: str | None = None
    serving: str | None = None


def replay_param(case: ReplayCase, text: str) -> Any:
    """A model-suite test's ``pytest.param``: shown as ``text`` (an id formatted above), its
    value a :class:`Param` reading ``SET_PATH::TEXT`` and carrying ``case``, marked with its
    replay group (none for a set that could not be read: it has no dtype)."""
    import pytest

    marks = [] if case.dtype is None else [
        pytest.mark.replay_group(format_replay_group(case.path, case.dtype))
    ]  # fmt: skip
    return pytest.param(Param(f"{case.path}::{text}", case), id=text, marks=marks)
