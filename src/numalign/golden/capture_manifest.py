"""The manifest a capture writes, assembled in two parts: before the requests run, the model
and the reference (``started_manifest``); after, the points that were called, in forward
order (``recorded_points``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from numalign.golden.manifest import Call, Manifest, ModelInfo, Point, ReferenceInfo


def started_manifest(model: Any, model_dir: Path, out: Path, reference_dtype: str) -> Manifest:
    """The manifest of a capture before its requests run: the model (its fingerprint and
    files' sha256 filled in once the background hash is done; its path relative to the set
    at ``out``) and the reference (on the CPU in ``reference_dtype``, seed 0)."""
    import torch
    import transformers

    config = model.config
    return Manifest(
        model=ModelInfo(
            path=os.path.relpath(model_dir, out.resolve()),
            name=model_dir.name,
            architecture=type(model).__name__,
            model_type=getattr(config, "model_type", None),
            fingerprint="",
        ),
        reference=ReferenceInfo(
            device="cpu",
            dtype=reference_dtype,
            attn_implementation=getattr(config, "_attn_implementation", None),
            torch=torch.__version__,
            transformers=transformers.__version__,
            seed=0,
        ),
        requests=[],
        points=[],
        tensors={},
        shards={},
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )


def recorded_points(
    model: Any,
    names: Iterable[str],
    calls: dict[str, dict[str, list[Call]]],
    kinds: dict[str, dict[str, str]],
) -> list[Point]:
    """The points of ``names`` that were called (``calls``: by point, then request), in the
    order of the model's modules, each with its module's class name, its calls and its
    outputs' kinds (``kinds``: by point, then output path)."""
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return [
        Point(n, type(model.get_submodule(n)).__name__, order[n], calls[n], kinds.get(n, {}))
        for n in sorted(set(names), key=lambda n: order[n])
        if calls.get(n)
    ]
