"""This machine's throughput, measured briefly (well under a second) so that a plan's time
estimates can be explained: float32 matmul FLOP/s and the read throughput of a temporary
file. Never asserted on in tests: times vary with the machine and its load."""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass

#: Side of the square float32 matmul timed: large enough to run at the BLAS's full rate
#: (2 x 1024^3 = 2.1 GFLOP a call), small enough that a few calls take well under a second.
MATMUL_SIDE = 1024
#: Bytes of the temporary file whose read is timed (64 MiB: several read-ahead windows).
READ_BYTES = 64 * 2**20
#: Seconds each measurement runs at most.
BUDGET_S = 0.3


@dataclass(frozen=True)
class Throughput:
    """Measured float32 matmul FLOP/s and file read bytes/s; ``read_note`` says how the
    file was read (from the disk, or possibly from the page cache: then an upper bound)."""

    flops: float
    read_bytes_s: float
    read_note: str


def measure(folder: str | None = None) -> Throughput:
    """Times float32 matmuls of ``MATMUL_SIDE`` and the read of a ``READ_BYTES`` temporary
    file in ``folder`` (None: the system's temporary folder), each for about ``BUDGET_S``."""
    return Throughput(_matmul_flops(), *_read_rate(folder))


def _matmul_flops() -> float:
    import torch

    a = torch.randn(MATMUL_SIDE, MATMUL_SIDE)
    b = torch.randn(MATMUL_SIDE, MATMUL_SIDE)
    torch.mm(a, b)  # warm-up: the BLAS's threads and packing
    calls, start = 0, time.perf_counter()
    while calls < 2 or time.perf_counter() - start < BUDGET_S:
        torch.mm(a, b)
        calls += 1
    return 2 * MATMUL_SIDE**3 * calls / (time.perf_counter() - start)


def _read_rate(folder: str | None) -> tuple[float, str]:
    """Bytes per second reading a file just written, after asking the kernel to drop it from
    the page cache (``posix_fadvise(DONTNEED)``, where the platform has it)."""
    chunk = os.urandom(2**20)
    with tempfile.NamedTemporaryFile(dir=folder, prefix="numalign-plan-") as handle:
        for _ in range(READ_BYTES // len(chunk)):
            handle.write(chunk)
        handle.flush()
        os.fsync(handle.fileno())
        dropped = hasattr(os, "posix_fadvise")
        if dropped:
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        read, start = 0, time.perf_counter()
        with open(handle.name, "rb", buffering=0) as source:
            while block := source.read(8 * 2**20):
                read += len(block)
                if time.perf_counter() - start > BUDGET_S:
                    break
        rate = read / max(time.perf_counter() - start, 1e-9)
    where = os.path.dirname(handle.name)
    note = (
        f"a {READ_BYTES // 2**20} MiB file in {where}, dropped from the page cache first"
        if dropped
        else f"a {READ_BYTES // 2**20} MiB file in {where}, maybe from the page cache "
        "(an upper bound)"
    )
    return rate, note
