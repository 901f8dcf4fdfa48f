"""The vision side of image-text models and the token embedding: the patch embedding of
Qwen2-VL (a Conv3d with kernel = stride over (frames, height, width) of each patch), and the
embedding lookup."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from numalign.ops.cases import Case, table_ids, values
from numalign.ops.registry import Operator, candidate, register_operator
from operators._common import tier_cases, up

PATCH_CASES = tier_cases(
    Case("one-1x1x1x1-e1", {"patches": 1, "channels": 1, "frames": 1, "patch": 1, "embed": 1}),
    Case("small-7x3x2x4-e16", {"patches": 7, "channels": 3, "frames": 2, "patch": 4, "embed": 16}),
    Case(
        "qwen2vl-64x3x2x14-e1280",
        {"patches": 64, "channels": 3, "frames": 2, "patch": 14, "embed": 1280},
    ),
    Case(
        "large-9x3x2x14-e64",
        {"patches": 9, "channels": 3, "frames": 2, "patch": 14, "embed": 64},
        regime="large",
    ),
    Case(
        "image-1024x3x2x14-e1280",
        {"patches": 1024, "channels": 3, "frames": 2, "patch": 14, "embed": 1280},
        tier="pr",
    ),
    Case(
        "video-16384x3x2x14-e1280",
        {"patches": 16384, "channels": 3, "frames": 2, "patch": 14, "embed": 1280},
        tier="nightly",
    ),
)


def patch_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    c, t, p, e = case["channels"], case["frames"], case["patch"], case["embed"]
    k = c * t * p * p
    return {
        # normalized pixel values: about unit variance after the processor's mean/std
        "pixels": values((case["patches"], c, t, p, p), case.regime, gen),
        "weight": values((e, c, t, p, p), "ordinary", gen) / k**0.5,
    }


def patch_embed_reference(pixels: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each patch flattened, times the flattened kernel: unfold plus linear."""
    flat = up(pixels).reshape(pixels.shape[0], -1)
    return (flat @ up(weight).reshape(weight.shape[0], -1).T).to(pixels.dtype)


register_operator(
    Operator(
        name="patch_embed",
        op_class="matmul",
        reference=patch_embed_reference,
        make_inputs=patch_inputs,
        cases=PATCH_CASES,
        reduction_length=lambda case: case["channels"] * case["frames"] * case["patch"] ** 2,
        hf_modules=("*PatchEmbed",),
        description="vision patch embedding (Conv3d, kernel = stride)",
    )
)


@candidate("patch_embed", name="conv3d")
def patch_embed_conv3d(pixels: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What Qwen2-VL's module runs: F.conv3d with stride equal to the kernel."""
    kernel = tuple(weight.shape[2:])
    out = F.conv3d(up(pixels), up(weight), stride=kernel)
    return out.reshape(pixels.shape[0], -1).to(pixels.dtype)


EMBED_CASES = tier_cases(
    Case("one-1-v1x1", {"tokens": 1, "vocab": 1, "hidden": 1}),
    Case("repeats-33-v50x64", {"tokens": 33, "vocab": 50, "hidden": 64}),
    Case(
        "outliers-16-v1000x4096", {"tokens": 16, "vocab": 1000, "hidden": 4096}, regime="outliers"
    ),
    # every shard boundary of 2, 4 and 8 ranks and the 16-bit limit of Qwen's vocabulary
    Case("shards-24-v151936x8", {"tokens": 24, "vocab": 151936, "hidden": 8}),
    Case("llm-512-v151936x64", {"tokens": 512, "vocab": 151936, "hidden": 64}, tier="pr"),
    Case("empty-0-v10x8", {"tokens": 0, "vocab": 10, "hidden": 8}, tier="pr"),
)


def embed_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    """ids [tokens]: the table's shard boundaries, first and last rows first (``table_ids``),
    where an off-by-one reads the wrong shard or past the table; table [vocab, hidden]."""
    ids = table_ids(case["vocab"], case["tokens"], gen)
    return {"ids": ids, "table": values((case["vocab"], case["hidden"]), case.regime, gen)}


def embedding_reference(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[ids.to(table.device)]


register_operator(
    Operator(
        name="embedding",
        aten=("embedding",),
        op_class="gather-scatter",
        reference=embedding_reference,
        make_inputs=embed_inputs,
        cases=EMBED_CASES,
        hf_modules=("Embedding", "*ScaledWordEmbedding"),
        adapter=lambda m: {"table": m.weight},
        description="token embedding lookup",
    )
)


@candidate("embedding", name="torch")
def embedding_torch(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, table)


@candidate("embedding", name="index_select")
def embedding_index_select(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table.index_select(0, ids)
