"""The long requests' upfront bound: a ``--long`` past the model's positions, or whose
reference forward cannot fit in this machine's memory, is refused before the model loads
(``check_long_request``), with the length that fits."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from numalign.core.errors import UsageError
from numalign.golden.requests import long_length, max_positions

#: Rows of the long requests (``long_requests``: the length and three quarters of it), the
#: batch the memory estimate counts.
LONG_ROWS = 2
#: Config attributes of a model's sizes, first found wins (Llama's names, GPT-2's, T5's).
CONFIG_SIZES = {
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "heads": ("num_attention_heads", "n_head", "num_heads"),
    "kv_heads": ("num_key_value_heads",),
    "head_dim": ("head_dim",),
    "intermediate": ("intermediate_size", "n_inner", "ffn_dim", "d_ff"),
    "vocab": ("vocab_size",),
}


class LongRequestError(UsageError, ValueError):
    """A long request the model's positions or this machine's memory cannot take, refused
    before the model loads; the message says by how much and what --long would do."""


def _attribute(config: Any, name: str) -> Any:
    """``config.name``, None where it has none or will not give one: a config whose layers
    differ raises its own error for a per-layer attribute read globally (Gemma 4's
    ``head_dim``); the bound then counts the size from the others, a lower bound still."""
    try:
        return getattr(config, name, None)
    except Exception:  # transformers' per-layer attribute error derives from no common base
        return None


def _sizes(config: Any) -> dict[str, int]:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    found: dict[str, int] = {}
    for size, names in CONFIG_SIZES.items():
        value = next((v for n in names if isinstance(v := _attribute(text, n), int)), 0)
        found[size] = max(0, value)
    found["kv_heads"] = found["kv_heads"] or found["heads"]
    if not found["head_dim"] and found["heads"]:
        found["head_dim"] = found["hidden"] // found["heads"]
    found["intermediate"] = found["intermediate"] or 4 * found["hidden"]
    return found


def long_request_bytes(config: Any, length: int, dtype_bytes: int, eager: bool) -> dict[str, int]:
    """A lower bound of the memory a long request of ``length`` tokens takes in the reference
    forward, in bytes, by what takes it: eager attention's scores and probabilities of one
    layer (rows x heads x length^2, twice) and its additive mask, the KV cache of every
    layer, one MLP's activations (three of rows x length x intermediate), the logits (float32
    at least). ``dtype_bytes``: the reference dtype's size. A size the config does not give
    counts 0 (a bound, not a measurement: the capture's recorded tensors come on top)."""
    s, rows, n = _sizes(config), LONG_ROWS, length
    return {
        "attention scores": 2 * rows * s["heads"] * n * n * dtype_bytes if eager else 0,
        "attention mask": rows * n * n * (dtype_bytes if eager else 1),
        "KV cache": 2 * s["layers"] * rows * s["kv_heads"] * n * s["head_dim"] * dtype_bytes,
        "MLP activations": 3 * rows * n * s["intermediate"] * dtype_bytes,
        "logits": rows * n * s["vocab"] * max(dtype_bytes, 4),
    }


def available_memory() -> int | None:
    """Bytes this process may still take: ``MemAvailable`` of /proc/meminfo, capped by its
    cgroup's limit less its use (cgroup v2, a container's); None where neither is known."""
    found: list[int] = []
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    cgroup = Path("/sys/fs/cgroup")
    with contextlib.suppress(OSError, ValueError):
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((cgroup / "memory.current").read_text()))
    return min(found) if found else None


def check_long(
    config: Any,
    long: int | None,
    *,
    generated: int,
    dtype_bytes: int,
    eager: bool,
    available: int | None,
) -> None:
    """Refuses, before the model loads, a long request the model cannot take: ``long``
    (None: the default, ``long_length``) with the ``generated`` tokens after it (continuation
    and decode steps) past the model's positions (``max_positions``; the default keeps
    within them), or a memory lower bound (``long_request_bytes``) above ``available`` bytes
    (None: not known, not checked). LongRequestError saying by how much and what fits."""
    option = f"--long {long}" if long is not None else "the default --long"
    length = long_length(config) if long is None else long
    limit = max_positions(config)
    if long is not None and limit is not None and long + generated > limit:
        raise LongRequestError(
            f"{option}: the long requests' {long} tokens and the {generated} generated after "
            f"them (--continuation, --decode-steps) reach position {long + generated}, past "
            f"the model's {limit} positions (its config's max_position_embeddings or "
            f"n_positions): give --long {max(0, limit - generated)} or less, or --long 0 for "
            "no long requests"
        )
    if length <= 0 or available is None:
        return
    parts = long_request_bytes(config, length, dtype_bytes, eager)
    if sum(parts.values()) <= available:
        return
    fits, over = 0, length  # the longest length whose bound fits: a bisection
    while over - fits > 1:
        mid = (fits + over) // 2
        if _fits(config, mid, dtype_bytes, eager, available):
            fits = mid
        else:
            over = mid
    worst = ", ".join(f"{k} {v / 1e9:.1f} GB" for k, v in parts.items() if v)
    raise LongRequestError(
        f"{option}: a long request of {length} tokens needs at least "
        f"{sum(parts.values()) / 1e9:.1f} GB of memory ({worst}), and {available / 1e9:.1f} GB "
        f"is available: give --long {fits} or less (the longest that fits by this estimate), "
        "--long 0 for no long requests, or capture on a machine with more memory"
        + (" (or with --attn-implementation sdpa, which holds no scores)" if eager else "")
    )


def _fits(config: Any, length: int, dtype_bytes: int, eager: bool, available: int) -> bool:
    return sum(long_request_bytes(config, length, dtype_bytes, eager).values()) <= available


def check_long_request(
    model_dir: Path,
    long: int | None,
    generated: int,
    reference_dtype: str,
    attn_implementation: str,
    trust_remote_code: bool,
    *,
    in_memory: bool,
) -> None:
    """``check_long`` of the model in ``model_dir`` (its config alone is read) with
    ``generated`` tokens after the long requests, in ``reference_dtype`` with
    ``attn_implementation``, against this machine's available memory where the reference
    runs in it (``in_memory``: no big-model placement)."""
    import transformers

    if long is not None and long <= 0:
        return
    config = transformers.AutoConfig.from_pretrained(
        model_dir, local_files_only=True, trust_remote_code=trust_remote_code
    )
    check_long(
        config,
        long,
        generated=generated,
        dtype_bytes=8 if reference_dtype == "float64" else 4,
        eager=attn_implementation == "eager",
        available=available_memory() if in_memory else None,
    )
