"""The transformers engine: the reference's own modelling code, loaded with from_pretrained
in the target dtype with the session's variants (``replay.model.ModelCache``), replayed by
``replay.model`` (layer, full model) and ``replay.decode`` (KV caches and the paged path)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from numalign.replay.engines import Replayed
from numalign.replay.model import ModelCache, replay_layer, replay_model
from numalign.replay.serving import decode_replay, known_divergence
from numalign.runtime.variant import Variant

if TYPE_CHECKING:
    import torch

    from numalign.session.settings import Settings


class TransformersEngine:
    name = "transformers"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.cache = ModelCache()

    @staticmethod
    def caches(settings: Settings) -> tuple[str, ...]:
        """The KV caches asked for (--cache-implementation)."""
        return settings.cache_implementations

    def _context(
        self, golden: Any, device: torch.device, dtype: str, model: Any, cache: str | None = None
    ) -> dict[str, Any]:
        variant = Variant.from_settings(self.settings, device=device, dtype=dtype, cache=cache)
        return self.cache.record_context(golden, variant, device, model)

    def layer(
        self, path: str | Path, point: str, dtype: str, device: torch.device, policy: Any
    ) -> Replayed:
        golden, model = self.cache.load(path, self.settings, device, dtype)
        results = self.cache.run(
            replay_layer, golden, model, golden.point(point), dtype, device, policy
        )
        return Replayed(golden, results, self._context(golden, device, dtype, model))

    def model(
        self,
        path: str | Path,
        dtype: str,
        device: torch.device,
        policy: Any,
        serving: str | None = None,
    ) -> Replayed:
        # ``serving``: the settings refuse arrangements other than the default here
        golden, model = self.cache.load(path, self.settings, device, dtype)
        verdict = self.cache.run(replay_model, golden, model, dtype, device, policy)
        return Replayed(golden, verdict, self._context(golden, device, dtype, model))

    def decode(
        self,
        path: str | Path,
        dtype: str,
        cache: str,
        device: torch.device,
        policy: Any,
        serving: str | None = None,
    ) -> Replayed:
        golden, model, verdict = decode_replay(
            self.cache, path, self.settings, device, dtype, cache, policy
        )
        context = self._context(golden, device, dtype, model, cache)
        known = None
        if not verdict.passed:
            known = known_divergence(golden, model, verdict, dtype, device, cache)
        return Replayed(golden, verdict, context, known=known)

    def close(self) -> None:
        self.cache.close()
