"""The operators of hybrid (linear plus full attention) models: causal linear attention, the
gated delta rule of Qwen3-Next and Gated DeltaNet, and the causal depthwise conv1d before it.

References are recurrent (one token at a time: obviously right, O(T)); candidates are chunked
(intra-chunk matrices, a state carried between chunks), as the fast kernels are."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from numalign.compare import Budget
from numalign.ops.cases import Case, values
from numalign.ops.registry import Operator, candidate, register_operator
from operators._common import tier_cases, up
from operators._tiles import tiles, untile

RECURRENT_CASES = tier_cases(
    Case("one-1x1x1x4", {"batch": 1, "heads": 1, "tokens": 1, "dim": 4}),
    Case("small-1x2x37x16", {"batch": 1, "heads": 2, "tokens": 37, "dim": 16}),
    Case("chunk-edges-2x2x129x32", {"batch": 2, "heads": 2, "tokens": 129, "dim": 32}),
    Case("llm-1x4x256x128", {"batch": 1, "heads": 4, "tokens": 256, "dim": 128}, tier="pr"),
    Case(
        "outliers-1x2x200x64",
        {"batch": 1, "heads": 2, "tokens": 200, "dim": 64},
        regime="outliers",
        tier="pr",
    ),
    Case("long-1x1x2048x64", {"batch": 1, "heads": 1, "tokens": 2048, "dim": 64}, tier="pr"),
    Case("long-1x1x32768x64", {"batch": 1, "heads": 1, "tokens": 32768, "dim": 64}, tier="nightly"),
)
#: Chunk length of the chunked candidates (the chunk size of FLA's kernels).
CHUNK = 64


def linear_attention_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    shape = (case["batch"], case["heads"], case["tokens"], case["dim"])
    return {
        "q": values(shape, case.regime, gen),
        # keys scaled by 1/sqrt(T): the state sums T outer products
        "k": values(shape, "ordinary", gen) / math.sqrt(max(1, case["tokens"])),
        "v": values(shape, "ordinary", gen),
    }


def linear_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """o_t = sum_{s<=t} (q_t . k_s) v_s, via the state S_t = S_{t-1} + k_t v_t^T."""
    qf, kf, vf = up(q), up(k), up(v)
    state = torch.zeros(*q.shape[:2], q.shape[-1], v.shape[-1], dtype=qf.dtype, device=q.device)
    out = torch.empty(*v.shape, dtype=qf.dtype, device=q.device)
    for t in range(q.shape[2]):
        state = state + kf[:, :, t, :, None] * vf[:, :, t, None, :]
        out[:, :, t] = torch.einsum("bhk,bhkv->bhv", qf[:, :, t], state)
    return out.to(q.dtype)


register_operator(
    Operator(
        name="linear_attention",
        op_class="scan",
        reference=linear_attention_reference,
        make_inputs=linear_attention_inputs,
        cases=RECURRENT_CASES,
        reduction_length=lambda case: case["tokens"],
        description="causal linear attention (no decay, no normalization)",
    )
)


def _chunks(x: torch.Tensor) -> torch.Tensor:
    """[b, h, t, d] -> [b, h, chunks, CHUNK, d], the last chunk padded with zeros."""
    return tiles(x, CHUNK, dim=2)


@candidate("linear_attention", name="chunked")
def linear_attention_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Within a chunk: causal (Q K^T) V; across chunks: Q S with S the sum of earlier K^T V
    (every chunk's K^T V at once, then an exclusive prefix sum over chunks)."""
    qc, kc, vc = (_chunks(up(x)) for x in (q, k, v))
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    intra = (qc @ kc.transpose(-1, -2)).masked_fill(~causal, 0.0) @ vc
    states = (kc.transpose(-1, -2) @ vc).cumsum(2)  # the state after each chunk
    entering = torch.cat([torch.zeros_like(states[:, :, :1]), states[:, :, :-1]], 2)
    return untile(intra + qc @ entering, q.shape[2], dim=2).to(q.dtype)


def delta_rule_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    b, h, t, d = case["batch"], case["heads"], case["tokens"], case["dim"]
    shape = (b, h, t, d)
    # Qwen3-Next l2-normalizes q and k inside the kernel; beta = sigmoid(.), and the log
    # decay g = -exp(A) * softplus(a + dt_bias) is negative.
    q = F.normalize(values(shape, case.regime, gen), dim=-1)
    k = F.normalize(values(shape, "ordinary", gen), dim=-1)
    return {
        "q": q,
        "k": k,
        "v": values(shape, "ordinary", gen),
        "g": -F.softplus(values((b, h, t), "ordinary", gen)) * 0.5,
        "beta": torch.sigmoid(values((b, h, t), "ordinary", gen)),
    }


def gated_delta_rule_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """S_t = a_t S_{t-1} + k_t u_t^T with u_t = b_t (v_t - a_t S_{t-1}^T k_t), a_t = exp(g_t);
    o_t = S_t^T q_t / sqrt(d_k)."""
    qf, kf, vf, gf, bf = up(q), up(k), up(v), up(g), up(beta)
    scale = q.shape[-1] ** -0.5
    state = torch.zeros(*q.shape[:2], q.shape[-1], v.shape[-1], dtype=qf.dtype, device=q.device)
    out = torch.empty(*v.shape, dtype=qf.dtype, device=q.device)
    for t in range(q.shape[2]):
        state = state * torch.exp(gf[:, :, t])[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", state, kf[:, :, t])
        update = bf[:, :, t, None] * (vf[:, :, t] - predicted)
        state = state + kf[:, :, t, :, None] * update[..., None, :]
        out[:, :, t] = torch.einsum("bhkv,bhk->bhv", state, qf[:, :, t]) * scale
    return out.to(q.dtype)


register_operator(
    Operator(
        name="gated_delta_rule",
        aten=("linalg_solve_triangular",),
        op_class="scan",
        reference=gated_delta_rule_reference,
        make_inputs=delta_rule_inputs,
        cases=RECURRENT_CASES,
        reduction_length=lambda case: case["tokens"],
        hf_modules=("*GatedDeltaNet",),
        description="gated delta rule (Qwen3-Next linear attention)",
        # Chunked forms solve a triangular system per chunk instead of 64 rank-1 updates; in
        # float32 their worst element measured 4.6x the recurrent control's (the solve's
        # rounding), their overall error 2.9x. 8x keeps a margin; a wrong decay is 1e4x.
        budget=Budget(max_abs_multiplier=8.0, rel_l2_multiplier=4.0),
    )
)


@candidate("gated_delta_rule", name="chunked")
def gated_delta_rule_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """Chunks of 64 in the WY form of the fast kernels. With G_i the cumulative log decay
    inside a chunk and S0 the entering state, the chunk's updates U solve the unit
    lower-triangular system (I + L) U = beta (V - exp(G) K S0), L_ij = beta_i exp(G_i - G_j)
    k_i.k_j (j < i); U = W - Y S0 splits into parts free of S0, solved for every chunk at
    once. O = exp(G) Q S0 + (Q K^T o exp(G_i - G_j))_{j<=i} U; the state leaving is
    exp(G_last) S0 + (K exp(G_last - G))^T U, so only that affine map of the state runs
    chunk after chunk."""
    qc, kc, vc = (_chunks(up(x)) for x in (q, k, v))
    # zero padding: no decay, no update (beta 0) past the last token
    gc, bc = tiles(up(g), CHUNK).cumsum(-1), tiles(up(beta), CHUNK)  # [b, h, chunks, CHUNK]
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = torch.exp((gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, -math.inf))
    strict = (kc @ kc.transpose(-1, -2)) * decay * bc[..., None]
    system = torch.eye(CHUNK, dtype=qc.dtype, device=q.device) + strict.tril(-1)
    w = torch.linalg.solve_triangular(system, bc[..., None] * vc, upper=False, unitriangular=True)
    y = torch.linalg.solve_triangular(
        system, (bc * torch.exp(gc))[..., None] * kc, upper=False, unitriangular=True
    )
    last = gc[..., -1:]
    kd = (kc * torch.exp(last - gc)[..., None]).transpose(-1, -2)  # [b, h, chunks, dk, CHUNK]
    eye = torch.eye(k.shape[-1], dtype=qc.dtype, device=q.device)
    transition = torch.exp(last)[..., None] * eye - kd @ y  # S1 = transition S0 + inject
    inject = kd @ w
    entering = torch.empty_like(inject)
    state = torch.zeros_like(inject[:, :, 0])
    for c in range(inject.shape[2]):
        entering[:, :, c] = state
        state = transition[:, :, c] @ state + inject[:, :, c]
    scores = (qc @ kc.transpose(-1, -2)) * decay
    out = scores @ w + (torch.exp(gc)[..., None] * qc - scores @ y) @ entering
    return untile(out * q.shape[-1] ** -0.5, q.shape[2], dim=2).to(q.dtype)


CONV_CASES = tier_cases(
    Case("one-1x1x1-w4", {"batch": 1, "channels": 1, "tokens": 1, "width": 4}),
    Case("short-2x8x3-w4", {"batch": 2, "channels": 8, "tokens": 3, "width": 4}),
    Case("qwen3next-1x64x100-w4", {"batch": 1, "channels": 64, "tokens": 100, "width": 4}),
    Case(
        "large-1x16x50-w4", {"batch": 1, "channels": 16, "tokens": 50, "width": 4}, regime="large"
    ),
    Case("llm-2x4096x512-w4", {"batch": 2, "channels": 4096, "tokens": 512, "width": 4}, tier="pr"),
    Case(
        "noncontig-1x33x77-w3",
        {"batch": 1, "channels": 33, "tokens": 77, "width": 3, "noncontiguous": True},
        tier="pr",
    ),
    Case(
        "long-1x256x32768-w4",
        {"batch": 1, "channels": 256, "tokens": 32768, "width": 4},
        tier="nightly",
    ),
)


def conv_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    c, w = case["channels"], case["width"]
    return {
        "x": values((case["batch"], c, case["tokens"]), case.regime, gen),
        "weight": values((c, w), "ordinary", gen) / math.sqrt(w),
        "bias": 0.1 * values((c,), "ordinary", gen),
    }


def causal_conv1d_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """silu(sum_i w[c, i] x[c, t - (W-1) + i] + b[c]), zeros before the first token."""
    xf, wf = up(x), up(weight)
    width, t = weight.shape[1], x.shape[-1]
    out = up(bias)[None, :, None].expand(x.shape[0], -1, t).clone()
    for i in range(width):
        shift = width - 1 - i
        out[..., shift:] += wf[None, :, i, None] * xf[..., : t - shift] if shift < t else 0.0
    return F.silu(out).to(x.dtype)


register_operator(
    Operator(
        name="causal_conv1d",
        aten=("convolution",),
        op_class="elementwise",
        reference=causal_conv1d_reference,
        make_inputs=conv_inputs,
        cases=CONV_CASES,
        description="causal depthwise conv1d + SiLU (before the gated delta rule)",
        # the mixers' convolutions (Qwen3-Next, Mamba, Falcon-H1, LFM2): a Conv1d of one
        # group per channel padded by its width - 1 (causal); other Conv1d are not this
        hf_modules=("Conv1d",),
        hf_module_check=lambda m: (
            m.groups == m.in_channels == m.out_channels and m.padding[0] == m.kernel_size[0] - 1
        ),
    )
)


@candidate("causal_conv1d", name="torch")
def causal_conv1d_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """F.conv1d with groups = channels and W-1 of left padding."""
    out = F.conv1d(
        up(x), up(weight)[:, None, :], up(bias), padding=weight.shape[1] - 1, groups=x.shape[1]
    )
    return F.silu(out[..., : x.shape[-1]]).to(x.dtype)


@candidate("causal_conv1d", name="unfold")
def causal_conv1d_unfold(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Sliding windows by unfold, then one multiply-sum per channel."""
    width = weight.shape[1]
    windows = F.pad(up(x), (width - 1, 0)).unfold(-1, width, 1)  # [b, c, t, width]
    return F.silu((windows * up(weight)[None, :, None, :]).sum(-1) + up(bias)[None, :, None]).to(
        x.dtype
    )
