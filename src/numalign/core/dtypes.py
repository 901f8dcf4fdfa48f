"""The dtype names numalign speaks (``--dtype``, golden manifests, test ids, records) and the
one place they turn into ``torch.dtype`` and back. Importing this module does not import
torch: the plugin loads it at configuration time."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: dtypes candidates may run in (``--dtype``), in the order of its default.
RUN_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16", "float64")
#: The float8 formats quantizers' codes come in (never a run dtype).
FLOAT8_DTYPES: tuple[str, ...] = ("float8_e4m3fn", "float8_e5m2")
#: Every floating dtype numalign names: a test id's parameters are split at the first of them.
NAMES: tuple[str, ...] = (*RUN_DTYPES, *FLOAT8_DTYPES)


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; ValueError naming the valid names otherwise
    (``bf16``, ``torch.float32`` and typos are not guessed)."""
    import torch

    if name not in NAMES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(NAMES)}")
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (any dtype, integers included)."""
    return str(dtype).removeprefix("torch.")
