"""Device policy: which device candidates run on, and how torch is set up per worker.

``auto`` picks the first available accelerator in the order cuda, xpu, npu, mps, else cpu.
A vendor's torch extension (``torch_npu``, say) must be imported first: ``--device-plugin``.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from numalign.core.errors import UsageError

if TYPE_CHECKING:
    import torch


#: Accelerators in the order ``auto`` tries them.
ACCELERATORS: tuple[str, ...] = ("cuda", "xpu", "npu", "mps")
DEVICE_TYPES: tuple[str, ...] = ("auto", "cpu", *ACCELERATORS)
_SPEC = re.compile(r"^(?P<type>[a-z]+)(?::(?P<index>\d+))?$")


def validate_device(text: str) -> str:
    """``text`` as a device spec (lower case), ValueError where ``parse_device`` says."""
    parse_device(text)
    return text.strip().lower()


def parse_device(spec: str) -> tuple[str, int | None]:
    """Checks the syntax of a device spec (``auto``, ``cpu``, ``cuda``, ``cuda:1``, ...)
    without importing torch. Raises ValueError naming the allowed values."""
    match = _SPEC.match(spec.strip().lower())
    if not match or match["type"] not in DEVICE_TYPES:
        raise ValueError(
            f"unknown device {spec!r}; allowed: {', '.join(DEVICE_TYPES)}, "
            "optionally with an index (cuda:1)"
        )
    kind, index = match["type"], match["index"]
    if index is not None and kind in ("auto", "cpu"):
        raise ValueError(f"device {spec!r}: {kind} takes no index")
    return kind, int(index) if index is not None else None


class DeviceUnavailableError(UsageError, RuntimeError):
    """The asked-for device is not present on this machine."""


def _available(kind: str) -> int:
    """How many devices of this type torch can see (0 when none or no backend)."""
    import torch

    if kind == "cpu":
        return 1
    if kind == "mps":
        return int(torch.backends.mps.is_available())
    module = getattr(torch, kind, None)
    if module is None or not hasattr(module, "is_available") or not module.is_available():
        return 0
    return int(module.device_count()) if hasattr(module, "device_count") else 1


def resolve_device(spec: str) -> torch.device:
    """The torch.device for a spec, checked to be present.

    Raises DeviceUnavailableError saying what was found and how to fix it."""
    import torch

    kind, index = parse_device(spec)
    if kind == "auto":
        for accelerator in ACCELERATORS:
            if _available(accelerator):
                return torch.device(accelerator, 0)
        return torch.device("cpu")
    count = _available(kind)
    if count == 0 or (index is not None and index >= count):
        found = [k for k in ("cpu", *ACCELERATORS) if _available(k)]
        plugin = (
            " (for npu, import torch_npu with --device-plugin torch_npu)" if kind == "npu" else ""
        )
        raise DeviceUnavailableError(
            f"device {spec!r} is not available here: torch {torch.__version__} sees "
            f"{count} {kind} device(s); available: {', '.join(found)}. Install a torch build "
            f"for {kind}, load its extension with --device-plugin{plugin}, or pass "
            "--device auto or --device cpu."
        )
    return torch.device(kind, index) if index is not None else torch.device(kind)


def threads_per_worker() -> int:
    """CPU threads for this process: the cores it may use, shared among xdist workers."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    return max(1, cores // max(1, workers))


def configure_torch(*, threads: int, allow_tf32: bool = False) -> None:
    """Sets up torch for reproducible comparisons in this process: thread count,
    deterministic algorithms (warning, not failing, where an op has none) and TF32."""
    import torch

    # cuBLAS needs this before its first handle for deterministic results.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    torch.backends.cudnn.allow_tf32 = allow_tf32
    torch.set_float32_matmul_precision("high" if allow_tf32 else "highest")
