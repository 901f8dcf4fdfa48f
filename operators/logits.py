"""The model head's last steps: final-logit soft-capping (Gemma 2 and 3), log_softmax and
cross-entropy over large and unaligned vocabularies (Qwen's 151936, Llama 2's 32000 + 1).

Soft-capping is inline in ``Gemma2ForCausalLM.forward`` (no module or function to swap);
cross-entropy is transformers' ``loss.loss_utils.fixed_cross_entropy`` (called by
``ForCausalLMLoss`` outside the modeling modules, so it is mapped, not swapped)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from numalign.ops.cases import Case, table_ids, values
from numalign.ops.registry import Operator, Output, candidate, register_operator
from operators._common import tier_cases, up
from operators._tiles import split_softmax

#: Gemma 2's final_logit_softcapping (Gemma 3 keeps the key; 30 is the value that ships).
FINAL_SOFTCAP = 30.0
#: transformers' ignore_index for labels that do not count (padding, prompt tokens).
IGNORE_INDEX = -100
#: Labels 1, 1 + IGNORE_STRIDE, ... are ignored: every case of two tokens or more has one.
IGNORE_STRIDE = 3

LOGIT_CASES = tier_cases(
    Case("one-1x1", {"rows": 1, "vocab": 1}),
    Case("rows-4x32000", {"rows": 4, "vocab": 32000}),
    # logits of a few hundred: tanh saturates at +-cap, exp overflows without the max
    Case("large-3x32001", {"rows": 3, "vocab": 32001}, regime="large"),
    Case("small-4x4096", {"rows": 4, "vocab": 4096}, regime="small"),
    Case("unaligned-5x32001", {"rows": 5, "vocab": 32001}),
    Case("vocab-2x151936", {"rows": 2, "vocab": 151936}, tier="pr"),
    Case("vocab-large-2x151936", {"rows": 2, "vocab": 151936}, regime="large", tier="pr"),
    Case("noncontig-7x1031", {"rows": 7, "vocab": 1031, "noncontiguous": True}, tier="pr"),
    Case("empty-0x32000", {"rows": 0, "vocab": 32000}, tier="pr"),
    Case("many-64x262144", {"rows": 64, "vocab": 262144}, tier="nightly"),
)


def _logits(case: Case, gen: torch.Generator) -> torch.Tensor:
    return values((case["rows"], case["vocab"]), case.regime, gen)


# -- final-logit soft-capping -----------------------------------------------------------------
def softcap_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    """logits [rows, vocab] and the cap (FINAL_SOFTCAP)."""
    return {"logits": _logits(case, gen), "cap": FINAL_SOFTCAP}


def logit_softcap_reference(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap), in float32 (float64 for float64); same shape and dtype."""
    lf = up(logits)
    return (cap * torch.tanh(lf / cap)).to(logits.dtype)


register_operator(
    Operator(
        name="logit_softcap",
        aten=("tanh",),
        hf_config_check=lambda config: bool(
            getattr(config, "final_logit_softcapping", None)
            or getattr(config, "attn_logit_softcapping", None)
        ),
        op_class="elementwise",
        reference=logit_softcap_reference,
        make_inputs=softcap_inputs,
        cases=LOGIT_CASES,
        description="final-logit soft-capping cap * tanh(x / cap) (Gemma 2 and 3)",
    )
)


@candidate("logit_softcap", name="torch")
def logit_softcap_torch(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """What Gemma2ForCausalLM.forward does: divide, tanh, multiply, in the logits' dtype."""
    return torch.tanh(logits / cap) * cap


@candidate("logit_softcap", name="reciprocal")
def logit_softcap_reciprocal(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """One float32 pass multiplying by a precomputed 1 / cap (fused epilogue style)."""
    return (torch.tanh(up(logits) * (1.0 / cap)) * cap).to(logits.dtype)


# -- log_softmax ------------------------------------------------------------------------------
def log_softmax_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    """logits [rows, vocab]."""
    return {"logits": _logits(case, gen)}


def log_softmax_reference(logits: torch.Tensor) -> torch.Tensor:
    """logits - max - log(sum(exp(logits - max))) over the vocabulary, reductions in float32;
    same shape and dtype as ``logits``."""
    lf = up(logits)
    if lf.shape[-1] == 0:
        return logits.clone()
    peak = lf.amax(-1, keepdim=True)
    shifted = lf - peak
    return (shifted - torch.log(torch.exp(shifted).sum(-1, keepdim=True))).to(logits.dtype)


register_operator(
    Operator(
        name="log_softmax",
        aten=("_log_softmax", "log_softmax"),
        op_class="softmax",
        reference=log_softmax_reference,
        make_inputs=log_softmax_inputs,
        cases=LOGIT_CASES,
        reduction_length=lambda case: case["vocab"],
        description="log_softmax over the vocabulary (sampling, scoring, the loss)",
    )
)


@candidate("log_softmax", name="torch")
def log_softmax_torch(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(up(logits), dim=-1).to(logits.dtype)


#: Vocabulary block of the online candidates: a tile a fused kernel keeps in registers.
VOCAB_BLOCK = 4096


def _online_logsumexp(lf: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim from VOCAB_BLOCK blocks: each block's sum of exponentials
    against its own max, the blocks merged by rescaling to the row max; [..., 1]."""
    _, total, peak = split_softmax(lf, VOCAB_BLOCK)
    return peak + torch.log(total)


@candidate("log_softmax", name="online")
def log_softmax_online(logits: torch.Tensor) -> torch.Tensor:
    """logits - logsumexp, the logsumexp from one blocked pass (online softmax)."""
    lf = up(logits)
    if lf.shape[-1] == 0:
        return logits.clone()
    return (lf - _online_logsumexp(lf)).to(logits.dtype)


# -- cross-entropy ----------------------------------------------------------------------------
CROSS_ENTROPY_CASES = tier_cases(
    *LOGIT_CASES,
    Case("all-ignored-3x100", {"rows": 3, "vocab": 100, "ignore_all": True}),
    # 50 labels, 33 counted: every shard boundary of 2, 4 and 8 vocabulary-parallel ranks,
    # even and padded (32001 splits unevenly), and the 16-bit limit of Qwen's vocabulary
    Case("shards-50x32001", {"rows": 50, "vocab": 32001}),
    Case("shards-30x151936", {"rows": 30, "vocab": 151936}),
)


def cross_entropy_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    """logits [tokens, vocab]; labels [tokens] int64 in [0, vocab), IGNORE_INDEX at 1, 1 +
    IGNORE_STRIDE, ... (everywhere for ``ignore_all``); the counted labels start with the
    vocabulary's shard boundaries (``table_ids``)."""
    rows, vocab = case["rows"], case["vocab"]
    labels = torch.full((rows,), IGNORE_INDEX, dtype=torch.int64)
    counted = torch.ones(rows, dtype=torch.bool)
    counted[1::IGNORE_STRIDE] = False
    labels[counted] = table_ids(vocab, int(counted.sum()), gen)
    if case.get("ignore_all"):
        labels[:] = IGNORE_INDEX
    return {"logits": _logits(case, gen), "labels": labels}


def cross_entropy_reference(
    logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (loss [tokens], mean []) in the logits' dtype: loss = logsumexp(logits) -
    logits[label] in float32, 0 where the label is IGNORE_INDEX; mean = the sum of the losses
    over the number of counted tokens (0 when none counts), as ``fixed_cross_entropy`` with
    ``num_items_in_batch`` does."""
    lf = up(logits)
    counted = labels != IGNORE_INDEX
    safe = torch.where(counted, labels, 0).to(logits.device)
    if lf.shape[-1]:
        peak = lf.amax(-1, keepdim=True)
        lse = (peak + torch.log(torch.exp(lf - peak).sum(-1, keepdim=True)))[..., 0]
        picked = lf.gather(-1, safe[:, None])[:, 0]
        loss = torch.where(counted.to(lf.device), lse - picked, 0.0)
    else:
        loss = torch.zeros(lf.shape[0], dtype=lf.dtype, device=lf.device)
    count = int(counted.sum())
    mean = loss.sum() / count if count else loss.sum() * 0.0
    return loss.to(logits.dtype), mean.to(logits.dtype)


register_operator(
    Operator(
        name="cross_entropy",
        aten=("nll_loss_forward", "nll_loss", "nll_loss_nd", "cross_entropy_loss"),
        op_class="softmax",
        reference=cross_entropy_reference,
        make_inputs=cross_entropy_inputs,
        cases=CROSS_ENTROPY_CASES,
        outputs=(Output("loss"), Output("mean")),
        reduction_length=lambda case: case["vocab"],
        description="token cross-entropy with ignore_index -100 and the mean over counted "
        "tokens (transformers' fixed_cross_entropy)",
    )
)


@candidate("cross_entropy", name="torch")
def cross_entropy_torch(
    logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """F.cross_entropy on the upcast logits, reduction "none", then sum / count."""
    lf = up(logits)
    labels = labels.to(logits.device)
    if lf.shape[0] == 0 or lf.shape[-1] == 0:
        loss = torch.zeros(lf.shape[0], dtype=lf.dtype, device=lf.device)
    else:
        loss = F.cross_entropy(lf, labels, ignore_index=IGNORE_INDEX, reduction="none")
    count = int((labels != IGNORE_INDEX).sum())
    mean = loss.sum() / max(count, 1)
    return loss.to(logits.dtype), mean.to(logits.dtype)


@candidate("cross_entropy", name="online")
def cross_entropy_online(
    logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused-loss style: one blocked logsumexp pass, minus the label's logit."""
    lf = up(logits)
    labels = labels.to(logits.device)
    counted = labels != IGNORE_INDEX
    if lf.shape[-1] == 0:
        loss = torch.zeros(lf.shape[0], dtype=lf.dtype, device=lf.device)
    else:
        picked = lf.gather(-1, torch.where(counted, labels, 0)[:, None])[:, 0]
        loss = torch.where(counted, _online_logsumexp(lf)[:, 0] - picked, 0.0)
    mean = loss.sum() / counted.sum().clamp_min(1)  # on the device: no host round trip
    return loss.to(logits.dtype), mean.to(logits.dtype)
