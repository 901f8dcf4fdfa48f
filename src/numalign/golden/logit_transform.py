"""What a language model does to its logits after the LM head, as a capture point of its own.

Gemma 2 soft-caps its logits (``final_logit_softcapping``), Cohere scales them
(``logit_scale``), Granite divides them (``logits_scaling``): inline code in the model's
forward, after ``lm_head``, which no hook sees. ``attach_logit_transform`` gives it a module,
``LogitTransform`` under the model as ``logit_transform``, where the model has such a
transform: its one input is the LM head's output, its output the model's logits. It is
computed by the model's own forward, run with its base model and LM head stood in for (the
LM head's stand-in returns the given output), so whatever the forward does after its head is
what the point runs: a candidate that leaves the soft-capping out fails here, alone.

A model's forward does not call this module; the capture records one call of it per request
(the LM head's output in, the logits out), and layer replay and calibration replay it like
any point. In the whole model the logits themselves are judged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from numalign.golden.manifest import LOGIT_TRANSFORM


class LogitTransform(torch.nn.Module):
    """The model's forward after its LM head: ``forward(head_output)`` -> the logits."""

    def __init__(self, model: torch.nn.Module, base: str, head: str) -> None:
        super().__init__()
        # not submodules: the model is held as it is, to run its forward
        object.__setattr__(self, "model", model)
        self.base, self.head = base, head

    def forward(self, head_output: torch.Tensor) -> torch.Tensor:
        model: Any = self.__dict__["model"]
        batch, length = head_output.shape[:2]
        hidden = head_output.new_zeros(batch, length, 1)
        with (
            _stood_in(model, self.base, _BaseModel(hidden)),
            _stood_in(model, self.head, _Returns(head_output)),
        ):
            ids = torch.zeros(batch, length, dtype=torch.long, device=head_output.device)
            out = model(input_ids=ids, use_cache=False)
        logits: torch.Tensor = out.logits
        return logits

    def extra_repr(self) -> str:
        return f"{self.base} and {self.head} stood in for"

    def changes_logits(self) -> bool:
        """Whether the model's forward changes its head's output (a capture point where it
        does; the identity is no point of the model)."""
        probe = _probe(self.__dict__["model"])
        with torch.no_grad():
            return not torch.equal(self(probe), probe)


def attach_logit_transform(model: torch.nn.Module) -> str | None:
    """Gives a language model a ``LogitTransform`` as ``logit_transform``, where its forward
    runs with its base model and head stood in for; its name, or None where it does not (an
    image-text model that reads more of its base model's outputs, a model with no output
    embeddings). Whether the transform is a capture point is the capture's question
    (``changes_logits``): a replay attaches it whatever its candidate does to the logits."""
    if isinstance(getattr(model, LOGIT_TRANSFORM, None), LogitTransform):
        return LOGIT_TRANSFORM
    base = getattr(model, "base_model_prefix", "")
    outputs = getattr(model, "get_output_embeddings", None)
    head_module = outputs() if outputs is not None else None
    if head_module is None or not isinstance(getattr(model, base, None), torch.nn.Module):
        return None
    head = next((n for n, m in model.named_children() if m is head_module), None)
    if head is None:
        return None
    transform = LogitTransform(model, base, head)
    probe = _probe(model)
    try:
        with torch.no_grad():
            out = transform(probe)
    except Exception:  # the forward needs more of its base model than hidden states
        return None
    if not isinstance(out, torch.Tensor) or out.shape != probe.shape:
        return None
    model.add_module(LOGIT_TRANSFORM, transform)
    return LOGIT_TRANSFORM


def _probe(model: torch.nn.Module) -> torch.Tensor:
    """Head outputs from -60 to 60 (where a soft-capping at 30 or 50 bends them), in the
    model's dtype and on its device."""
    probe = torch.linspace(-60.0, 60.0, 24).reshape(1, 2, 12)
    param = next(model.parameters(), None)
    if param is not None and param.device.type != "meta":
        probe = probe.to(device=param.device, dtype=param.dtype)
    return probe


class _BaseModel(torch.nn.Module):
    """Stands in for a base model: returns the given hidden states, whatever it is fed."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import BaseModelOutputWithPast

        return BaseModelOutputWithPast(last_hidden_state=self.hidden)


class _Returns(torch.nn.Module):
    """Stands in for the LM head: returns the given output, whatever it is fed."""

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.output


@contextmanager
def _stood_in(model: torch.nn.Module, name: str, stand_in: torch.nn.Module) -> Iterator[None]:
    original = model._modules[name]
    model._modules[name] = stand_in
    try:
        yield
    finally:
        model._modules[name] = original
