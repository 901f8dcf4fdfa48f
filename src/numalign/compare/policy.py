"""The tolerance policy: ``[[tool.numalign.override]]`` entries and
``[tool.numalign.thresholds]`` of pyproject.toml over the built-in tables of
``compare.tolerances``; later overrides win, the tables apply where none matches."""

from __future__ import annotations

import fnmatch
import math
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from numalign.compare.tolerances import (
    DTYPE_TOLERANCES,
    FLOAT_FORMATS,
    OP_CLASS_FACTORS,
    REDUCTION_CLASSES,
    ROUNDING_KEYS,
    Budget,
    Thresholds,
    Tolerance,
    parse_threshold,
    thresholds_from_table,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

#: A rule a policy's rounding overrides replace fields of (``compare.rounding.RoundingRule``).
R = TypeVar("R", bound="DataclassInstance")


@dataclass(frozen=True)
class Override:
    """One ``[[tool.numalign.override]]`` entry of pyproject.toml."""

    match: str
    dtype: str | None = None
    tolerance: Tolerance | None = None
    budget: Budget | None = None
    #: fields of a quantizer's rounding rule (``ROUNDING_KEYS``) that this entry replaces
    rounding: tuple[tuple[str, float], ...] = ()

    def applies(self, name: str, dtype: str) -> bool:
        if self.dtype is not None and self.dtype != dtype:
            return False
        return fnmatch.fnmatchcase(name, self.match)


@dataclass(frozen=True)
class TolerancePolicy:
    """Resolves the tolerance and budget for an operator or point name and a dtype.

    Later overrides win over earlier ones; the built-in tables apply where none matches.
    """

    overrides: tuple[Override, ...] = field(default_factory=tuple)
    #: the thresholds that apply by name, not per operator (``[tool.numalign.thresholds]``)
    thresholds: Thresholds = field(default_factory=Thresholds)

    def tolerance(
        self, name: str, dtype: str, op_class: str, reduction_length: int | None
    ) -> Tolerance:
        """The elementwise tolerance for ``name`` in ``dtype`` when there is no control."""
        for override in reversed(self.overrides):
            if override.tolerance is not None and override.applies(name, dtype):
                return override.tolerance
        base = DTYPE_TOLERANCES[dtype]
        factor = OP_CLASS_FACTORS[op_class]
        atol = base.atol * factor
        if op_class in REDUCTION_CLASSES and reduction_length is not None and reduction_length > 1:
            atol *= math.sqrt(reduction_length)  # [walk]
        return Tolerance(rtol=base.rtol * factor, atol=atol)

    def budget(self, name: str, dtype: str, default: Budget | None = None) -> Budget:
        """The control multipliers for ``name`` in ``dtype``: an override, else ``default``
        (an operator's own), else the built-in one."""
        for override in reversed(self.overrides):
            if override.budget is not None and override.applies(name, dtype):
                return override.budget
        return default or Budget()

    def rounding(self, name: str, dtype: str, default: R) -> R:
        """A quantizer's rounding rule for ``name`` in ``dtype``: ``default`` (the output's
        own rule) with the fields the last matching override gives replaced."""
        for override in reversed(self.overrides):
            if override.rounding and override.applies(name, dtype):
                return replace(default, **dict(override.rounding))
        return default

    def source(self, what: str, name: str, dtype: str) -> str | None:
        """Which override gives ``what`` ("tolerance", "budget" or "rounding") for ``name``
        in ``dtype`` (its pattern, as messages name it), or None where none does."""
        for override in reversed(self.overrides):
            if getattr(override, what) and override.applies(name, dtype):
                return f"pyproject override {override.match!r}"
        return None


DEFAULT_POLICY = TolerancePolicy()


def thresholds_of(policy: TolerancePolicy | None) -> Thresholds:
    """The thresholds of ``policy`` (the defaults without one)."""
    return (policy or DEFAULT_POLICY).thresholds


def _override_from_table(entry: Mapping[str, Any], where: str) -> Override:
    known = {"match", "dtype", "rtol", "atol", "max_abs_multiplier", "rel_l2_multiplier"}
    known |= set(ROUNDING_KEYS)
    unknown = sorted(set(entry) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed: {sorted(known)}")
    if "match" not in entry:
        raise ValueError(f"{where}: 'match' (an operator or point pattern such as 'rms_norm*')")
    dtype = entry.get("dtype")
    if dtype is not None and dtype not in FLOAT_FORMATS:
        raise ValueError(f"{where}: unknown dtype {dtype!r}; allowed: {sorted(FLOAT_FORMATS)}")
    if ("rtol" in entry) != ("atol" in entry):
        raise ValueError(f"{where}: give rtol and atol together or not at all")
    tolerance = None
    if "rtol" in entry:
        tolerance = Tolerance(rtol=float(entry["rtol"]), atol=float(entry["atol"]))
    budget = None
    if "max_abs_multiplier" in entry or "rel_l2_multiplier" in entry:
        budget = replace(
            Budget(),
            **{
                k: float(entry[k])
                for k in ("max_abs_multiplier", "rel_l2_multiplier")
                if k in entry
            },
        )
    rounding = tuple(
        (k, parse_threshold(entry[k], f"{where}: {k}")) for k in ROUNDING_KEYS if k in entry
    )
    return Override(
        match=str(entry["match"]), dtype=dtype, tolerance=tolerance, budget=budget,
        rounding=rounding,
    )  # fmt: skip


def policy_from_entries(
    entries: Iterable[Mapping[str, Any]],
    source: str,
    thresholds: Mapping[str, Any] | None = None,
) -> TolerancePolicy:
    """Builds a policy from ``[[tool.numalign.override]]`` tables and the
    ``[tool.numalign.thresholds]`` table (``source`` names them)."""
    return TolerancePolicy(
        tuple(
            _override_from_table(entry, f"{source}: override #{i + 1}")
            for i, entry in enumerate(entries)
        ),
        thresholds_from_table(thresholds or {}, f"{source}: [tool.numalign.thresholds]"),
    )


def load_policy(pyproject: str | Path) -> TolerancePolicy:
    """Reads the overrides of ``[tool.numalign]`` from a pyproject.toml; no file, no overrides.

    Example::

        [[tool.numalign.override]]
        match = "attention*"        # fnmatch pattern over operator or point names
        dtype = "bfloat16"          # optional
        max_abs_multiplier = 6.0    # looser budget against the control

        [tool.numalign.thresholds]
        near_tie_multiplier = 3.0   # any field of ``Thresholds``
    """
    path = Path(pyproject)
    if not path.is_file():
        return DEFAULT_POLICY
    with path.open("rb") as fh:
        data = tomllib.load(fh)
    table = data.get("tool", {}).get("numalign", {})
    return policy_from_entries(table.get("override", []), str(path), table.get("thresholds"))
