"""Replay on the device: device policy (and, later, layer and full-model replay)."""

from numalign.replay.devices import (
    DEVICE_TYPES,
    DeviceUnavailableError,
    configure_torch,
    parse_device,
    resolve_device,
    threads_per_worker,
)

__all__ = [
    "DEVICE_TYPES",
    "DeviceUnavailableError",
    "configure_torch",
    "parse_device",
    "resolve_device",
    "threads_per_worker",
]
