"""The golden set store, format 1: ``manifest.json`` plus safetensors shards.

Only JSON and safetensors are read, never pickle. Every error names the file and the remedy.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from numalign.golden.fingerprint import fingerprint
from numalign.names import did_you_mean

if TYPE_CHECKING:
    import torch

FORMAT = "numalign.golden/1"
MANIFEST = "manifest.json"
#: The calibration's name for the model's own outputs (logits, an encoder's hidden states).
OUTPUT_POINT = "(output)"
#: Shards verified against the manifest's sha256 in this process: (path, sha256, size, mtime).
_VERIFIED: set[tuple[str, str, int, int]] = set()


class GoldenSetError(RuntimeError):
    """A golden set that cannot be used as it is; the message says why and what to do."""


class StaleGoldenSetError(GoldenSetError):
    """The model folder changed since the set was captured."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class Call:
    """One call of a capture point's module in one request: tensor keys of its positional
    inputs (None where the input was not a tensor; its JSON value is in ``args_json``),
    keyword inputs and outputs (by output path, "0" for a plain tensor)."""

    args: tuple[str | None, ...]
    args_json: tuple[Any, ...]
    kwargs: dict[str, str | list[str]]
    kwargs_json: dict[str, Any]
    outputs: dict[str, str]


@dataclass(frozen=True)
class Point:
    """A capture point: a module of the reference model, in forward order."""

    name: str
    type: str
    order: int
    calls: dict[str, list[Call]]  # request name -> calls in that request's forward


class GoldenSet:
    """A golden set on disk; tensors load lazily, shard by shard, to a device and dtype."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest
        self._points = {
            p["name"]: Point(
                name=p["name"],
                type=p["type"],
                order=p["order"],
                calls={
                    req: [
                        Call(
                            args=tuple(c["args"]),
                            args_json=tuple(c.get("args_json", [None] * len(c["args"]))),
                            kwargs=c["kwargs"],
                            kwargs_json=c.get("kwargs_json", {}),
                            outputs=c["outputs"],
                        )
                        for c in calls
                    ]
                    for req, calls in p["calls"].items()
                },
            )
            for p in manifest["points"]
        }

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
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise GoldenSetError(
                f"{manifest_path}: not valid JSON ({exc}); capture the set again"
            ) from None
        found = manifest.get("format")
        if found != FORMAT:
            raise GoldenSetError(
                f"{manifest_path}: format {found!r} is not {FORMAT!r}; this numalign reads "
                f"{FORMAT} only: capture the set again with this version"
            )
        for field in ("model", "reference", "requests", "points", "tensors", "shards"):
            if field not in manifest:
                raise GoldenSetError(f"{manifest_path}: missing field {field!r}; capture again")
        return cls(folder, manifest)

    def verify(self) -> None:
        """Checks every shard's size and sha256 against the manifest."""
        for name in self.manifest["shards"]:
            self.verify_shard(name, cached=False)

    def verify_shard(self, name: str, *, cached: bool = True) -> None:
        """Checks one shard's size and sha256 against the manifest (GoldenSetError naming the
        shard otherwise). With ``cached``, a shard verified before in this process and not
        changed since (same size and modification time) is not hashed again."""
        info = self.manifest["shards"].get(name)
        shard = self.path / name
        if info is None:
            raise GoldenSetError(
                f"{self.path / MANIFEST}: shard {name} has no checksum in the manifest; "
                "capture the set again"
            )
        if not shard.is_file():
            raise GoldenSetError(f"{shard}: shard missing; capture the set again")
        stat = shard.stat()
        seen = (str(shard.resolve()), str(info["sha256"]), stat.st_size, stat.st_mtime_ns)
        if cached and seen in _VERIFIED:
            return
        if stat.st_size != info["bytes"]:
            raise GoldenSetError(
                f"{shard}: {stat.st_size} bytes where the manifest says {info['bytes']} "
                "(truncated or overwritten); restore it or capture the set again"
            )
        digest = sha256_file(shard)
        if digest != info["sha256"]:
            raise GoldenSetError(
                f"{shard}: sha256 {digest[:16]}... does not match the manifest "
                f"({info['sha256'][:16]}...): the shard is corrupted; restore it or capture "
                "the set again. Its tensors are not used: a corrupted golden value would blame "
                "the device for the disk's error"
            )
        _VERIFIED.add(seen)

    def fingerprint_matches(self, model_dir: str | Path | None = None) -> bool:
        folder = Path(model_dir) if model_dir else self.model_dir
        return bool(fingerprint(folder) == self.manifest["model"]["fingerprint"])

    def check_fresh(self, model_dir: str | Path | None = None) -> None:
        """Raises StaleGoldenSetError when the model folder changed since the capture."""
        folder = Path(model_dir or self.model_dir)
        if not folder.is_dir():
            raise GoldenSetError(
                f"{self.path}: its model folder {folder} is missing; restore it, or pass the "
                "model folder explicitly"
            )
        if not self.fingerprint_matches(folder):
            raise StaleGoldenSetError(
                f"the model in {folder} changed since the golden set {self.path} was captured: "
                f"run numalign capture {folder} --out {self.path} again"
            )

    # -- contents -----------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.path.name

    @property
    def model_dir(self) -> Path:
        path = Path(self.manifest["model"]["path"])
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
    def requests(self) -> list[dict[str, Any]]:
        return list(self.manifest["requests"])

    def final_outputs(self, request: str) -> dict[str, str]:
        """The model's own outputs of ``request`` by name, as tensor keys: ``logits`` for
        language models; ``last_hidden_state`` (and ``pooler_output``) for encoders."""
        outputs = dict(self.manifest.get("outputs", {}).get(request, {}))
        logits = self.manifest.get("logits", {}).get(request)
        return {"logits": logits, **outputs} if logits else outputs

    def calibration(self, dtype: str) -> dict[str, Any]:
        return dict(self.manifest.get("calibration", {}).get(dtype, {}))

    def keys(self) -> Iterator[str]:
        return iter(self.manifest["tensors"])

    def tensor(
        self, key: str, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Loads one tensor (only its shard is opened, lazily, after its sha256 is checked
        once per process); floating tensors are cast to ``dtype`` when given."""
        from safetensors import SafetensorError, safe_open

        info = self.manifest["tensors"].get(key)
        if info is None:
            raise GoldenSetError(
                f"{self.path / MANIFEST}: no tensor {key!r}; the manifest does not match the "
                "shards: capture the set again"
            )
        shard = self.path / info["shard"]
        self.verify_shard(info["shard"])
        try:
            with safe_open(str(shard), framework="pt", device="cpu") as fh:
                if key not in fh.keys():  # noqa: SIM118 - safe_open has no __contains__
                    raise GoldenSetError(
                        f"{shard}: tensor {key!r} is missing from the shard; capture again"
                    )
                tensor = fh.get_tensor(key)
        except (SafetensorError, OSError) as exc:
            raise GoldenSetError(
                f"{shard}: unreadable ({exc}); the shard is truncated or corrupted: restore it "
                "or capture the set again (numalign golden verify says which)"
            ) from None
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        moved: torch.Tensor = tensor.to(device)
        return moved

    def tensors(self, keys: str | list[str], **kwargs: Any) -> Any:
        if isinstance(keys, list):
            return [self.tensor(k, **kwargs) for k in keys]
        return self.tensor(keys, **kwargs)

    def unique_tensor_bytes(self) -> int:
        return sum(int(t["bytes"]) for t in self.manifest["tensors"].values())

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.iterdir() if p.is_file())
