"""Model replay over a golden set: layer replay (each point alone, fed the golden inputs,
against the isolated calibration) and full-model replay (every point as the whole model runs,
against the accumulated calibration), logits and continuation checks, first divergence."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from numalign.compare import CompareResult, ControlErrors, compare
from numalign.golden.capture import append_token, load_model
from numalign.replay.layer import golden_outputs, kept_positions, replay_call, request_mask

if TYPE_CHECKING:
    import torch

    from numalign.golden.store import GoldenSet, Point
    from numalign.settings import Settings

#: Logits: the candidate's top-1 token must be among the golden top-5 ...
TOP_N = 5
#: ... and near-ties are allowed: a top-1 disagreement is accepted where the golden logits of
#: the two tokens differ by less than this many logit units (bfloat16 rounds logits of 10 to
#: 0.06; two roundings and a different accumulation order stay well below 0.5).
NEAR_TIE_LOGITS = 0.5


@dataclass
class PointResult:
    point: str
    order: int
    request: str
    path: str
    result: CompareResult
    #: when the point's call completed in the forward (children before their parents)
    finished: int = 0


def control_for(
    golden: GoldenSet, dtype: str, point: str, path: str, mode: str, hidden: int, depth: int
) -> tuple[ControlErrors, int]:
    """The control errors of a point's output in ``dtype`` (the set's calibration), and the
    reduction length behind it (the hidden size; times the depth for accumulated points).

    A dtype without calibration (float32, float64) borrows the closest calibrated one
    (float16, else bfloat16) scaled by the ratio of their unit roundoffs: the reference
    model amplifies rounding errors the same way in every dtype (linear error propagation),
    so its float32 error is its float16 error times 2**-13."""
    from numalign.compare.tolerances import FLOAT_FORMATS

    reduction = hidden * (depth if mode == "accumulated" else 1)
    stats, scale = _calibration(golden, dtype, point, path, mode), 1.0
    if stats is None:
        for source in ("float16", "bfloat16"):
            stats = _calibration(golden, source, point, path, mode)
            if stats is not None and dtype in FLOAT_FORMATS:
                scale = 2.0 ** (FLOAT_FORMATS[source][0] - FLOAT_FORMATS[dtype][0])
                break
    if stats is None:
        return ControlErrors(max_abs=0.0, rel_l2=0.0), reduction
    return (
        ControlErrors(
            max_abs=float(stats["max_abs"]) * scale,
            rel_l2=float(stats["rel_l2"] or 0.0) * scale,
            cosine=1.0 - (1.0 - float(stats.get("cosine") or 1.0)) * scale**2,
        ),
        reduction,
    )


def _calibration(golden: GoldenSet, dtype: str, point: str, path: str, mode: str) -> Any:
    stats = golden.calibration(dtype).get(point, {}).get(path, {}).get(mode)
    return stats if stats and stats.get("max_abs") is not None else None


def _hidden_and_depth(model: Any) -> tuple[int, int]:
    config = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or 1
    depth = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None) or 1
    return int(hidden), int(depth)


def _compare(
    actual: torch.Tensor,
    expected: torch.Tensor,
    name: str,
    control: ControlErrors,
    reduction: int,
    policy: Any,
) -> CompareResult:
    if not expected.is_floating_point():
        return compare(actual, expected, name=name)
    return compare(actual, expected, control_errors=control, reduction_length=reduction,
                   op_class="matmul", name=name, policy=policy)  # fmt: skip


class ReplayUnsupported(RuntimeError):
    """transformers cannot load this model with the asked-for implementation (Gemma 2 has
    no SDPA path, say): the replay is skipped with transformers' reason."""


@dataclass
class ModelCache:
    """Models loaded once per worker per (set, device, dtype, attention, swaps)."""

    models: dict[tuple[Any, ...], Any] = field(default_factory=dict)

    def get(
        self,
        golden: GoldenSet,
        device: torch.device,
        dtype: str,
        *,
        attn_implementation: str | None = None,
        swaps: Sequence[tuple[str, str]] = (),
        experts_implementation: str | None = None,
    ) -> Any:
        # by default, the attention implementation the set was captured with
        attn_implementation = attn_implementation or golden.manifest["reference"].get(
            "attn_implementation"
        )
        key = (
            str(golden.path),
            str(device),
            dtype,
            attn_implementation,
            experts_implementation,
            tuple(swaps),
        )
        if key not in self.models:
            from numalign.replay.swap import apply_swaps

            try:
                model = load_model(golden.model_dir, dtype, attn_implementation=attn_implementation,
                                   trust_remote_code=False,
                    experts_implementation=experts_implementation,
                ).to(device)  # fmt: skip
                apply_swaps(model, swaps)
            except ValueError as exc:
                if "implementation" not in str(exc):
                    raise
                raise ReplayUnsupported(str(exc).split(". ")[0]) from None
            self.models[key] = model
        return self.models[key]

    def load(
        self, path: str | Path, settings: Settings, device: torch.device, dtype: str
    ) -> tuple[GoldenSet, Any]:
        """The set, checked fresh (StaleGoldenSetError otherwise), and its model as the
        session's settings ask (swaps, attention and experts implementations)."""
        from numalign.replay.swap import parse_swaps

        golden = open_fresh(path)
        model = self.get(
            golden,
            device,
            dtype,
            attn_implementation=settings.attn_implementation,
            swaps=parse_swaps(settings.swaps),
            experts_implementation=settings.experts_implementation,
        )
        return golden, model


def replay_layer(
    golden: GoldenSet,
    model: Any,
    point: Point,
    dtype: str,
    device: torch.device,
    policy: Any = None,
) -> list[PointResult]:
    """Every recorded call of ``point`` replayed alone; each output against the golden one
    within the isolated calibration's budget."""
    import torch

    hidden, depth = _hidden_and_depth(model)
    module = model.get_submodule(point.name)
    results = []
    for request, calls in point.calls.items():
        mask = request_mask(golden, request)
        for call in calls:
            outputs = replay_call(module, golden, call, device=device, dtype=getattr(torch, dtype))
            for path, key in call.outputs.items():
                expected = kept_positions(golden.tensor(key), mask)
                control, reduction = control_for(
                    golden, dtype, point.name, path, "isolated", hidden, depth
                )
                name = point.name if path == "0" else f"{point.name}.{path}"
                actual = outputs.get(path)
                if actual is None:  # e.g. attention weights, which only eager returns
                    continue
                actual = kept_positions(actual.detach(), mask)
                result = _compare(actual, expected, name, control, reduction, policy)
                results.append(PointResult(point.name, point.order, request, path, result))
    return results


@dataclass
class ModelReplay:
    points: list[PointResult]
    logits: list[dict[str, Any]]
    continuation: list[dict[str, Any]]
    first_divergence: dict[str, Any] | None


def replay_model(
    golden: GoldenSet, model: Any, dtype: str, device: torch.device, policy: Any = None
) -> ModelReplay:
    """The whole model on every golden request, each point against the accumulated budget,
    then logits, the greedy continuation and the first divergence."""
    import torch

    torch_dtype = getattr(torch, dtype)
    hidden, depth = _hidden_and_depth(model)
    points = {p.name: p for p in golden.points}
    results: list[PointResult] = []
    logit_checks, continuation_checks = [], []
    for request in golden.requests:
        name = request["name"]
        inputs = {
            k: golden.tensor(v, device=device, dtype=torch_dtype)
            for k, v in request["inputs"].items()
        }

        def on_output(point: str, path: str, actual: Any, expected: Any, name: str = name) -> None:
            control, reduction = control_for(
                golden, dtype, point, path, "accumulated", hidden, depth
            )
            label = point if path == "0" else f"{point}.{path}"
            result = _compare(actual, expected, label, control, reduction, policy)
            results.append(
                PointResult(point, points[point].order, name, path, result, len(results))
            )

        with torch.no_grad(), golden_outputs(model, golden, name, on_output):
            out = model(**inputs, use_cache=False)
        golden_logits = golden.tensor(golden.manifest["logits"][name])
        mask = inputs.get("attention_mask")
        logit_checks.append(
            {
                "request": name,
                **logits_agreement(
                    out.logits.float().cpu(),
                    golden_logits,
                    mask.cpu() if mask is not None else None,
                ),
            }
        )
        continuation = golden.manifest.get("continuation", {}).get(name)
        if continuation:
            continuation_checks.append(
                {"request": name, **continuation_agreement(model, inputs, golden, continuation)}
            )
    return ModelReplay(results, logit_checks, continuation_checks, None)


def logits_agreement(
    actual: torch.Tensor, golden: torch.Tensor, mask: torch.Tensor | None
) -> dict[str, Any]:
    """Top-1 agreement, top-5 overlap, KL(golden || actual) and max abs error, over the
    positions the attention mask keeps."""
    import torch

    keep = mask.bool() if mask is not None else torch.ones(golden.shape[:-1], dtype=torch.bool)
    a, g = actual.double()[keep], golden.double()[keep]
    top1_a, top1_g = a.argmax(-1), g.argmax(-1)
    agree = top1_a == top1_g
    # a disagreement between near-tied golden logits is rounding, not an error
    gap = g.gather(-1, top1_g[:, None])[:, 0] - g.gather(-1, top1_a[:, None])[:, 0]
    near_tie = gap.abs() < NEAR_TIE_LOGITS
    top5_a, top5_g = a.topk(TOP_N, -1).indices, g.topk(TOP_N, -1).indices
    overlap = (top5_a[:, :, None] == top5_g[:, None, :]).any(-1).double().mean(-1)
    kl = torch.nn.functional.kl_div(
        a.log_softmax(-1), g.log_softmax(-1), log_target=True, reduction="none"
    ).sum(-1)
    return {
        "positions": int(keep.sum()),
        "top1_agreement": float(agree.double().mean()),
        "top1_unexplained": int((~agree & ~near_tie).sum()),
        "top5_overlap": float(overlap.mean()),
        "kl_max": float(kl.max()),
        "max_abs": float((a - g).abs().max()),
    }


def continuation_agreement(
    model: Any, inputs: dict[str, Any], golden: GoldenSet, continuation: dict[str, str]
) -> dict[str, Any]:
    """Greedy tokens of the replay against the golden continuation: identical up to the first
    divergence, and there each side's token must be among the other's top-N."""
    import torch

    tokens = golden.tensor(continuation["tokens"])
    golden_logits = golden.tensor(continuation["logits"]).double()
    steps = tokens.shape[1]
    state = dict(inputs)
    first, ok = None, True
    with torch.no_grad():
        for step in range(steps):
            logits = model(**state, use_cache=False).logits[:, -1].double().cpu()
            mine = logits.argmax(-1)
            if first is None and not torch.equal(mine, tokens[:, step]):
                first = step
                their_top = golden_logits[:, step].topk(TOP_N, -1).indices
                my_top = logits.topk(TOP_N, -1).indices
                ok = bool(
                    (mine[:, None] == their_top).any(-1).all()
                    and (tokens[:, step, None] == my_top).any(-1).all()
                )
            # teacher-force the golden token, so later steps compare like with like
            state = append_token(state, tokens[:, step : step + 1].to(state["input_ids"].device))
    return {"steps": steps, "first_divergence": first, "ok": ok}


def first_divergence(results: list[PointResult]) -> PointResult | None:
    """The first point, in the order calls completed in the forward (a block's norm before
    the block), whose error leaves its budget."""
    failing = [r for r in results if not r.result.passed]
    return min(failing, key=lambda r: r.finished) if failing else None


def group_by_point(results: list[PointResult]) -> Iterator[tuple[str, list[PointResult]]]:
    by: dict[str, list[PointResult]] = {}
    for r in results:
        by.setdefault(r.point, []).append(r)
    for name in sorted(by, key=lambda n: by[n][0].order):
        yield name, by[name]


def worst(results: list[PointResult]) -> PointResult:
    def used(r: PointResult) -> float:
        u = r.result.budget_used
        return math.inf if not r.result.passed and not math.isfinite(u) else u

    return max(results, key=used)


def variant_label(settings: Settings) -> str | None:
    """What a replay ran instead of the model's defaults, as records name it (``swap``)."""
    parts = [*settings.swaps]
    if settings.attn_implementation:
        parts.append(f"attention={settings.attn_implementation}")
    if settings.experts_implementation:
        parts.append(f"experts={settings.experts_implementation}")
    return ",".join(parts) or None


def suite_sets(root: Path, extra: Sequence[Path]) -> list[Path]:
    """The golden sets the model suites replay: ``root``/golden/sets and each --golden."""
    unique: dict[Path, Path] = {}
    for path in discover_sets([root / "golden" / "sets", *extra]):
        unique.setdefault(path.resolve(), path)
    return list(unique.values())


def open_fresh(path: str | Path) -> GoldenSet:
    """Opens a set and checks its model did not change (StaleGoldenSetError otherwise)."""
    from numalign.golden.store import GoldenSet

    golden = GoldenSet.open(path)
    golden.check_fresh()
    return golden


def discover_sets(folders: Sequence[Path]) -> list[Path]:
    """Golden set folders under each folder (a folder that is itself a set counts)."""
    found: list[Path] = []
    for folder in folders:
        if (folder / "manifest.json").is_file():
            found.append(folder)
        elif folder.is_dir():
            found += sorted(p for p in folder.iterdir() if (p / "manifest.json").is_file())
    return found
