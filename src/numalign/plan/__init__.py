"""``numalign plan``: what a capture and a replay of a model will take (weights, activations,
KV cache, the golden set, peaks unstreamed and streamed, pipeline ranks, time), from its
config alone, before anything runs (docs/plan.md)."""

from numalign.plan.report import Plan, plan

__all__ = ["Plan", "plan"]
