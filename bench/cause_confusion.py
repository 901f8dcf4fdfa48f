"""The confusion table of ``compare.cause``: each planted bug class of the project's own
catalogue (``tests/operators/planted_kernels.py``) run through ``ops.check.check_operator`` on
the case that exposes it, in float32, bfloat16 and float16, and the cause each failing output
gets (docs/comparison.md, "Causes").

    python3 bench/cause_confusion.py    # prints the Markdown table

Quantizers' codes are judged by their rounding (``compare.rounding``), which reads no cause:
their rows say "(rounding)".
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: planted kernel -> (operator, the case that exposes it), from the tests of the catalogue
#: (test_planted_bug_classes.py, test_case_grid_gaps.py, test_latent_sink_quantized_operators.py).
PLANTED: dict[tuple[str, str], str] = {
    ("wrong_eps", "rms_norm"): "small-16x4096",
    ("wrong_no_upcast", "rms_norm"): "llm-8x4096",
    ("wrong_no_max", "softmax"): "large-16x1000",
    ("wrong_nan_rows", "softmax"): "fully-masked-6x64",
    ("wrong_causal_off_by_one", "attention"): "gqa-causal-1x8x2x33x33x64",
    ("wrong_gqa_mapping", "attention"): "gqa-causal-1x8x2x33x33x64",
    ("wrong_interleaved", "rope_neox"): "small-1x4x17x64",
    ("wrong_low_precision_acc", "linear"): "large-k-2x32768x8",
    ("wrong_dropped_tail", "linear"): "unaligned-7x4097x33",
    ("wrong_no_renorm", "moe_routing"): "mixtral-17x8-top2",
    ("wrong_page_offset", "paged_attention"): "boundaries-6x4x8x64",
    ("wrong_chunk_carry", "cumsum"): "chunk-edges-3x129",
    ("wrong_no_decay_across_chunks", "gated_delta_rule"): "chunk-edges-2x2x129x32",
    ("wrong_one_pass_variance", "layer_norm"): "offset-8x4096",
    ("wrong_window_off_by_one", "attention"): "window-1x4x4x80x80x32",
    ("wrong_smallest", "topk"): "rows-8x1000-k8",
    ("wrong_no_threshold", "softplus"): "large-4x1000",
    ("wrong_softcap_after_mask", "attention"): "softcap-large-padded-2x4x2x40x40x64",
    ("wrong_ignores_offset", "rms_norm"): "gemma-offset-8x4096",
    ("wrong_ignores_offset", "add_rms_norm"): "gemma-offset-8x4096",
    ("wrong_bias_in_weights", "moe_routing"): "dsv3-bias5-9x64-top8-g8",
    ("wrong_fp16_accumulator", "matmul"): "range-1x8x4096x8",
    ("wrong_hard_cap", "logit_softcap"): "large-3x32001",
    ("wrong_no_max", "log_softmax"): "large-3x32001",
    ("wrong_mean_counts_ignored", "cross_entropy"): "rows-4x32000",
    ("wrong_topp_before_temperature", "sampling"): "typical-4x32000-t0.7-k50-p0.9",
    ("wrong_no_attention_factor", "rope_scaled"): "yarn-1x4x17x128-at100000",
    ("wrong_static_ntk", "rope_scaled"): "dynamic-1x4x17x128-at10000",
    ("wrong_mla_no_mscale", "mla"): "yarn-scale-1x4x9x40-r512",
    ("wrong_mla_kv_split", "mla"): "prefill-1x4x33x33-r256",
    ("wrong_sink_kv_head", "attention_sinks"): "gqa-1x8x1x33x33x64",
    ("wrong_sink_window_off_by_one", "attention_sinks"): "window-1x4x4x80x80x32",
    ("wrong_fp8_weight_scale_n", "fp8_block_gemm"): "blocks-4x512x256",
    ("wrong_int4_sign_extension", "int4_dequant"): "gptq-4x256x512-int32",
    ("wrong_int4_group_128", "int4_gemm"): "group32-2x64x256-uint8",
    ("wrong_kv_scale_gqa", "kv_quant_attention"): "int8-token-prefill-1x4x2x33x33x64",
}
DTYPES = ("float32", "bfloat16", "float16")


def causes(
    planted: Iterable[tuple[str, str]] = PLANTED,
) -> dict[tuple[str, str], list[tuple[str, str, str, float]]]:
    """(kernel, operator) -> (dtype, output, label, confidence) of each failing output."""
    import torch

    for path in (ROOT, ROOT / "tests" / "operators"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    import planted_kernels  # noqa: F401  (registers the planted kernels)

    from numalign.ops.check import check_operator
    from numalign.ops.registry import OPERATORS, candidates

    out: dict[tuple[str, str], list[tuple[str, str, str, float]]] = {}
    for kernel, operator in planted:
        op = OPERATORS[operator]
        case = next(c for c in op.cases if c.name == PLANTED[(kernel, operator)])
        candidate = candidates(operator)[kernel]
        found = out.setdefault((kernel, operator), [])
        for dtype in DTYPES:
            if candidate.skip_reason("cpu", dtype, case):
                continue
            for result in check_operator(op, candidate, case, getattr(torch, dtype),
                                         torch.device("cpu")):  # fmt: skip
                if result.passed:
                    continue
                label = result.cause.label if result.cause else f"({result.rule})"
                conf = result.cause.confidence if result.cause else 0.0
                found.append((dtype, result.name, label, conf))
    return out


def table(found: dict[tuple[str, str], list[tuple[str, str, str, float]]]) -> str:
    """The Markdown table: one row per planted kernel, the labels its failures got."""
    lines = [
        "| planted kernel | operator | case | failing outputs | label given (confidence) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for (kernel, operator), rows in found.items():
        counts = Counter(label for _, _, label, _ in rows)
        given = ", ".join(
            f"{label} x{n} ({_span([c for _, _, lab, c in rows if lab == label])})"
            for label, n in counts.most_common()
        )
        lines.append(
            f"| `{kernel}` | {operator} | {PLANTED[(kernel, operator)]} | {len(rows)} | "
            f"{given or 'none failed'} |"
        )
    return "\n".join(lines)


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}" if abs(hi - lo) < 0.005 else f"{lo:.2f}-{hi:.2f}"


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    found = causes()
    print(table(found))
    for (kernel, _), rows in found.items():
        for dtype, name, label, conf in rows:
            print(f"# {kernel} {name} {dtype}: {label} {conf:.2f}", file=sys.stderr)
