"""A plan's figures (``Plan.data``) as text: a Markdown table per part and the summaries
under it. Sizes in decimal units (GB = 1e9 bytes), parameters in B (1e9) and M (1e6)."""

from __future__ import annotations

from typing import Any


def size(n: float) -> str:
    """Bytes in decimal units: ``3.71 GB``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def count(n: float) -> str:
    """Parameters: ``671.03 B``, ``14.7 M``."""
    if abs(n) >= 1e9:
        return f"{n / 1e9:.2f} B"
    if abs(n) >= 1e6:
        return f"{n / 1e6:.1f} M"
    return f"{n:,.0f}"


def seconds(s: float | None) -> str:
    if s is None:
        return "not measured"
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    return f"{s / 60:.1f} min" if s >= 60 else f"{s:.1f} s"


def render(d: dict[str, Any]) -> str:
    """The plan as text: the header, the parts' table, requests, golden set, peaks,
    ranks and time."""
    lines = _header(d) + _table(d) + _requests(d) + _golden(d) + _peaks(d) + _ranks(d)
    return "\n".join(lines + _time(d)) + "\n"


def _header(d: dict[str, Any]) -> list[str]:
    moe = (
        f"; routed experts {count(d['expert_params'])}, {d['experts_used']} of each MoE "
        "layer's used by the requests"
        if d["expert_params"]
        else ""
    )
    return [
        f"# numalign plan: {d['model']} ({d['architecture']}, {d['model_type']})",
        "",
        f"Read from {d['model_dir']}/config.json, "
        + ("built on the meta device" if d["built"] == "meta device" else d["built"])
        + f" in {d['build_s']:.1f} s: {count(d['params'])} parameters, {count(d['active_params'])} "
        f"active per token{moe}.",
        "",
    ]


def _table(d: dict[str, Any]) -> list[str]:
    ref, names = d["reference_dtype"], [d["reference_dtype"], *d["dtypes"]]
    names = list(dict.fromkeys(names))
    head = ["part", "params", *(f"weights {n}" for n in names), f"streamed {ref}",
            f"activations {ref}", f"KV cache {ref}", "golden set"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in d["parts"]:
        each = " each" if row["count"] > 1 else ""
        cells = [row["name"], count(row["params"]) + each,
                 *(size(row["weight_bytes"][n]) for n in names),
                 size(row["streamed_weight_bytes"][ref]), size(row["activation_bytes"][ref]),
                 size(row["kv_cache_bytes"][ref]), size(row["golden_bytes"])]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    t = d["totals"]
    total = ["total", count(d["params"]), *(size(t["weight_bytes"][n]) for n in names),
             "", "", size(t["kv_cache_bytes"][ref]), size(d["golden"]["bytes"])]  # fmt: skip
    lines.append("| " + " | ".join(f"**{c}**" if c else "" for c in total) + " |")
    return [*lines, ""]


def _requests(d: dict[str, Any]) -> list[str]:
    shown = ", ".join(
        f"{r['name']} {r['rows']}x{r['width']}" + (" (generates)" if r["generates"] else "")
        for r in d["requests"]
    )
    lines = [
        f"Requests (numalign capture's): {shown}; continuation {d['continuation']} tokens, "
        f"decode {d['decode_steps']} steps: {d['forward_tokens']:,} tokens forwarded."
    ]
    if d["capture_refuses"]:
        lines.append(
            f"numalign capture refuses these long requests ({d['capture_refuses']}); the "
            "figures below are their arithmetic, for a model that takes them."
        )
    return [*lines, ""]


def _golden(d: dict[str, Any]) -> list[str]:
    g = d["golden"]
    parts = ", ".join(f"{k} {size(v)}" for k, v in g["by"].items())
    kept = ""
    if "whole_bytes" in g:
        kept = (f" With --full-points {' '.join(g['full_points'])} (sketches of "
                f"{g['sketch_width']} buckets elsewhere); whole it would take about "
                f"{size(g['whole_bytes'])}.")  # fmt: skip
    return [
        f"Golden set: about {size(g['bytes'])} ({parts}).{kept} Counted: {g['counted']}. "
        f"Not counted: {g['not_counted']}.",
        "",
    ]


def _peaks(d: dict[str, Any]) -> list[str]:
    names = list(d["peaks"])
    lines = ["| peak memory | " + " | ".join(names) + " |", "|" + " --- |" * (len(names) + 1)]
    lines.append(
        "| unstreamed (every weight + the worst request) | "
        + " | ".join(size(d["peaks"][n]["unstreamed"]) for n in names)
        + " |"
    )
    lines.append("| streamed (the largest part alone) | " + " | ".join(
        f"{size(d['peaks'][n]['streamed'])} ({d['peaks'][n]['streamed_part']})" for n in names
    ) + " |")  # fmt: skip
    return [*lines, ""]


def _ranks(d: dict[str, Any]) -> list[str]:
    gib = d["device_memory"] / 2**30
    lines = [
        f"Pipeline ranks of {gib:g} GiB ({size(d['device_memory'])}) each (--device-memory; "
        "10% left to the runtime, the worst request's activations besides), the layers split "
        "as --pp splits them:"
    ]
    for name, p in d["pipeline"].items():
        if not p["fits"]:
            lines.append(
                f"- {name}: no --pp split fits: a rank of one layer (the first with the "
                f"embedding, the last with the head) exceeds a rank's {size(p['usable_bytes'])}; "
                "only tensor parallel splits it"
            )
            continue
        lines.append(
            f"- {name}: --pp {p['ranks']} (the largest rank holds "
            f"{size(max(p['stage_bytes']))} of {size(p['usable_bytes'])}): {ranges(p['ranges'])}"
        )
    tp = ", ".join(
        f"{n} --tp {k}" if k else f"{n}: none is enough" for n, k in d["tensor_parallel"].items()
    )
    lines.append(
        f"- or tensor parallel, every layer split over the ranks (a divisor of the attention "
        f"heads): {tp}"
    )
    return [*lines, ""]


def ranges(spans: list[list[str]]) -> str:
    """Each rank's first and last part, consecutive ranks of one layer each run together:
    ``0: embedding .. layer 3; 1-56: layer 4 .. layer 59, one layer each; 57: ...``."""
    out: list[str] = []
    i = 0
    while i < len(spans):
        j = i
        while j + 1 < len(spans) and _single(spans[j + 1]) and _single(spans[i]):
            j += 1
        if j > i:
            out.append(f"{i}-{j}: {spans[i][0]} .. {spans[j][1]}, one layer each")
        else:
            a, z = spans[i]
            out.append(f"{i}: {a}" + (f" .. {z}" if z != a else ""))
        i = j + 1
    return "; ".join(out)


def _single(span: list[str]) -> bool:
    return span[0] == span[1] and span[0].startswith("layer ")


def _time(d: dict[str, Any]) -> list[str]:
    t, m = d["time"], d["throughput"]
    if m is None:
        measured = "not measured (--no-measure)"
    else:
        measured = (f"{m['matmul_flops_s'] / 1e9:.1f} GFLOP/s float32 matmul, "
                    f"{m['read_bytes_s'] / 1e9:.2f} GB/s reading {m['read_note']}")  # fmt: skip
    return [
        f"Time of one reference pass on this machine ({measured}): "
        f"2 x {count(d['active_params'])} active params x {d['forward_tokens']:,} tokens = "
        f"{t['flops']:.3g} FLOP -> {seconds(t['compute_s'])}; reading "
        f"{size(t['read_bytes'])} of {t['checkpoint_dtype']} checkpoint -> "
        f"{seconds(t['read_s'])}; about {seconds(t['total_s'])} in all. Calibration reruns "
        "the requests once per ensemble member and dtype (--calibrate '' for none).",
    ]
