"""An on-disk cache of the operator suite's float64 truths.

The truth of an operator case (its reference run in float64 on the case's inputs rounded to
the target dtype) is deterministic: the same reference, inputs builder, case, dtype and torch
give the same values. Computing it is a large share of a suite's time, so the suite keeps it
on disk, with the rounded inputs it was computed on, and a later run (or another xdist
worker, or another candidate of the same case) reads it back instead.

An entry is found by a sha256 over everything that decides its values:

- the operator's name, and the source (``inspect.getsource``) of its reference and its
  inputs builder, of the modules defining them (their helpers and constants) and of the
  modules of the same package those take names from (``operators._common``), and of
  ``numalign.ops.cases`` (the seeded draws);
- the case: name, parameters and value regime;
- the dtype the inputs were rounded to;
- the torch version (another version is a miss: never trusted without recomputing).

Any change is a miss, and the entry is recomputed and rewritten. A reference whose source
cannot be read (defined in a REPL or by ``exec``) is never cached.

Entries are safetensors files (never pickle) under ``<folder>/<operator>/``: tensors
``inputs.<name>`` and ``truth.<name>``; the metadata holds the key's parts (checked on
reading, so a hash collision or a misplaced file is a miss), the non-tensor inputs as JSON,
and an HMAC-SHA256 of all of it (the metadata and every tensor's bytes) keyed by a secret, so
a truncated, damaged or forged file is recomputed, never trusted. The checksum alone would not
do: whoever writes an entry computes it, so a writer to a shared cache could make a wrong
kernel pass. The secret is ``$NUMALIGN_CACHE_SECRET`` where set (a cache shared by users or
machines: give them all the same secret, as a CI secret), else this user's own, made once in
``~/.cache/numalign/truth-secret`` (mode 0600; ``$XDG_CACHE_HOME`` for ``~/.cache``; with HOME
empty, the home directory of the user's account; never ``/``): entries written by anyone else
are misses.
Writes go to a temporary file in the same folder and are renamed into place, so
parallel workers never read half a file. The folder holds a ``.gitignore`` of ``*``.

The float64 truth is deterministic up to how a CPU reduction is split among threads, which
moves its last bit (1e-16 relative); every verdict allows errors of the target dtype's
rounding (1e-3 for bfloat16) or more, so a truth from a run with other thread counts judges
the same.

The cache is bounded: a session keeps it under ``--truth-cache-size`` (default 4 GB; a
main run of the operator suite writes about 2 GB), evicting the least recently used entries
(a hit touches its file's time) once a write takes it past the cap, down to 90% of it;
``numalign cache info`` and ``numalign cache prune`` show and trim it by hand. Only files of
the cache's own naming (``<operator>/<case>-<dtype>-<32 hex>.safetensors``) are ever removed.

The cache is off unless a session turns it on: the pytest plugin does (``--truth-cache``,
default ``<rootdir>/.numalign-cache/truths`` or ``$NUMALIGN_CACHE/truths``); a script calls
``use_truth_cache(folder)``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import inspect
import json
import os
import re
import secrets
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from numalign.core.errors import UsageError

if TYPE_CHECKING:
    import torch

    from numalign.ops.cases import Case
    from numalign.ops.registry import Operator

#: Format tag of an entry's metadata; a different tag is a miss.
FORMAT = "numalign.truth/2"
#: Environment variable holding the secret a shared cache's entries are signed with.
SECRET_ENV = "NUMALIGN_CACHE_SECRET"
#: Environment variable naming the cache root (truths go to its ``truths/`` folder).
CACHE_ENV = "NUMALIGN_CACHE"
#: The cache root inside the rootdir when ``$NUMALIGN_CACHE`` is not set.
DEFAULT_ROOT = ".numalign-cache"
#: Size a session keeps the cache under by default (``--truth-cache-size``): twice what a
#: main run of the operator suite writes (2 GB), so a run never evicts its own truths.
DEFAULT_MAX_BYTES = 4 * 10**9
#: Eviction goes down to this fraction of the cap, so the next writes do not evict again.
EVICT_TO = 0.9
#: An entry's file name, as ``TruthCache.path`` makes it: what eviction may remove.
_ENTRY_NAME = re.compile(r".+-[0-9a-f]{32}\.safetensors")
#: Values of ``--truth-cache`` that turn the cache off.
OFF_VALUES: tuple[str, ...] = ("off", "none", "no", "false", "0")

Entry = tuple[dict[str, Any], dict[str, Any]]


def default_truth_folder(rootdir: Path) -> Path:
    """``$NUMALIGN_CACHE/truths`` when the variable is set, else
    ``<rootdir>/.numalign-cache/truths``."""
    root = os.environ.get(CACHE_ENV, "").strip()
    return (Path(root) if root else rootdir / DEFAULT_ROOT) / "truths"


def resolve_truth_folder(value: str, rootdir: Path) -> Path | None:
    """The truth folder for a ``--truth-cache`` value: None for ``off``; the default for an
    empty value; else the path, relative to ``rootdir`` when not absolute."""
    text = value.strip()
    if text.lower() in OFF_VALUES:
        return None
    if not text:
        return default_truth_folder(rootdir)
    path = Path(text).expanduser()
    return path if path.is_absolute() else rootdir / path


def _helper_modules(module: ModuleType) -> list[str]:
    """``module`` and the modules of its package its globals come from (helpers such as
    ``operators._common.up``), by name."""
    top = module.__name__.partition(".")[0]
    names = {module.__name__}
    for value in vars(module).values():
        name = value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", None)
        if isinstance(name, str) and name.partition(".")[0] == top and name in sys.modules:
            names.add(name)
    return sorted(names)


@functools.cache
def _source_digest(*functions: Callable[..., Any]) -> str | None:
    """sha256 over the source of ``functions``, of the modules defining them and the
    modules of their package those import from, and of ``numalign.ops.cases``; None when a
    source cannot be read."""
    digest = hashlib.sha256()
    try:
        for fn in functions:
            target = inspect.unwrap(fn)
            digest.update(inspect.getsource(target).encode())
            module = inspect.getmodule(target)
            for name in _helper_modules(module) if module is not None else []:
                digest.update(inspect.getsource(sys.modules[name]).encode())
        digest.update(inspect.getsource(sys.modules["numalign.ops.cases"]).encode())
    except (OSError, TypeError):
        return None
    return digest.hexdigest()


def _json_exact(value: Any) -> bool:
    """Whether ``value`` comes back from JSON equal and of the same types."""
    if value is None or type(value) in (bool, int, float, str):
        return True
    if type(value) is dict:
        return all(type(k) is str and _json_exact(v) for k, v in value.items())
    if type(value) is list:
        return all(_json_exact(v) for v in value)
    return False


class CacheSecretError(UsageError, RuntimeError):
    """The truth cache's secret has nowhere to live (no ``$NUMALIGN_CACHE_SECRET``, no
    ``$XDG_CACHE_HOME``, and no home directory to write to); the message says what to set."""


def secret_path() -> Path:
    """Where this user's own secret lives: ``$XDG_CACHE_HOME/numalign/truth-secret`` where
    that is an absolute path (a relative one is ignored, as the XDG rule says), else
    ``~/.cache/numalign/truth-secret``, ``~`` being ``$HOME``, or where HOME is unset or
    empty this user's home directory in the password database (Python's ``Path.home()``
    makes an empty HOME ``/``: the secret went to ``/.cache``). A home that is the
    filesystem's root or not an absolute path is none: CacheSecretError saying what to set."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "numalign" / "truth-secret"
    home = os.environ.get("HOME", "")
    what = "HOME"
    if not home:
        what = "HOME is empty and this user's home directory"
        try:
            import pwd

            home = pwd.getpwuid(os.getuid()).pw_dir
        except (ImportError, KeyError):  # no password database (Windows), or no entry
            home = ""
    folder = Path(home)
    if not home or not folder.is_absolute() or folder == Path(folder.anchor):
        raise CacheSecretError(
            f"the truth cache's secret has no home: {what} ({home!r}) is not a folder to "
            "write to; set NUMALIGN_CACHE_SECRET (a cache shared by machines), XDG_CACHE_HOME "
            "or HOME, or turn the cache off with --truth-cache off"
        )
    return folder / ".cache" / "numalign" / "truth-secret"


def cache_secret() -> bytes:
    """The key entries are signed with: ``$NUMALIGN_CACHE_SECRET`` (a cache shared by
    several users or machines: CI sets the same secret everywhere), else this user's own,
    created once at ``secret_path()`` (``~/.cache/numalign/truth-secret``), readable by this
    user only; CacheSecretError where it has nowhere to live."""
    shared = os.environ.get(SECRET_ENV, "")
    if shared:
        return shared.encode()
    path = secret_path()
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".truth-secret.")  # mode 0600
    with os.fdopen(fd, "wb") as fh:
        fh.write(secrets.token_hex(32).encode())
    try:
        os.link(tmp, path)  # never replaces a secret another process made meanwhile
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return path.read_bytes()


def _checksum(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str], secret: bytes
) -> str:
    """HMAC-SHA256, keyed by ``secret``, over the entry's metadata (its key, input names and
    plain inputs) and every tensor's name, dtype, shape and bytes, in name order: only a
    writer holding the secret makes an entry this reader trusts."""
    import torch

    digest = hmac.new(secret, digestmod=hashlib.sha256)
    digest.update(json.dumps({k: metadata[k] for k in sorted(metadata) if k != "checksum"},
                             sort_keys=True).encode())  # fmt: skip
    for name in sorted(tensors):
        tensor = tensors[name]
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        if tensor.numel():
            digest.update(tensor.reshape(-1).contiguous().view(torch.uint8).numpy().data)
    return digest.hexdigest()


@dataclass
class TruthCache:
    """The truths under ``folder``; ``stats`` counts hits, misses, rejected (unreadable,
    damaged or mismatched) entries and writes."""

    folder: Path
    stats: dict[str, int] = field(
        default_factory=lambda: {"hit": 0, "miss": 0, "rejected": 0, "written": 0, "evicted": 0}
    )
    #: The cap in bytes (0: none); see the module's docstring.
    max_bytes: int = 0
    #: Bytes this process believes the cache holds (scanned at its first write, then grown by
    #: its writes; other workers' writes are seen at the next eviction's scan).
    _size: int | None = None

    @functools.cached_property
    def secret(self) -> bytes:
        return cache_secret()

    def key(self, op: Operator, case: Case, dtype: torch.dtype) -> dict[str, str] | None:
        """The parts that decide the entry's values, or None when the operator's source
        cannot be read (then nothing is cached)."""
        import torch

        sources = _source_digest(op.reference, op.make_inputs)
        if sources is None:
            return None
        return {
            "format": FORMAT,
            "operator": op.name,
            "sources": sources,
            "case": case.name,
            "params": json.dumps(dict(case.params), sort_keys=True, default=repr),
            "regime": case.regime,
            "dtype": str(dtype),
            "torch": str(torch.__version__),
        }

    def path(self, key: Mapping[str, str]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        readable = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{key['case']}-{key['dtype']}")[:80]
        operator = re.sub(r"[^A-Za-z0-9._-]+", "_", key["operator"])
        return self.folder / operator / f"{readable}-{digest[:32]}.safetensors"

    def load(self, op: Operator, case: Case, dtype: torch.dtype) -> Entry | None:
        """The stored (rounded inputs, truth), or None on a miss. An entry that cannot be
        read, fails its checksum or belongs to another key is a miss (and is rewritten by
        the next ``store``)."""
        key = self.key(op, case, dtype)
        if key is None:
            return None
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:
            self.stats["miss"] += 1
            return None
        entry = _decode(data, key, self.secret)
        if entry is None:
            self.stats["rejected"] += 1
            return None
        self.stats["hit"] += 1
        with contextlib.suppress(OSError):  # its time is its last use: LRU eviction reads it
            os.utime(path)
        return entry

    def store(
        self,
        op: Operator,
        case: Case,
        dtype: torch.dtype,
        inputs: Mapping[str, Any],
        truth: Mapping[str, Any],
    ) -> Path | None:
        """Writes (inputs, truth) atomically; returns the path, or None when the entry
        cannot be cached (unreadable source, an output that is not a tensor, an input that
        is neither a tensor nor plain JSON) or the folder cannot be written."""
        import torch

        key = self.key(op, case, dtype)
        if key is None or not all(isinstance(v, torch.Tensor) for v in truth.values()):
            return None
        tensors: dict[str, torch.Tensor] = {}
        plain: dict[str, Any] = {}
        for name, value in inputs.items():
            if isinstance(value, torch.Tensor):
                tensors[f"inputs.{name}"] = value
            elif _json_exact(value):
                plain[name] = value
            else:
                return None
        for name, value in truth.items():
            tensors[f"truth.{name}"] = value
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        metadata = {
            "numalign": json.dumps(key, sort_keys=True),
            "inputs": json.dumps(list(inputs)),
            "truth": json.dumps(list(truth)),
            "plain": json.dumps(plain),
        }
        metadata["checksum"] = _checksum(tensors, metadata, self.secret)
        path = self.path(key)
        try:
            _write_atomic(path, lambda target: _save(tensors, metadata, target))
        except Exception:  # an unwritable folder or an unsupported dtype: just don't cache
            return None
        self.stats["written"] += 1
        if self.max_bytes:
            self._size = (cache_size(self.folder) if self._size is None else self._size) + (
                path.stat().st_size
            )
            if self._size > self.max_bytes:
                removed, _ = prune_truths(self.folder, int(self.max_bytes * EVICT_TO))
                self.stats["evicted"] += removed
                self._size = cache_size(self.folder)
        return path


def cache_entries(folder: Path) -> list[tuple[Path, int, float]]:
    """The cache's entries as (path, bytes, time of last use), least recently used first;
    only files of the cache's own naming."""
    out = []
    for path in folder.glob("*/*.safetensors") if folder.is_dir() else []:
        if not _ENTRY_NAME.fullmatch(path.name):
            continue
        try:
            stat = path.stat()
        except OSError:  # removed by another worker meanwhile
            continue
        out.append((path, stat.st_size, stat.st_mtime))
    return sorted(out, key=lambda e: (e[2], str(e[0])))


def cache_size(folder: Path) -> int:
    """Bytes the cache's entries take."""
    return sum(size for _, size, _ in cache_entries(folder))


def prune_truths(folder: Path, max_bytes: int) -> tuple[int, int]:
    """Removes the least recently used entries until the cache takes at most ``max_bytes``
    (0: removes every entry); returns (entries removed, bytes freed). A worker reading an
    entry removed meanwhile gets a miss and computes the truth again."""
    entries = cache_entries(folder)
    total = sum(size for _, size, _ in entries)
    removed = freed = 0
    for path, size, _ in entries:
        if total - freed <= max_bytes:
            break
        path.unlink(missing_ok=True)
        removed, freed = removed + 1, freed + size
    return removed, freed


def _save(tensors: dict[str, torch.Tensor], metadata: dict[str, str], target: str) -> None:
    """safetensors.torch.save_file, on copies where tensors share memory (it refuses)."""
    from safetensors.torch import save_file

    try:
        save_file(tensors, target, metadata=metadata)
    except RuntimeError:
        save_file({k: v.clone() for k, v in tensors.items()}, target, metadata=metadata)


def _write_atomic(path: Path, write: Callable[[str], None]) -> None:
    """Calls ``write`` on a temporary file beside ``path`` and renames it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ignore = path.parent.parent / ".gitignore"
    if not ignore.exists():
        ignore.write_text("# created by numalign: the truth cache is not versioned\n*\n")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _decode(data: bytes, key: Mapping[str, str], secret: bytes) -> Entry | None:
    """(inputs, truth) from an entry's bytes, or None when they are not a sound entry of
    ``key``."""
    try:
        from safetensors.torch import load

        size = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8 : 8 + size])["__metadata__"]
        if json.loads(metadata["numalign"]) != dict(key):
            return None
        tensors = load(data)
        if not hmac.compare_digest(_checksum(tensors, metadata, secret), metadata["checksum"]):
            return None
        plain = json.loads(metadata["plain"])
        inputs = {
            name: plain[name] if name in plain else tensors[f"inputs.{name}"]
            for name in json.loads(metadata["inputs"])
        }
        truth = {name: tensors[f"truth.{name}"] for name in json.loads(metadata["truth"])}
    except Exception:  # truncated, damaged, or not an entry at all
        return None
    return inputs, truth


_active: TruthCache | None = None


def use_truth_cache(folder: Path | str | None, max_bytes: int = 0) -> TruthCache | None:
    """Turns the cache on in ``folder`` (off for None) for this process, kept under
    ``max_bytes`` (0: no cap); returns the cache that was active before. CacheSecretError
    (the cache stays as it was) where its secret has nowhere to live (``secret_path``)."""
    global _active
    if folder is not None and not os.environ.get(SECRET_ENV, ""):
        secret_path()  # CacheSecretError before any test where the secret can live nowhere
    previous = _active
    _active = TruthCache(Path(folder), max_bytes=max_bytes) if folder is not None else None
    return previous


def restore_truth_cache(cache: TruthCache | None) -> None:
    """Makes ``cache`` (a value ``use_truth_cache`` returned) the active one again."""
    global _active
    _active = cache


def active_truth_cache() -> TruthCache | None:
    """The cache this process uses, or None when it is off."""
    return _active
