"""Golden sets: capture from a reference model, the safetensors store, fingerprints, the zoo."""

from numalign.golden.fingerprint import fingerprint
from numalign.golden.store import (
    FORMAT,
    GoldenSet,
    GoldenSetError,
    Point,
    StaleGoldenSetError,
)

__all__ = [
    "FORMAT",
    "GoldenSet",
    "GoldenSetError",
    "Point",
    "StaleGoldenSetError",
    "fingerprint",
]
