"""The golden set store: ``manifest.json`` plus safetensors shards, read and written here in
the manifest's current format (``manifest.FORMAT``; the older ones in ``READ_FORMATS`` read
too), the manifest's objects being ``numalign.golden.manifest``'s.

Only JSON and safetensors are read, never pickle. Every error names the file and the remedy.
Writes are atomic: shards go to a set's temporary folder as a capture runs, the manifest is
replaced by rename, and a finished set is renamed into place.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from numalign.compare.output_kind import TENSOR
from numalign.core.names import did_you_mean
from numalign.golden.fingerprint import changed_files, fingerprint, settled_stat
from numalign.golden.folders import MARKER, mark, marked, remove_abandoned, remove_written
from numalign.golden.manifest import (
    CACHE_POINT,
    FORMAT,
    MANIFEST,
    OUTPUT_POINT,
    PROBE_REQUEST,
    Calibration,
    Call,
    Continuation,
    ControlStats,
    Decode,
    DecodeStep,
    GoldenSetError,
    Manifest,
    ModelInfo,
    Point,
    PowerJson,
    ReferenceInfo,
    Request,
    StaleGoldenSetError,
    TensorInfo,
)
from numalign.golden.shards import sha256_file
from numalign.golden.statistics_info import StatisticsOnly

if TYPE_CHECKING:
    import torch

    from numalign.core.statistics import TensorStatistics

__all__ = [
    "CACHE_POINT", "FORMAT", "MANIFEST", "OUTPUT_POINT", "Call", "Continuation", "Decode",
    "DecodeStep", "GoldenSet", "GoldenSetError",
    "Manifest", "ModelInfo", "Point", "ReferenceInfo", "Request", "StaleGoldenSetError",
    "discover_sets", "remove_abandoned", "replace_set", "write_manifest",
]  # fmt: skip

#: Where golden sets live, relative to a project's root.
DEFAULT_SETS = Path("golden") / "sets"
#: The one older format a set is upgraded from by rewriting its manifest (``upgrade``).
UPGRADABLE_FORMAT = "numalign.golden/3"
#: Shards verified against the manifest's sha256 in this process: (sha256, settled stat).
_VERIFIED: set[tuple[object, ...]] = set()
#: Sets opened with ``GoldenSet.open_shared``, by manifest path: (its settled stat, the set).
_SHARED: dict[str, tuple[tuple[object, ...], GoldenSet]] = {}


class GoldenSet:
    """A golden set on disk; tensors load lazily, shard by shard, to a device and dtype."""

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path = path
        self.manifest = manifest
        self._points = {p.name: p for p in manifest.points}
        #: open shards by (name, size, modification time): a changed shard is opened (and
        #: verified) again; opening a shard parses its whole header, once per set here
        self._open: dict[tuple[str, int, int], tuple[Any, frozenset[str]]] = {}

    # -- opening and validation ---------------------------------------------------------------
    @classmethod
    def open(cls, path: str | Path) -> GoldenSet:
        """Opens and validates a golden set folder (format and version, manifest fields)."""
        folder = Path(path)
        manifest_path = folder / MANIFEST
        if not manifest_path.is_file():
            hint = ""
            previous = folder.with_name(folder.name + ".previous")
            if previous.is_dir():
                hint = f" A capture was interrupted while replacing it: mv {previous} {folder}."
            raise GoldenSetError(
                f"{manifest_path}: no manifest; {folder} is not a golden set.{hint} Capture one "
                f"with: numalign capture MODEL_DIR --out {folder}"
            )
        try:
            data = json.loads(manifest_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise GoldenSetError(
                f"{manifest_path}: not valid JSON ({exc}); capture the set again"
            ) from None
        return cls(folder, Manifest.from_json(data, manifest_path))

    @classmethod
    def open_shared(cls, path: str | Path) -> GoldenSet:
        """The set at ``path`` opened once per process while its manifest stays the same file
        (``settled_stat``): suites replay one set in hundreds of tests, and a set keeps its
        shards open and verified. A manifest rewritten since (a recalibration, a new capture)
        opens the set again."""
        manifest_path = Path(path) / MANIFEST
        key = settled_stat(manifest_path)
        held = _SHARED.get(str(manifest_path))
        if key is not None and held is not None and held[0] == key:
            return held[1]
        golden = cls.open(path)
        if key is not None:
            _SHARED[str(manifest_path)] = (key, golden)
        return golden

    def verify(self, *, contents: bool = False) -> None:
        """Checks every shard's size and sha256 against the manifest; with ``contents``, also
        what the suites rely on: each shard's header parses (offsets in range), and every
        tensor the manifest names is in its shard with the manifest's dtype and shape."""
        for name in self.manifest.shards:
            self.verify_shard(name, cached=False)
        if contents:
            self._verify_contents()

    def _verify_contents(self) -> None:
        from safetensors import SafetensorError, safe_open

        by_shard: dict[str, list[str]] = {}
        for key, info in self.manifest.tensors.items():
            by_shard.setdefault(info.shard, []).append(key)
        for shard, keys in by_shard.items():
            path = self.path / shard
            if shard not in self.manifest.shards:
                raise GoldenSetError(
                    f"{self.path / MANIFEST}: tensor {keys[0]!r} is in shard {shard}, which "
                    "the manifest has no checksum of; capture the set again"
                )
            try:
                with safe_open(str(path), framework="pt", device="cpu") as handle:
                    stored = set(handle.keys())
                    for key in keys:
                        if key not in stored:
                            raise GoldenSetError(
                                f"{path}: tensor {key!r} is missing; capture the set again"
                            )
                        view = handle.get_slice(key)
                        _check_header(path, key, self.manifest.tensors[key], view)
                        handle.get_tensor(key)
            except SafetensorError as exc:
                raise GoldenSetError(
                    f"{path}: unreadable ({exc}); restore it or capture the set again"
                ) from None

    def verify_shard(self, name: str, *, cached: bool = True) -> None:
        """Checks one shard's size and sha256 against the manifest (GoldenSetError naming the
        shard otherwise). With ``cached``, a shard verified before in this process and not
        changed since (the same file, size and times: ``settled_stat``) is not hashed again."""
        info = self.manifest.shards.get(name)
        shard = self.path / name
        if info is None:
            raise GoldenSetError(
                f"{self.path / MANIFEST}: shard {name} has no checksum in the manifest; "
                "capture the set again"
            )
        if not shard.is_file():
            raise GoldenSetError(f"{shard}: shard missing; capture the set again")
        stat = shard.stat()
        settled = settled_stat(shard)
        seen = (info.sha256, settled)
        if cached and settled is not None and seen in _VERIFIED:
            return
        if stat.st_size != info.bytes:
            raise GoldenSetError(
                f"{shard}: {stat.st_size} bytes where the manifest says {info.bytes} "
                "(truncated or overwritten); restore it or capture the set again"
            )
        digest = sha256_file(shard)
        if digest != info.sha256:
            raise GoldenSetError(
                f"{shard}: sha256 {digest[:16]}... does not match the manifest "
                f"({info.sha256[:16]}...): the shard is corrupted; restore it or capture "
                "the set again. Its tensors are not used: a corrupted golden value would blame "
                "the device for the disk's error"
            )
        if settled is not None:
            _VERIFIED.add(seen)

    def fingerprint_matches(self, model_dir: str | Path | None = None) -> bool:
        folder = Path(model_dir) if model_dir else self.model_dir
        try:
            return bool(fingerprint(folder) == self.manifest.model.fingerprint)
        except FileNotFoundError:  # a shard the index names is gone: not the captured model
            return False

    def check_fresh(self, model_dir: str | Path | None = None) -> None:
        """Raises StaleGoldenSetError when the model folder changed since the capture."""
        folder = Path(model_dir or self.model_dir)
        if not folder.is_dir():
            raise GoldenSetError(
                f"{self.path}: its model folder {folder} is missing; restore it, or pass the "
                "model folder explicitly"
            )
        if not self.fingerprint_matches(folder):
            changed = changed_files(self.model.files, folder) if self.model.files else []
            which = f" ({', '.join(changed)})" if changed else ""
            raise StaleGoldenSetError(
                f"the model in {folder} changed since the golden set {self.path} was "
                f"captured{which}: run numalign capture {folder} --out {self.path} again (or "
                "restore the model)"
            )

    # -- contents -----------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.path.name

    @property
    def model(self) -> ModelInfo:
        return self.manifest.model

    @property
    def reference(self) -> ReferenceInfo:
        return self.manifest.reference

    @property
    def model_dir(self) -> Path:
        path = Path(self.model.path)
        return path if path.is_absolute() else (self.path / path).resolve()

    @property
    def points(self) -> list[Point]:
        return sorted(self._points.values(), key=lambda p: p.order)

    def point(self, name: str) -> Point:
        try:
            return self._points[name]
        except KeyError:
            hint = did_you_mean(name, self._points)
            raise GoldenSetError(f"{self.path}: no capture point {name!r}.{hint}") from None

    @property
    def requests(self) -> list[Request]:
        return list(self.manifest.requests)

    def request(self, name: str) -> Request:
        """The request ``name``; the probe calls' pseudo-request (``PROBE_REQUEST``) has no
        model inputs, hence no mask."""
        if name == PROBE_REQUEST:
            return Request(PROBE_REQUEST, {})
        for r in self.manifest.requests:
            if r.name == name:
                return r
        hint = did_you_mean(name, [r.name for r in self.manifest.requests])
        raise GoldenSetError(f"{self.path}: no request {name!r}.{hint}")

    def final_outputs(self, request: str) -> dict[str, str]:
        """The model's own outputs of ``request`` by name, as tensor keys: ``logits`` for
        language models; ``last_hidden_state`` (and ``pooler_output``) for encoders."""
        outputs = dict(self.manifest.outputs.get(request, {}))
        logits = self.manifest.logits.get(request)
        return {"logits": logits, **outputs} if logits else outputs

    def continuation(self, request: str) -> Continuation | None:
        """The greedy continuation captured for ``request``, if any."""
        return self.manifest.continuation.get(request)

    def decode(self, request: str) -> Decode | None:
        """The cached decode captured for ``request``, if any (format 1 sets have none)."""
        return self.manifest.decode.get(request)

    @property
    def decode_requests(self) -> list[str]:
        """The requests with a cached decode, in request order."""
        return [r.name for r in self.manifest.requests if r.name in self.manifest.decode]

    def calibration(self, dtype: str) -> Calibration:
        """The calibration of ``dtype`` (empty where the set has none)."""
        return self.manifest.calibration.get(dtype) or Calibration()

    def calibrated(self, dtype: str, point: str, path: str, mode: str) -> ControlStats | None:
        """The calibration's statistics of one point output and mode in ``dtype`` (None where
        the set has none, or its errors are not finite: a point kept as statistics only has
        a relative L2 error and no max abs)."""
        calibration = self.manifest.calibration.get(dtype)
        stats = calibration.stats(point, path, mode) if calibration is not None else None
        if stats is None or (stats.max_abs is None and stats.rel_l2 is None):
            return None
        return stats

    def calibrated_paths(self, dtype: str, point: str) -> list[str]:
        """The output paths of ``point`` the calibration of ``dtype`` holds."""
        calibration = self.manifest.calibration.get(dtype)
        return list(calibration.points.get(point, {})) if calibration is not None else []

    def output_kind(self, point: str, path: str) -> str:
        """The kind of ``point``'s output ``path`` as the capture stored it
        (``compare.output_kind``): the model's own outputs and the KV cache's states are
        tensors; an output the set does not hold is a GoldenSetError naming it."""
        if point in (OUTPUT_POINT, CACHE_POINT):
            return TENSOR
        kinds = self.point(point).kinds
        if path not in kinds:
            raise GoldenSetError(
                f"{self.path}: capture point {point!r} has no output {path!r} (it has "
                f"{', '.join(kinds) or 'none'})"
            )
        return kinds[path]

    def write_calibration(
        self, dtype: str, calibration: Calibration, *, members: list[str] | None = None
    ) -> None:
        """Stores the calibration of ``dtype`` (over ``members``, the ensemble's descriptions)
        in the set (the manifest replaced atomically)."""
        self.manifest.calibration[dtype] = calibration
        if members is not None:
            self.manifest.ensemble[dtype] = list(members)
        # the power of ``dtype`` was computed from the calibration it replaces: stale
        self.manifest.power.pop(dtype, None)
        write_manifest(self.path, self.manifest)

    def power(self, dtype: str, point: str, path: str, mode: str) -> dict[str, float] | None:
        """What a pass of one point output in ``dtype`` and ``mode`` would catch (``scale``
        relative, ``bias`` in units of the truth's RMS; infinity where nothing would), as
        ``replay.set_power`` stored it; None where the set holds no figure of it."""
        figures = self.manifest.power.get(dtype, {}).get(point, {}).get(path, {}).get(mode)
        return dict(figures) if figures is not None else None

    def write_power(self, power: PowerJson) -> None:
        """Stores the set's power (``replay.set_power``), replacing any before it (the
        manifest replaced atomically)."""
        self.manifest.power = power
        write_manifest(self.path, self.manifest)

    def upgrade(self) -> str | None:
        """Rewrites the manifest of a format 3 set in the current format, its output kinds
        (read from the dtypes it records) stored; returns the format it had, None where it
        is current. A set of format 1 or 2 is a GoldenSetError: what it lacks (decode steps,
        an ensemble's calibration) only a capture makes."""
        found = self.manifest.format
        if found == FORMAT:
            return None
        if found != UPGRADABLE_FORMAT:
            raise GoldenSetError(
                f"{self.path}: format {found} cannot be upgraded to {FORMAT} (it lacks what "
                "only a capture records): capture the set again"
            )
        self.manifest.format = FORMAT
        write_manifest(self.path, self.manifest)
        return found

    def write_dtype_limit(self, dtype: str, reason: str) -> None:
        """Stores that the reference's own code cannot run in ``dtype`` (``reason``: its
        error), dropping any calibration of it (the manifest replaced atomically)."""
        self.manifest.dtype_limits[dtype] = reason
        self.manifest.calibration.pop(dtype, None)
        self.manifest.ensemble.pop(dtype, None)
        self.manifest.power.pop(dtype, None)
        write_manifest(self.path, self.manifest)

    def keys(self) -> Iterator[str]:
        return iter(self.manifest.tensors)

    def tensor(
        self, key: str, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Loads one tensor (only its shard is opened, lazily, after its sha256 is checked
        once per process); floating tensors are cast to ``dtype`` when given."""
        from safetensors import SafetensorError

        info = self.manifest.tensors.get(key)
        if info is None and key in self.manifest.statistics:
            raise StatisticsOnly(str(self.path), key)
        if info is None:
            raise GoldenSetError(
                f"{self.path / MANIFEST}: no tensor {key!r}; the manifest does not match the "
                "shards: capture the set again"
            )
        shard = self.path / info.shard
        try:
            handle, stored = self._shard(info.shard)
            if key not in stored:
                raise GoldenSetError(
                    f"{shard}: tensor {key!r} is missing from the shard; capture again"
                )
            tensor = handle.get_tensor(key)
        except (SafetensorError, OSError) as exc:
            raise GoldenSetError(
                f"{shard}: unreadable ({exc}); the shard is truncated or corrupted: restore it "
                "or capture the set again (numalign golden verify says which)"
            ) from None
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        moved: torch.Tensor = tensor.to(device)
        return moved

    def _shard(self, name: str) -> tuple[Any, frozenset[str]]:
        """The open shard ``name`` and its tensor names, verified against the manifest when
        it is opened (again, when it changed on disk since)."""
        from safetensors import safe_open

        stat = (self.path / name).stat() if (self.path / name).is_file() else None
        seen = (name, stat.st_size, stat.st_mtime_ns) if stat else None
        if seen is None or seen not in self._open:
            self.verify_shard(name)
            stat = (self.path / name).stat()
            seen = (name, stat.st_size, stat.st_mtime_ns)
            handle = safe_open(str(self.path / name), framework="pt", device="cpu")
            self._open = {k: v for k, v in self._open.items() if k[0] != name}
            self._open[seen] = (handle, frozenset(handle.keys()))  # type: ignore[no-untyped-call]
        return self._open[seen]

    def expected(self, key: str) -> torch.Tensor | TensorStatistics:
        """What the set keeps of the tensor ``key`` to judge a candidate against: the tensor,
        or its statistics where the set keeps only those (``core.statistics``; already at
        the positions the request's mask keeps)."""
        info = self.manifest.statistics.get(key)
        if info is None:
            return self.tensor(key)
        return info.statistics(self.tensor(info.sketch))

    def kept_whole(self, key: str) -> bool:
        """Whether the set keeps the tensor ``key`` whole (not as statistics only)."""
        return key not in self.manifest.statistics

    def tensors(self, keys: str | list[str], **kwargs: Any) -> Any:
        if isinstance(keys, list):
            return [self.tensor(k, **kwargs) for k in keys]
        return self.tensor(keys, **kwargs)

    def unique_tensor_bytes(self) -> int:
        return sum(t.bytes for t in self.manifest.tensors.values())

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.iterdir() if p.is_file())


#: safetensors' dtype names, as the manifest writes torch's.
_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip


def _check_header(path: Path, key: str, info: TensorInfo, view: Any) -> None:
    """A shard's header entry for ``key`` agrees with the manifest (GoldenSetError naming
    both otherwise)."""
    dtype = _SAFETENSORS_DTYPES.get(view.get_dtype(), view.get_dtype())
    shape = list(view.get_shape())
    if dtype != info.dtype or shape != list(info.shape):
        raise GoldenSetError(
            f"{path}: tensor {key!r} is {dtype}{shape} where the manifest says "
            f"{info.dtype}{list(info.shape)}; the manifest does not match the shard: capture "
            "the set again"
        )


def write_manifest(folder: Path, manifest: Manifest) -> Path:
    """Writes ``folder/manifest.json`` atomically (a partial manifest never replaces one)."""
    target = folder / MANIFEST
    tmp = folder / f".{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest.to_json(), indent=1, allow_nan=False), encoding="utf-8")
    os.replace(tmp, target)
    return target


def replace_set(tmp: Path, out: Path) -> None:
    """Moves a finished set into place; a set it replaces is renamed aside first (marked
    ``previous`` before the rename, so discovery never replays it) and its files removed
    after, so a kill at any moment leaves one whole set (or an explained .previous). Only the
    files a set consists of are deleted (``folders.remove_written``)."""
    previous = out.with_name(out.name + ".previous")
    if previous.exists() and not (marked(previous) and remove_written(previous)):
        raise GoldenSetError(
            f"{previous}: in the way of replacing {out}, and not a previous set numalign "
            "marked; move it elsewhere (mv it back to its name if it is the set you want)"
        )
    if out.exists():
        mark(out, "previous", name=previous.name)
        os.replace(out, previous)
    os.replace(tmp, out)
    (out / MARKER).unlink(missing_ok=True)
    if previous.exists():
        remove_written(previous)


def discover_sets(folders: Sequence[Path]) -> list[Path]:
    """Golden set folders under each folder (a folder that is itself a set counts); the
    temporary and previous folders numalign marked (``folders.marked``) are not sets."""
    found: list[Path] = []
    for folder in folders:
        if (folder / MANIFEST).is_file() and not marked(folder):
            found.append(folder)
        elif folder.is_dir():
            found += sorted(
                p for p in folder.iterdir() if (p / MANIFEST).is_file() and not marked(p)
            )
    return found
