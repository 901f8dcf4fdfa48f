"""The requests a capture of a model runs, as sizes: the same requests ``numalign capture``
makes (``golden.requests``: the prompts padded both ways, the long requests, the
far-position request), with its continuation and decode steps."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Request:
    """One capture request: ``rows`` x ``width`` tokens (padding included: it is computed);
    ``generates``: followed by the greedy continuation and the cached decode."""

    name: str
    rows: int
    width: int
    generates: bool


@dataclass(frozen=True)
class Workload:
    """The capture's requests and what follows the generating ones."""

    requests: tuple[Request, ...]
    continuation: int
    decode_steps: int

    def forward_tokens(self, r: Request) -> int:
        """Tokens the reference forwards run over for ``r``: the recorded prefill; then, where
        it generates, the greedy continuation (each step a forward over the whole prefix, no
        cache), the decode's prefill and its one-token steps."""
        tokens = r.rows * r.width
        if r.generates:
            steps = sum(r.width + i for i in range(self.continuation))
            tokens += r.rows * steps + r.rows * r.width + r.rows * self.decode_steps
        return tokens

    def recorded_tokens(self, r: Request) -> int:
        """Tokens whose outputs a set records at every capture point: the prefill's and the
        decode steps' new tokens."""
        return r.rows * (r.width + (self.decode_steps if r.generates else 0))

    def cache_length(self, r: Request) -> int:
        """Positions in ``r``'s KV cache at its largest (after the last decode step); 0 for a
        request that does not generate (its forwards run without a cache)."""
        return r.width + self.decode_steps if r.generates else 0

    @property
    def total_forward_tokens(self) -> int:
        return sum(self.forward_tokens(r) for r in self.requests)


def capture_workload(
    model_dir: Path,
    *,
    long: int | None,
    far: int,
    max_position: int | None,
    continuation: int,
    decode_steps: int,
    trust_remote_code: bool,
) -> Workload:
    """The requests ``numalign capture`` with these options would run on the model in
    ``model_dir`` (built by ``golden.requests`` itself: tokenized where the folder has a
    tokenizer, seeded ids of ``SEEDED_LENGTHS`` otherwise); the image request of image-text
    models is left out. ValueError naming the option on a negative size."""
    import transformers

    from numalign.golden.requests import (
        DEFAULT_PROMPTS,
        far_request,
        long_length,
        long_requests,
        text_requests,
    )

    for option, value in (("--long", long), ("--far", far), ("--continuation", continuation),
                          ("--decode-steps", decode_steps)):  # fmt: skip
        if value is not None and value < 0:
            raise ValueError(f"{option} {value}: give a length of 0 or more (0: none)")
    config = transformers.AutoConfig.from_pretrained(
        model_dir, local_files_only=True, trust_remote_code=trust_remote_code
    )
    made = text_requests(model_dir, config, DEFAULT_PROMPTS, trust_remote_code)
    length = long_length(config) if long is None else long
    if length:
        made += long_requests(model_dir, config, length, trust_remote_code)
    far_positions = far_request(model_dir, config, far, trust_remote_code, max_position)
    made += [far_positions] if far_positions is not None else []
    return Workload(tuple(_sized(r) for r in made), continuation, decode_steps)


def _sized(request: Any) -> Request:
    rows, width = request.inputs["input_ids"].shape
    return Request(request.name, int(rows), int(width), bool(request.generate))
