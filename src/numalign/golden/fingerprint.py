"""Model fingerprints: sha256 over config.json, the weight files (every format) and a remote-
code model's modules, in name order, and the
sha256 of each file, so that a changed or missing file (one shard of a sharded checkpoint) is
named, not only noticed."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

from numalign.core.errors import Crashed

#: A file modified less than this many seconds ago is hashed on every call, never trusted
#: from its stat: filesystem timestamps are coarse (a few milliseconds on Linux, 2 s on FAT),
#: so a write within the same tick as the hash would leave size and times unchanged (git's
#: "racily clean" entries, handled the same way).
SETTLE_S = 2.0
#: Fingerprints computed in this process, by the stat of every file they covered.
_FINGERPRINTS: dict[tuple[object, ...], str] = {}


def settled_stat(path: Path) -> tuple[object, ...] | None:
    """What identifies ``path``'s content without reading it (resolved path, inode, size,
    modification and change times), or None when the file changed too recently for its stat
    to be trusted (``SETTLE_S``) or is not there: the caller reads it."""
    try:
        stat = path.stat()
    except OSError:
        return None
    newest = max(stat.st_mtime_ns, stat.st_ctime_ns)
    if time.time_ns() - newest < SETTLE_S * 1e9:
        return None
    return (os.path.realpath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


#: Files that define a model's numerics: its config, its weights in every format
#: from_pretrained loads (safetensors, PyTorch's .bin/.pt/.pth, GGUF; one file, or shards with
#: their index) and the Python modules of a ``trust_remote_code`` model (its own code).
_INDEXES = ("*.safetensors.index.json", "*.bin.index.json", "*.pt.index.json")
_PATTERNS = ("config.json", "*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", *_INDEXES, "*.py")


def model_files(model_dir: Path) -> list[Path]:
    files = {p for pattern in _PATTERNS for p in model_dir.glob(pattern) if p.is_file()}
    return sorted(files, key=lambda p: p.name)


def fingerprint(model_dir: str | Path) -> str:
    """``sha256:<hex>`` over the names and bytes of config.json and the weight files; once
    per process while no file changes (every suite test checks its set fresh: hashing a
    0.5 GB checkpoint each time would cost more than the test)."""
    files = model_files(Path(model_dir))
    stats = tuple(settled_stat(p) for p in files)
    key = (os.path.realpath(model_dir), *stats)
    trusted = bool(files) and None not in stats
    if trusted and key in _FINGERPRINTS:
        return _FINGERPRINTS[key]
    digest = fingerprint_and_files(model_dir)[0]
    if trusted:
        _FINGERPRINTS[key] = digest
    return digest


def fingerprint_and_files(
    model_dir: str | Path, cancelled: threading.Event | None = None
) -> tuple[str, dict[str, str]]:
    """The fingerprint and each file's own sha256 (by file name), in one read of the files.
    A sharded checkpoint's index must name only shards that are there (FileNotFoundError
    naming the missing one otherwise). ``cancelled``: set, the read stops (``Cancelled``)."""
    digest = hashlib.sha256()
    each: dict[str, str] = {}
    for path in checked_model_files(model_dir):
        digest.update(path.name.encode() + b"\0")
        own = hashlib.sha256()
        with path.open("rb") as fh:
            while block := fh.read(1 << 20):
                if cancelled is not None and cancelled.is_set():
                    raise Cancelled(f"hashing {path} was cancelled")
                digest.update(block)
                own.update(block)
        each[path.name] = own.hexdigest()
    return "sha256:" + digest.hexdigest(), each


def checked_model_files(model_dir: str | Path) -> list[Path]:
    """The files a fingerprint covers (``model_files``), after the checks that need no read:
    config.json there (FileNotFoundError), no shard an index names missing
    (FileNotFoundError naming it)."""
    folder = Path(model_dir)
    files = model_files(folder)
    if not any(p.name == "config.json" for p in files):
        raise FileNotFoundError(
            f"{folder / 'config.json'}: not found; give a Hugging Face model folder "
            "(config.json and safetensors weights, as save_pretrained writes)"
        )
    missing = missing_shards(folder)
    if missing:
        raise FileNotFoundError(
            f"{folder / missing[0]}: a shard the checkpoint's index names is missing "
            f"({len(missing)} missing: {', '.join(missing)}); restore it or save the model again"
        )
    return files


class Cancelled(Crashed):
    """A background fingerprint stopped because its caller gave up: the capture it ran
    beside failed (that failure is what the user sees; this one never leaves numalign)."""


class BackgroundFingerprint:
    """``fingerprint_and_files`` of a model folder, computed on a thread of its own while the
    caller goes on (a capture loads and runs the model meanwhile): each file read once, and
    the hashing, which releases the interpreter's lock, runs beside the capture's reads
    instead of before them; on a checkpoint of hundreds of GB that is minutes. The checks
    that need no read (``checked_model_files``) raise here, at once."""

    def __init__(self, model_dir: str | Path) -> None:
        self.bytes = sum(p.stat().st_size for p in checked_model_files(model_dir))
        self._cancelled = threading.Event()
        self._result: tuple[str, dict[str, str]] | None = None
        self._error: BaseException | None = None
        self.seconds = 0.0  # the hashing's own time, once done
        self.waited = 0.0  # how long ``result`` waited for it
        self._start = time.perf_counter()
        self._thread = threading.Thread(
            target=self._run, args=(Path(model_dir),), name="numalign-fingerprint", daemon=True
        )
        self._thread.start()

    def _run(self, model_dir: Path) -> None:
        try:
            self._result = fingerprint_and_files(model_dir, self._cancelled)
        except BaseException as exc:  # handed to the caller by result()
            self._error = exc
        finally:
            self.seconds = time.perf_counter() - self._start

    def result(self) -> tuple[str, dict[str, str]]:
        """The fingerprint and each file's sha256, waiting for the thread; what it raised
        (a file removed meanwhile) is raised here."""
        start = time.perf_counter()
        self._thread.join()
        self.waited = time.perf_counter() - start
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def cancel(self) -> None:
        """Stops the read (the caller failed and will not ask for the result)."""
        self._cancelled.set()
        self._thread.join()

    def throughput(self) -> str:
        """What the hashing read, how fast, and how long the caller waited for it."""
        rate = self.bytes / self.seconds / 1e9 if self.seconds else float("inf")
        return (
            f"{self.bytes / 1e9:.1f} GB of checkpoint hashed in {self.seconds:.0f} s "
            f"({rate:.2f} GB/s) beside the capture, which waited {self.waited:.1f} s for it"
        )


def missing_shards(folder: Path) -> list[str]:
    """The weight files each index (``*.safetensors.index.json``, ``*.bin.index.json``)
    names that are not in ``folder``."""
    missing: set[str] = set()
    for index in sorted(p for pattern in _INDEXES for p in folder.glob(pattern)):
        try:
            names = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (json.JSONDecodeError, KeyError, AttributeError):
            raise ValueError(
                f"{index}: not a checkpoint index (no weight_map); save the model again"
            ) from None
        missing |= {n for n in names if not (folder / n).is_file()}
    return sorted(missing)


def changed_files(recorded: dict[str, str], model_dir: str | Path) -> list[str]:
    """What differs between the files a fingerprint covered (``recorded``: name -> sha256)
    and the folder now: ``NAME (changed)``, ``NAME (missing)``, ``NAME (new)``."""
    folder = Path(model_dir)
    now = {p.name: p for p in model_files(folder)}
    out = [f"{name} (missing)" for name in sorted(set(recorded) - set(now))]
    out += [f"{name} (new)" for name in sorted(set(now) - set(recorded))]
    for name in sorted(set(recorded) & set(now)):
        own = hashlib.sha256()
        with now[name].open("rb") as fh:
            while block := fh.read(1 << 20):
                own.update(block)
        if own.hexdigest() != recorded[name]:
            out.append(f"{name} (changed)")
    return out
