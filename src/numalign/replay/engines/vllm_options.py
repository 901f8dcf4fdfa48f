"""What the vLLM engine is started with for a replay: its process environment and the
guards vLLM's CPU build needs before it starts (a oneDNN cap its bfloat16 GEMMs cannot run
under, refused; the AMX tile state asked for), the options of a serving arrangement (token
budget, rows, prefix cache, KV block, golden tokens forced or proposed as drafts), its KV cache
sized to the replay, and what of an arrangement one running engine is shared by
(``configuration``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from numalign.core import dtypes
from numalign.replay.engines.vllm_drafts import GOLDEN_DRAFTS
from numalign.replay.engines.vllm_serving import (
    KV_BLOCK,
    decode_step_count,
    forcing_processor,
    row_lengths,
)

if TYPE_CHECKING:
    from numalign.golden.store import GoldenSet
    from numalign.runtime.serving import Arrangement

#: vLLM in this process (its engine core in-process: hooks reach the model, nothing is
#: pickled) and its CPU threads left where the worker put them (xdist workers share cores).
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


#: Tokens per engine step: the zoo's 16- and 24-token prompts are prefilled in chunks beside
#: other rows' decode steps (continuous batching with chunked prefill).
MAX_BATCH_TOKENS = 32


#: Rows served at once (the zoo's sets have 8 rows).
MAX_ROWS = 16


#: The KV cache a replay reserves: what its rows need, MARGIN times over, at least FLOOR (a
#: cache sized to the replay, not a share of the machine: on CPU vLLM's share counts the whole
#: process's memory, golden tensors and a previous engine's pages included).
KV_MARGIN, KV_FLOOR_BYTES = 4, 64 << 20


#: oneDNN's instruction sets in its order, as ``ONEDNN_MAX_CPU_ISA`` names them, and the
#: lowest that builds the bfloat16 GEMMs vLLM's CPU build asks it for.
ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
               "AVX512_CORE_VNNI", "AVX512_CORE_BF16", "AVX10_1_512", "AVX10_1_512_AMX",
               "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2")  # fmt: skip


ONEDNN_BF16_ISA = "AVX512_CORE_BF16"


def onednn_capped_below(dtype: str) -> str | None:
    """Why oneDNN, capped by ``ONEDNN_MAX_CPU_ISA``, cannot run vLLM's CPU GEMMs in
    ``dtype`` (None where it can): vLLM chooses its bfloat16 oneDNN kernels from the
    hardware, and below AVX512_CORE_BF16 oneDNN refuses to build them and the process aborts
    (vLLM 0.32.0; float32 and float16 run under any cap)."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if dtype != "bfloat16" or cap not in ONEDNN_ISAS:
        return None
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu":  # the cap is the CPU build's concern only
        return None
    if ONEDNN_ISAS.index(cap) >= ONEDNN_ISAS.index(ONEDNN_BF16_ISA):
        return None
    return (
        f"ONEDNN_MAX_CPU_ISA={cap} caps oneDNN below {ONEDNN_BF16_ISA}, which vLLM's CPU "
        "bfloat16 GEMMs need (they choose their kernels from the hardware, and the process "
        "aborts when oneDNN refuses them); replay bfloat16 through vLLM without the cap, "
        f"or with {ONEDNN_BF16_ISA} or above"
    )


def allow_amx() -> None:
    """Asks Linux for the AMX tile state where the CPU has AMX. vLLM's CPU attention chooses
    its AMX kernel from the hardware alone and relies on oneDNN having asked for it; with
    oneDNN capped below AMX (``ONEDNN_MAX_CPU_ISA=AVX2``, as the honest matrix and the
    calibration members run) nobody asks, and the first attention kills the process with an
    illegal instruction (vLLM 0.32.0). Its own kernels do not follow the cap either way."""
    import torch

    if torch.cpu._is_amx_tile_supported():
        torch._C._cpu._init_amx()


def configuration(arrangement: Arrangement) -> tuple[Any, ...]:
    """What of ``arrangement`` the engine is started with (arrangements that agree on it share
    one running engine)."""
    return (arrangement.batch_tokens or MAX_BATCH_TOKENS, arrangement.rows or MAX_ROWS,
            arrangement.prefix_cached, arrangement.spare_blocks,
            arrangement.speculative)  # fmt: skip


def serving_options(
    golden: GoldenSet, dtype: str, arrangement: Arrangement, length: int
) -> dict[str, Any]:
    """vLLM's engine options for ``arrangement``: the token budget and rows a step, the
    prefix cache, the KV block size (``KV_BLOCK`` on the CPU and where blocks are counted),
    the KV cache: sized to the replay, or for the preempted arrangement a number of blocks
    only slightly above what the longest row (``length`` tokens) needs; and the golden
    tokens forced (a logits processor) or, speculative, proposed as drafts."""
    from vllm.platforms import current_platform

    rows = arrangement.rows or MAX_ROWS
    copies = -(-rows // max(1, len(row_lengths(golden)))) if arrangement.crowded else 1
    options: dict[str, Any] = {
        # vLLM warns of a budget past what its rows can schedule: no more than that
        "max_num_batched_tokens": min(arrangement.batch_tokens or MAX_BATCH_TOKENS, rows * length),
        "max_num_seqs": rows,
        "enable_prefix_caching": arrangement.prefix_cached,
        "kv_cache_memory_bytes": _kv_cache_bytes(golden, dtype, copies),
    }
    # a GPU keeps its backend's block unless the arrangement counts blocks
    if current_platform.device_type == "cpu" or arrangement.spare_blocks is not None:
        options["block_size"] = KV_BLOCK
    if arrangement.speculative:
        # the golden tokens are the drafts (``vllm_drafts``): enough of them that one
        # verification covers every decode step after the first; the tokens are not forced,
        # as vLLM takes no logits processor with speculative decoding
        drafts = max(1, decode_step_count(golden) - 1)
        options["speculative_config"] = {"method": "custom_class", "model": GOLDEN_DRAFTS,
                                         "num_speculative_tokens": drafts}  # fmt: skip
    else:  # every decode row teacher-forced with the golden tokens
        options["logits_processors"] = [forcing_processor()]
    if arrangement.spare_blocks is not None:
        # and one block more: vLLM's block pool holds one back (its null block)
        blocks = -(-length // KV_BLOCK) + arrangement.spare_blocks + 1
        options["num_gpu_blocks_override"] = blocks
        # admitted on their first chunk alone (not their whole prompt), rows then compete
        # for blocks as their prefill goes on, and the scheduler preempts
        options["scheduler_reserve_full_isl"] = False
    return options


def _kv_cache_bytes(golden: GoldenSet, dtype: str, copies: int = 1) -> int:
    """The KV cache the set's rows need (keys and values of every layer for every position
    served, each row rounded up to whole blocks of ``KV_BLOCK`` tokens, and one block more),
    ``copies`` times (a crowded serving runs copies of the rows beside them) and KV_MARGIN
    times over, at least KV_FLOOR_BYTES."""
    import json

    config = json.loads((golden.model_dir / "config.json").read_text(encoding="utf-8"))
    config = config.get("text_config", config)
    heads = int(config.get("num_attention_heads") or 1)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config.get("hidden_size") or 64) // heads)
    layers = int(config.get("num_hidden_layers") or 1)
    steps = decode_step_count(golden) + 1
    tokens = sum(-(-(n + steps) // KV_BLOCK) * KV_BLOCK + KV_BLOCK for n in row_lengths(golden))
    per_token = 2 * layers * kv_heads * head_dim * int(dtypes.torch_dtype(dtype).itemsize)
    return max(KV_FLOOR_BYTES, KV_MARGIN * copies * tokens * per_token)
