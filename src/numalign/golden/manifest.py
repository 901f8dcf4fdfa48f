"""The golden set format, ``numalign.golden/4``, as typed objects: what ``manifest.json``
holds, read and written in this one module (``Manifest.from_json`` / ``Manifest.to_json``),
so that no reader touches the JSON itself and a renamed key has one place to change.

Format 2 adds ``decode``: per request, the cached decode the reference ran after its prefill
(``Decode``). Format 3 calibrates over an ensemble of honest members (``ensemble``: per dtype,
the members' descriptions; each statistic the ensemble's worst, with ``<stat>_spread`` and
``members`` beside it). A point's ``calls`` may hold calls under ``probe``
(``PROBE_REQUEST``), which is no request: inputs of the point alone that no request makes
(``golden.probes``); sets without it have no probe calls. Format 1 and 2 sets are read as
they are: they have no decode steps (1), their calibration is one member's (1, 2), and they
are judged against that one member. Any format may hold ``power``: per dtype, point, output
and mode, what a pass would catch (``PowerJson``, ``replay.set_power``); sets before it have
none.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path, PureWindowsPath
from typing import Any, TypeAlias

# the calibration's types and point names are the verdict's (``compare.calibration``)
from numalign.compare.calibration import CACHE_POINT as CACHE_POINT
from numalign.compare.calibration import OUTPUT_POINT as OUTPUT_POINT
from numalign.compare.calibration import Calibration as Calibration
from numalign.compare.calibration import ControlStats as ControlStats
from numalign.compare.output_kind import check_kind, kind_of
from numalign.core.errors import BrokenData
from numalign.core.finite_json import encode as _encode_finite
from numalign.golden.power_json import PowerJson as PowerJson
from numalign.golden.power_json import power_from_json
from numalign.golden.statistics_info import STATISTICS_FORMAT, StatisticsInfo

FORMAT = "numalign.golden/4"
#: Formats this numalign reads: format 1 sets have no decode steps, format 1 and 2 sets a
#: calibration of one member, formats 1 to 3 no output kinds (read from their dtypes once,
#: ``Point.kinds``).
READ_FORMATS = ("numalign.golden/1", "numalign.golden/2", "numalign.golden/3", FORMAT,
                STATISTICS_FORMAT)  # fmt: skip
MANIFEST = "manifest.json"
#: The request name of a point's probe calls (``golden.probes``): inputs no request makes,
#: recorded with the point's calls but not a request of the set (no model inputs; the
#: whole-model replays never run it; layer replay replays it alone like any call).
PROBE_REQUEST = "probe"
#: The type a set records for a mask the model builds (``golden.mask_points.MaskFunction``).
MASK_POINT_TYPE = "MaskFunction"
#: The point of what a language model does to its logits after the LM head
#: (``golden.logit_transform``), where it does something.
LOGIT_TRANSFORM = "logit_transform"


class GoldenSetError(BrokenData, RuntimeError):
    """A golden set that cannot be used as it is; the message says why and what to do."""


class StaleGoldenSetError(GoldenSetError):
    """The model folder changed since the set was captured."""


class GoldenFormatWarning(UserWarning):
    """A manifest holds fields this numalign does not know (a newer numalign's additive
    fields): the set is read without them."""


@dataclass(frozen=True)
class ModelInfo:
    """The captured model: its folder (relative to the set), name, class and fingerprint,
    and each file's sha256 (config, weights, a sharded checkpoint's every shard and index;
    empty in sets captured before it was stored)."""

    path: str
    name: str
    architecture: str
    model_type: str | None
    fingerprint: str
    files: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ReferenceInfo:
    """How the reference ran: device, dtype, attention implementation, versions, seed."""

    device: str
    dtype: str
    attn_implementation: str | None
    torch: str
    transformers: str
    seed: int = 0


@dataclass(frozen=True)
class Request:
    """One request of the set: its name and the tensor keys of its model inputs."""

    name: str
    inputs: dict[str, str]


@dataclass(frozen=True)
class Continuation:
    """A request's greedy continuation: the tokens [batch, steps] and each step's logits."""

    tokens: str
    logits: str


@dataclass(frozen=True)
class DecodeStep:
    """One decode step of a request: the token fed [batch, 1], the logits it gave
    [batch, vocab], and per capture point the outputs of each of its calls in that step
    (output path -> tensor key; only outputs laid out [batch, 1, ...], the new token's)."""

    token: str
    logits: str
    points: dict[str, list[dict[str, str]]]

    def to_json(self) -> dict[str, Any]:
        return {"token": self.token, "logits": self.logits, "points": self.points}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DecodeStep:
        return cls(d["token"], d["logits"], {k: list(v) for k, v in d["points"].items()})


@dataclass(frozen=True)
class Decode:
    """A request's cached decode: its prefill with a ``cache`` (the implementation the
    reference used) and then ``steps``, each feeding the reference's own greedy token; the
    cache's contents (state name, such as ``layers.0.keys``, -> tensor key) after the
    prefill and after the last step, each a window of the most recent positions in order;
    ``cache_limits``: cache implementation -> why the reference itself could not decode this
    request with it at capture (its modelling code's limit, such as BLOOM's ALiBi built from
    the input's mask, not the static cache's length; empty where it could or in older sets)."""

    cache: str
    steps: list[DecodeStep]
    prefill_cache: dict[str, str]
    final_cache: dict[str, str]
    cache_limits: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = {"cache": self.cache, "steps": [s.to_json() for s in self.steps],
                "prefill_cache": self.prefill_cache, "final_cache": self.final_cache}  # fmt: skip
        if self.cache_limits:
            data["cache_limits"] = self.cache_limits
        return data

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Decode:
        return cls(
            d["cache"],
            [DecodeStep.from_json(s) for s in d["steps"]],
            dict(d["prefill_cache"]),
            dict(d["final_cache"]),
            {str(k): str(v) for k, v in d.get("cache_limits", {}).items()},
        )


#: A keyword input's tensor keys in the input's own shape: a tensor's key, a list for a
#: tuple or list, a dict for a dict, None for a None inside one. Sets before dicts were kept
#: hold keys and lists of keys only, which read the same.
KeyTree: TypeAlias = str | list["KeyTree"] | dict[str, "KeyTree"] | None


@dataclass(frozen=True)
class Call:
    """One call of a capture point's module in one request: tensor keys of its positional
    and keyword inputs (``KeyTree``: in the input's own shape; None where a positional input
    holds no tensor, its JSON value in ``args_json``) and of its outputs (by output path,
    "0" for a plain tensor)."""

    args: tuple[KeyTree, ...]
    args_json: tuple[Any, ...]
    kwargs: dict[str, KeyTree]
    kwargs_json: dict[str, Any]
    outputs: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        return {"args": list(self.args), "args_json": list(self.args_json),
                "kwargs": self.kwargs, "kwargs_json": self.kwargs_json,
                "outputs": self.outputs}  # fmt: skip

    @classmethod
    def from_json(cls, c: dict[str, Any]) -> Call:
        return cls(
            args=tuple(c["args"]),
            args_json=tuple(c.get("args_json", [None] * len(c["args"]))),
            kwargs=c["kwargs"],
            kwargs_json=c.get("kwargs_json", {}),
            outputs=c["outputs"],
        )


@dataclass(frozen=True)
class Point:
    """A capture point: a module of the reference model, in forward order."""

    name: str
    type: str
    order: int
    calls: dict[str, list[Call]]  # request name -> calls in that request's forward
    #: output path -> its kind (``compare.output_kind``), decided by the capture
    kinds: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TensorInfo:
    """Where a stored tensor lives and what it is."""

    shard: str
    dtype: str
    shape: list[int]
    bytes: int


@dataclass(frozen=True)
class ShardInfo:
    sha256: str
    bytes: int


#: Calibration of one dtype as JSON holds it (and calibration members measure it):
#: {point: {output path: {mode: {statistic: value}}}}; typed, it is a ``Calibration``.
CalibrationJson = dict[str, dict[str, dict[str, dict[str, float | None]]]]


def calibration_from_json(data: Any) -> Calibration:
    """One dtype's calibration from its JSON form (every statistic's order kept, so that it
    is written back as read); TypeError where a level is not an object."""
    if not isinstance(data, dict):
        raise TypeError(f"a calibration is an object, not {type(data).__name__}")
    points: dict[str, dict[str, dict[str, ControlStats]]] = {}
    for point, outputs in data.items():
        points[point] = {}
        for path, modes in _object(outputs).items():
            points[point][path] = {
                mode: ControlStats.of(_object(stats)) for mode, stats in _object(modes).items()
            }
    return Calibration(points)


def calibration_to_json(calibration: Calibration) -> CalibrationJson:
    """One dtype's calibration as JSON holds it (the inverse of ``calibration_from_json``)."""
    return {
        point: {path: {mode: stats.values() for mode, stats in modes.items()}
                for path, modes in outputs.items()}
        for point, outputs in calibration.points.items()
    }  # fmt: skip


def _object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"a calibration entry is an object, not {type(value).__name__}")
    return value


@dataclass
class Manifest:
    """Everything ``manifest.json`` holds (docs/reference/golden-format.md; format 2 adds
    ``decode``)."""

    model: ModelInfo
    reference: ReferenceInfo
    requests: list[Request]
    points: list[Point]
    tensors: dict[str, TensorInfo]
    shards: dict[str, ShardInfo]
    #: request -> logits key (language models)
    logits: dict[str, str] = field(default_factory=dict)
    #: request -> {output name -> key}: the final outputs of models without logits
    outputs: dict[str, dict[str, str]] = field(default_factory=dict)
    continuation: dict[str, Continuation] = field(default_factory=dict)
    #: request -> its cached decode (format 2; empty in format 1 sets)
    decode: dict[str, Decode] = field(default_factory=dict)
    #: dtype -> calibration of that dtype
    calibration: dict[str, Calibration] = field(default_factory=dict)
    #: dtype -> the calibration ensemble's members (format 3; empty before: one member)
    ensemble: dict[str, list[str]] = field(default_factory=dict)
    #: dtype -> the error the reference's own code raised in it at calibration (XLNet's
    #: float32 positional tables against bfloat16 weights): replay in it is skipped with it
    dtype_limits: dict[str, str] = field(default_factory=dict)
    #: dtype -> point -> output path -> mode -> what a pass would catch (``PowerJson``;
    #: empty in sets before it was stored)
    power: PowerJson = field(default_factory=dict)
    #: key -> a tensor kept as statistics only (format 5; ``golden.statistics_info``)
    statistics: dict[str, StatisticsInfo] = field(default_factory=dict)
    created: str = ""
    format: str = FORMAT

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "format": self.format,
            "created": self.created,
            "model": vars(self.model),
            "reference": vars(self.reference),
            "requests": [{"name": r.name, "inputs": r.inputs} for r in self.requests],
            "points": [
                {
                    "name": p.name,
                    "type": p.type,
                    "order": p.order,
                    "calls": {req: [c.to_json() for c in calls] for req, calls in p.calls.items()},
                    # an older set rewritten (its power, say) keeps its format: no kinds
                    **({"kinds": p.kinds} if self.format in _KINDS_FORMATS else {}),
                }
                for p in self.points
            ],
            "logits": self.logits,
            "continuation": {k: vars(v) for k, v in self.continuation.items()},
            "tensors": {k: vars(v) for k, v in self.tensors.items()},
            "shards": {k: vars(v) for k, v in self.shards.items()},
            "calibration": {k: calibration_to_json(v) for k, v in self.calibration.items()},
        }
        if self.outputs:
            data["outputs"] = self.outputs
        if self.decode:
            data["decode"] = {k: v.to_json() for k, v in self.decode.items()}
        if self.ensemble:
            data["ensemble"] = self.ensemble
        if self.dtype_limits:
            data["dtype_limits"] = self.dtype_limits
        if self.power:
            data["power"] = _encode_finite(self.power)
        if self.statistics:
            data["statistics"] = {k: v.to_json() for k, v in self.statistics.items()}
        return data

    @classmethod
    def from_json(cls, data: Any, source: Path) -> Manifest:
        """The manifest of ``data`` read from ``source``; a GoldenSetError naming the file
        and the remedy when the format, version or a field is not what this numalign reads."""
        found = data.get("format") if isinstance(data, dict) else None
        if found not in READ_FORMATS:
            raise GoldenSetError(
                f"{source}: format {found!r} is not one this numalign reads "
                f"({', '.join(READ_FORMATS)}): capture the set again with this version"
            )
        for name in ("model", "reference", "requests", "points", "tensors", "shards"):
            if name not in data:
                raise GoldenSetError(f"{source}: missing field {name!r}; capture again")
        unknown = sorted(set(data) - _TOP_LEVEL)
        known = _Known(source, unknown)
        try:
            manifest = cls(
                model=ModelInfo(**known(ModelInfo, data["model"], "model")),
                reference=ReferenceInfo(**known(ReferenceInfo, data["reference"], "reference")),
                requests=[Request(r["name"], dict(r["inputs"])) for r in data["requests"]],
                points=[
                    Point(
                        p["name"],
                        p["type"],
                        p["order"],
                        {
                            req: [Call.from_json(c) for c in calls]
                            for req, calls in p["calls"].items()
                        },
                        _kinds(p, data["tensors"], source),
                    )
                    for p in data["points"]
                ],
                tensors={
                    k: TensorInfo(**known(TensorInfo, v, f"tensors[{k!r}]", "tensors.*"))
                    for k, v in data["tensors"].items()
                },
                shards={
                    k: ShardInfo(**known(ShardInfo, v, f"shards[{k!r}]", "shards.*"))
                    for k, v in data["shards"].items()
                },
                logits=dict(data.get("logits", {})),
                outputs=dict(data.get("outputs", {})),
                continuation={
                    k: Continuation(
                        **known(Continuation, v, f"continuation[{k!r}]", "continuation.*")
                    )
                    for k, v in data.get("continuation", {}).items()
                },
                decode={k: Decode.from_json(v) for k, v in data.get("decode", {}).items()},
                calibration={
                    k: calibration_from_json(v) for k, v in data.get("calibration", {}).items()
                },
                ensemble={k: list(v) for k, v in data.get("ensemble", {}).items()},
                dtype_limits={str(k): str(v) for k, v in data.get("dtype_limits", {}).items()},
                power=power_from_json(data.get("power", {})),
                statistics=_statistics(data.get("statistics", {}), known),
                created=str(data.get("created", "")),
                format=found,
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise GoldenSetError(
                f"{source}: a field does not have the format {FORMAT} gives it ({exc}); "
                "capture the set again"
            ) from None
        _check_shard_names(manifest, source)
        if known.unknown:
            warnings.warn(
                GoldenFormatWarning(
                    f"{source}: fields this numalign does not know, read past: "
                    f"{', '.join(sorted(set(known.unknown)))} (a newer numalign's, or "
                    "edited by hand; the set is read without them: update numalign to use "
                    "them)"
                ),
                stacklevel=3,
            )
        return manifest


def _statistics(data: dict[str, Any], known: _Known) -> dict[str, StatisticsInfo]:
    """The tensors a set keeps as statistics only (format 5), each with the fields it must
    have."""
    return {k: StatisticsInfo(**known(StatisticsInfo, v, f"statistics[{k!r}]", "statistics.*"))
            for k, v in data.items()}  # fmt: skip


def _kinds(point: dict[str, Any], tensors: dict[str, Any], source: Path) -> dict[str, str]:
    """A point's output kinds as stored; for a set of a format before they were (1 to 3), as
    the capture decides them (``output_kind.kind_of``) from the dtypes its manifest records
    of the point's outputs, a mask point by its type."""
    if "kinds" in point:
        return {path: check_kind(kind, f"{source}: point {point['name']!r}")
                for path, kind in point["kinds"].items()}  # fmt: skip
    mask_point = point["type"] == MASK_POINT_TYPE
    return {path: kind_of(path, tensors[key]["dtype"], mask_point=mask_point)
            for calls in point["calls"].values() for call in calls[:1]
            for path, key in call["outputs"].items()}  # fmt: skip


#: The fields of a manifest's top level (``Manifest.to_json``).
_TOP_LEVEL = frozenset({
    "format", "created", "model", "reference", "requests", "points", "logits", "outputs",
    "continuation", "tensors", "shards", "calibration", "decode", "ensemble", "dtype_limits",
    "power", "statistics",
})  # fmt: skip
#: The formats that store each point's output kinds.
_KINDS_FORMATS = (FORMAT, STATISTICS_FORMAT)


class _Known:
    """The fields of a manifest's objects that their class has (``__call__``), collecting the
    others' names in ``unknown`` (read past with a ``GoldenFormatWarning``, as fields a newer
    numalign adds) and refusing an object without a field its class requires."""

    def __init__(self, source: Path, unknown: list[str]) -> None:
        self.source = source
        self.unknown = unknown

    def __call__(
        self, kind: type, value: Any, where: str, label: str | None = None
    ) -> dict[str, Any]:
        """``value``'s fields of the dataclass ``kind``; ``where`` names it in an error,
        ``label`` (default ``where``) in the list of unknown fields."""
        if not isinstance(value, dict):
            raise GoldenSetError(
                f"{self.source}: {where} is {type(value).__name__}, not an object, in format "
                f"{FORMAT}; capture the set again"
            )
        own = fields(kind)
        names = {f.name for f in own}
        for f in own:
            required = f.default is MISSING and f.default_factory is MISSING
            if required and f.name not in value:
                raise GoldenSetError(
                    f"{self.source}: {where} has no field {f.name!r}, which format {FORMAT} "
                    "requires; capture the set again"
                )
        self.unknown += [f"{label or where}.{k}" for k in value if k not in names]
        return {k: v for k, v in value.items() if k in names}


def _check_shard_names(manifest: Manifest, source: Path) -> None:
    """Every shard the manifest names (its checksums' and its tensors') is a file of the
    set's own folder (``source``'s): a name that is an absolute path, or that ``..`` takes
    out of the folder, is refused naming the manifest (a set never reads another folder's
    files). A link inside the folder is read as the file it is (an annex's links)."""
    folder = source.parent
    names = set(manifest.shards) | {info.shard for info in manifest.tensors.values()}
    for name in sorted(names):
        kind = None
        if Path(name).is_absolute() or PureWindowsPath(name).anchor:
            kind = "an absolute path"
        elif os.path.normpath(name).split(os.sep)[0] in ("..", "."):
            kind = "outside the set's folder"
        if kind is not None:
            raise GoldenSetError(
                f"{source}: shard {name!r} is {kind}; a set's shards are files in its own "
                f"folder ({folder}): capture the set again, or restore its manifest"
            )
