"""Model bugs planted into transformers itself for the length of one test (``plant``), for
bug classes that live outside any swappable module: how the model builds its masks, its
rotary angles, what it does to its logits after the LM head. The golden sets were captured
without them."""

from __future__ import annotations

import pytest
import torch
from transformers import activations, masking_utils
from transformers.models.deepseek_v3 import modeling_deepseek_v3
from transformers.models.gemma2 import modeling_gemma2
from transformers.models.llama import modeling_llama
from transformers.models.mixtral import modeling_mixtral
from transformers.models.qwen2_vl import modeling_qwen2_vl
from transformers.models.qwen3_next import modeling_qwen3_next


def _padding_attended(padding_mask: torch.Tensor):
    """Every key attended, padding included (the padding mask dropped)."""

    def inner(batch_idx, head_idx, q_idx, kv_idx):
        return torch.ones_like(padding_mask[batch_idx, kv_idx], dtype=torch.bool)

    return inner


def _window_one_wider(sliding_window: int):
    """A sliding window one token too wide."""

    def inner(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx > q_idx - sliding_window - 1

    return inner


def _rotary_in_bfloat16(self, x, position_ids):
    """Rotary angles (inverse frequencies times positions) computed in bfloat16."""
    inv = self.inv_freq[None, :, None].to(torch.bfloat16).expand(position_ids.shape[0], -1, 1)
    freqs = (inv @ position_ids[:, None, :].to(torch.bfloat16)).transpose(1, 2).float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (
        emb.sin() * self.attention_scaling
    ).to(x.dtype)


_llama_norm = modeling_llama.LlamaRMSNorm.forward


def _norm_low_precision_path(self, hidden_states):
    """An RMSNorm whose 16-bit kernel path errs by 2% (its float32 path is right): what a
    device's low-precision kernel does wrong, invisible to the module run in float32."""
    out = _llama_norm(self, hidden_states)
    return out * 1.02 if hidden_states.dtype != torch.float32 else out


_gemma2_forward = modeling_gemma2.Gemma2ForCausalLM.forward


def _no_softcap(self, *args, **kwargs):
    """Gemma 2's final logit soft-capping left out."""
    cap, self.config.final_logit_softcapping = self.config.final_logit_softcapping, None
    try:
        return _gemma2_forward(self, *args, **kwargs)
    finally:
        self.config.final_logit_softcapping = cap


_mrope_recompose = modeling_qwen2_vl.Qwen2VLRotaryEmbedding.recomposition_frequencies


def _mrope_sections_swapped(self, freq):
    """M-RoPE's sections taken in reverse order (sizes [3, 3, 2] for [2, 3, 3]): a text
    token, whose temporal, height and width positions agree, rotates as before; an image
    token rotates some frequencies by the wrong axis."""
    sections, self.mrope_section = self.mrope_section, list(reversed(self.mrope_section))
    try:
        return _mrope_recompose(self, freq)
    finally:
        self.mrope_section = sections


_gemma2_attention = modeling_gemma2.Gemma2Attention.forward


def _no_attention_softcap(self, *args, **kwargs):
    """Gemma 2's attention-logit soft-capping (50) left out: the zoo's logits are far below
    the cap, so the scores change by a few parts in ten thousand, all one way (larger)."""
    cap, self.attn_logit_softcapping = self.attn_logit_softcapping, None
    try:
        return _gemma2_attention(self, *args, **kwargs)
    finally:
        self.attn_logit_softcapping = cap


_chunk_rule = modeling_qwen3_next.torch_chunk_gated_delta_rule


def _state_decay_short(query, key, value, g, beta, chunk_size=64, initial_state=None,
                       output_final_state=False, **kwargs):  # fmt: skip
    """The gated delta rule's state carried from one chunk to the next misses the decay of
    the chunk's last token (an off-by-one in the chunk's cumulative decay): the first chunk's
    outputs are right, every later chunk reads a state too large, and so does decode."""
    outputs, state = [], initial_state
    for start in range(0, query.shape[1], chunk_size):
        part = slice(start, start + chunk_size)
        out, state = _chunk_rule(
            query[:, part], key[:, part], value[:, part], g[:, part], beta[:, part],
            chunk_size=chunk_size, initial_state=state, output_final_state=True, **kwargs,
        )  # fmt: skip
        last = g[:, min(start + chunk_size, query.shape[1]) - 1]  # [batch, value heads]
        state = state / last.exp()[..., None, None].to(state.dtype)
        outputs.append(out)
    return torch.cat(outputs, dim=1), state if output_final_state else None


def _router_softmax_low_precision(self, hidden_states):
    """Mixtral's router softmax computed in the hidden states' dtype (bfloat16 in a bfloat16
    run; the reference computes it in float32): each token's routing weights round once more,
    and near ties in the rounded probabilities may choose another expert."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)
    probs = torch.nn.functional.softmax(router_logits, dim=-1)
    top, indices = torch.topk(probs, self.top_k, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True)
    return router_logits, top.float(), indices


_llama_norm_init = modeling_llama.LlamaRMSNorm.__init__


def _norm_epsilon_1e5(self, hidden_size, eps=1e-6):
    """An RMSNorm built with 1e-5, a port's hard-coded default, where the config says 1e-6."""
    _llama_norm_init(self, hidden_size, eps=1e-5)


def _gelu_exact(self, input):
    """The exact (erf) GELU where the config asks for the tanh form (gelu_pytorch_tanh)."""
    return torch.nn.functional.gelu(input)


_deepseek_router = modeling_deepseek_v3.DeepseekV3TopkRouter.forward


def _routing_bias_in_combine(self, hidden_states):
    """DeepSeek-V3's router weighs the chosen experts by the bias-corrected scores (the
    correction bias only chooses experts; the combine weights are the plain scores)."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states.float(), self.weight.float())
    scores = router_logits.sigmoid() + self.e_score_correction_bias
    groups = scores.view(-1, self.num_group, self.num_experts // self.num_group)
    group_idx = torch.topk(groups.topk(2, dim=-1)[0].sum(dim=-1), k=self.topk_group, dim=-1,
                           sorted=False)[1]  # fmt: skip
    group_mask = torch.zeros(scores.shape[0], self.num_group, device=scores.device)
    group_mask.scatter_(1, group_idx, 1)
    keep = group_mask.repeat_interleave(self.num_experts // self.num_group, dim=-1).bool()
    indices = torch.topk(scores.masked_fill(~keep, float("-inf")), k=self.top_k, dim=-1,
                         sorted=False)[1]  # fmt: skip
    weights = scores.gather(1, indices)
    if self.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return router_logits, weights * self.routed_scaling_factor, indices


def _routed_scaling_ignored(self, hidden_states):
    """DeepSeek-V3's router without its ``routed_scaling_factor`` (2.5 in the zoo): every
    combine weight 1 / 2.5 of its own, the experts' share of the MoE output as small."""
    router_logits, weights, indices = _deepseek_router(self, hidden_states)
    return router_logits, weights / self.routed_scaling_factor, indices


def _layer_norm_unbiased(self, input):
    """A LayerNorm that divides by the unbiased variance (n - 1 degrees of freedom, torch's
    ``var`` default; the reference's is the population variance): every normalized value is
    sqrt((n - 1) / n) of its own, 0.78% small at the zoo's 64 channels, in every dtype."""
    x = input.float()
    normed = (x - x.mean(-1, keepdim=True)) / torch.sqrt(
        x.var(-1, keepdim=True, unbiased=True) + self.eps
    )
    if self.weight is not None:
        normed = normed * self.weight.float()
    if self.bias is not None:
        normed = normed + self.bias.float()
    return normed.to(input.dtype)


#: Each planted bug: the attribute of transformers it replaces, and with what.
PLANTS = {
    "padding_attended": (masking_utils, "padding_mask_function", _padding_attended),
    "window_one_wider": (masking_utils, "sliding_window_overlay", _window_one_wider),
    "rotary_bfloat16": (modeling_llama.LlamaRotaryEmbedding, "forward", _rotary_in_bfloat16),
    "norm_low_precision_path": (modeling_llama.LlamaRMSNorm, "forward", _norm_low_precision_path),
    "no_softcap": (modeling_gemma2.Gemma2ForCausalLM, "forward", _no_softcap),
    "mrope_sections_swapped": (modeling_qwen2_vl.Qwen2VLRotaryEmbedding,
                               "recomposition_frequencies", _mrope_sections_swapped),
    "no_attention_softcap": (modeling_gemma2.Gemma2Attention, "forward", _no_attention_softcap),
    "linear_attention_state_decay": (modeling_qwen3_next, "torch_chunk_gated_delta_rule",
                                     _state_decay_short),
    "router_softmax_low_precision": (modeling_mixtral.MixtralTopKRouter, "forward",
                                     _router_softmax_low_precision),
    "norm_epsilon_1e5": (modeling_llama.LlamaRMSNorm, "__init__", _norm_epsilon_1e5),
    "gelu_exact": (activations.GELUTanh, "forward", _gelu_exact),
    "routing_bias_in_combine": (modeling_deepseek_v3.DeepseekV3TopkRouter, "forward",
                                _routing_bias_in_combine),
    "layer_norm_unbiased": (torch.nn.LayerNorm, "forward", _layer_norm_unbiased),
    "routed_scaling_ignored": (modeling_deepseek_v3.DeepseekV3TopkRouter, "forward",
                               _routed_scaling_ignored),
}  # fmt: skip


def plant(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plants the bug ``name`` of ``PLANTS`` until ``monkeypatch`` undoes it (the test's end);
    a model loaded after this call is built and runs with it."""
    owner, attribute, replacement = PLANTS[name]
    monkeypatch.setattr(owner, attribute, replacement)
