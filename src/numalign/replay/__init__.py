"""Replay on the device: device policy, calibration, layer and full-model replay, kernel swap,
and the model verdict's drift records (``replay.verdict``; the verdict itself is
``compare.model_verdict``)."""

from numalign.replay.devices import (
    DeviceUnavailableError,
    configure_torch,
    resolve_device,
    threads_per_worker,
)
from numalign.settings import DEVICE_TYPES, parse_device

__all__ = [
    "DEVICE_TYPES",
    "DeviceUnavailableError",
    "configure_torch",
    "parse_device",
    "resolve_device",
    "threads_per_worker",
]
