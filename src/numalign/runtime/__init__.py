"""Where and how candidates and models run: device policy (``devices``: which device, torch's
set-up per worker, threads per xdist worker), compilation (``compiled``: ``torch.compile``
backends, compiled functions and models, compile cost), the execution variant
(``variant``: the model cache's key and the records' variant fields) and the ways a serving
engine can serve the same requests (``serving``: the arrangements).

Both the operator engine (``ops``) and the replays (``replay``) run through this package;
it imports nothing of them, nor of ``golden``, ``records``, ``report`` or ``plugin``, and
imports torch only where it is used."""

from numalign.runtime.compiled import CompileError, CompileSpec, GraphBreakWarning, compile_spec
from numalign.runtime.devices import (
    DeviceUnavailableError,
    configure_torch,
    resolve_device,
    threads_per_worker,
)
from numalign.runtime.variant import Variant

__all__ = [
    "CompileError",
    "CompileSpec",
    "DeviceUnavailableError",
    "GraphBreakWarning",
    "Variant",
    "compile_spec",
    "configure_torch",
    "resolve_device",
    "threads_per_worker",
]
