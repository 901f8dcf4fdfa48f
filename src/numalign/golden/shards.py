"""A golden set's tensors written into safetensors shards as a capture runs
(``ShardWriter``: bounded shards, each tensor stored once), and the shards' sha256
(``sha256_file``), which the manifest records and ``store.GoldenSet`` verifies before reading.
"""

from __future__ import annotations

import hashlib
import os
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from numalign.core import dtypes
from numalign.core.statistics import statistics_of
from numalign.golden.manifest import Manifest, ShardInfo, TensorInfo
from numalign.golden.statistics_info import SKETCH_SUFFIX, StatisticsInfo

if TYPE_CHECKING:
    import torch

#: Shards are cut at this size by default: small enough to keep capture memory bounded.
DEFAULT_SHARD_BYTES = 64 << 20


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """The sha256 of the file at ``path`` in hex, read ``chunk`` bytes at a time."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class ShardWriter:
    """Writes a set's tensors into safetensors shards of bounded size as they arrive. A tensor
    already stored (the same storage, still alive, or the same content) is stored once: ``put``
    returns the key that holds it. Each tensor is copied to the CPU when it arrives and dropped
    once its shard is written, so memory stays near one shard."""

    folder: Path
    max_shard_bytes: int = DEFAULT_SHARD_BYTES
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    shards: dict[str, ShardInfo] = field(default_factory=dict)
    _buffer: dict[str, torch.Tensor] = field(default_factory=dict)
    _buffer_bytes: int = 0
    _by_identity: dict[tuple[Any, ...], tuple[str, weakref.ref[torch.Tensor]]] = field(
        default_factory=dict
    )
    _by_content: dict[str, str] = field(default_factory=dict)
    #: tensors kept as statistics only, by key (``put_statistics``)
    statistics: dict[str, StatisticsInfo] = field(default_factory=dict)
    _statistics_by_identity: dict[tuple[Any, ...], tuple[str, weakref.ref[torch.Tensor]]] = field(
        default_factory=dict
    )

    def put(self, key: str, tensor: torch.Tensor) -> str:
        """Stores ``tensor`` under ``key`` unless the same storage or content is already
        stored; returns the key that holds it."""
        t = tensor.detach()
        identity = _identity(t)
        known = self._by_identity.get(identity)
        # Same storage, still alive (a dead tensor's address may be reused by another).
        if known is not None and known[1]() is not None:
            return known[0]
        cpu = t.to("cpu", copy=True).contiguous()
        digest = hashlib.sha256(
            str(cpu.dtype).encode() + str(tuple(cpu.shape)).encode() + _raw_bytes(cpu)
        ).hexdigest()
        if digest in self._by_content:
            existing = self._by_content[digest]
            self._by_identity[identity] = (existing, weakref.ref(tensor))
            return existing
        self._by_identity[identity] = (key, weakref.ref(tensor))
        self._by_content[digest] = key
        nbytes = cpu.numel() * cpu.element_size()
        self._buffer[key] = cpu
        self._buffer_bytes += nbytes
        self.tensors[key] = TensorInfo(
            shard=self._shard_name(len(self.shards) + 1),
            dtype=dtypes.dtype_name(cpu.dtype),
            shape=list(cpu.shape),
            bytes=nbytes,
        )
        if self._buffer_bytes >= self.max_shard_bytes:
            self.flush()
        return key

    def put_statistics(self, key: str, tensor: torch.Tensor, kept: torch.Tensor,
                       width: int) -> str:  # fmt: skip
        """Keeps ``tensor`` as statistics only: those of ``kept`` (its positions a comparison
        reads) and its sketch of ``width`` buckets (``core.statistics``), the sketch stored
        as a tensor under ``key`` + ``SKETCH_SUFFIX``. A tensor already stored whole (the same
        storage, alive) stays whole: its key is returned; one already kept as statistics
        returns that key."""
        identity = _identity(tensor.detach())
        for table in (self._by_identity, self._statistics_by_identity):
            known = table.get(identity)
            if known is not None and known[1]() is not None:
                return known[0]
        stats = statistics_of(kept, width)
        sketch_key = self.put(key + SKETCH_SUFFIX, stats.sketch)
        self.statistics[key] = StatisticsInfo.of(stats, sketch_key)
        self._statistics_by_identity[identity] = (key, weakref.ref(tensor))
        return key

    def release(self) -> None:
        """Forgets storage identities (between forwards)."""
        self._by_identity.clear()
        self._statistics_by_identity.clear()

    @staticmethod
    def _shard_name(index: int) -> str:
        return f"tensors-{index:05d}.safetensors"

    def flush(self) -> None:
        """Writes the buffered tensors as the next shard and drops them."""
        if not self._buffer:
            return
        from safetensors.torch import save_file

        name = self._shard_name(len(self.shards) + 1)
        path = self.folder / name
        save_file(self._buffer, str(path))
        os.chmod(path, 0o666 & ~_umask())  # readable as the manifest is (safetensors: 0600)
        self.shards[name] = ShardInfo(sha256=sha256_file(path), bytes=path.stat().st_size)
        self._buffer = {}
        self._buffer_bytes = 0


def _identity(t: torch.Tensor) -> tuple[Any, ...]:
    """Where a tensor's values live: the same identity is the same tensor while it lives."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            tuple(t.stride()), str(t.dtype), str(t.device))  # fmt: skip


def _raw_bytes(t: torch.Tensor) -> bytes:
    import torch

    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def with_shards(manifest: Manifest, writer: ShardWriter) -> Manifest:
    """The manifest with the writer's tensors, statistics and shards."""
    return replace(manifest, tensors=dict(writer.tensors), shards=dict(writer.shards),
                   statistics=dict(writer.statistics))  # fmt: skip
