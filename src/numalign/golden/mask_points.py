"""The masks a model builds, as capture points of their own.

A transformers model builds its attention masks (one per layer type: full, sliding, chunked;
an encoder's bidirectional one, a linear attention's padding rows) by calling functions of
``transformers.masking_utils`` (``create_causal_mask``, ``create_sliding_window_causal_mask``
...) from its forward. A function is not a module, so no hook sees it: a mask built wrong
would be judged only where an attention consumes it. ``attach_mask_points`` gives each such
function a module, a ``MaskFunction`` under the model that calls it
(``model.create_causal_mask``), and routes the model's calls of the function through it.
Hooks then record and replay it like any point: its inputs are the embeddings (for their
shape and dtype), the request's attention mask and positions; its output, stored as where
each position may attend (``attends``), is judged exactly.

Calls are routed by the config the model passes (``config=self.config``): each model's
functions go through its own modules, and a call with a config no attached model holds goes
to the function itself, as does a call inside a compiled graph (where the mask is part of
the graph, not judged). Nothing else changes: the function called is the one the model's
code holds, with the same arguments.
"""

from __future__ import annotations

import inspect
import re
import sys
import weakref
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Callable

#: The names of masking_utils' mask builders a modeling file imports (create_causal_mask,
#: create_sliding_window_causal_mask, create_chunked_causal_mask, create_bidirectional_mask,
#: create_recurrent_attention_mask, ...).
MASK_FUNCTION = re.compile(r"^create_\w*mask$")
#: The arguments that let a builder return None where attention needs no mask (a causal
#: SDPA with no padding): a point replayed alone passes False, so the rule is materialized.
_SKIPS = ("allow_is_causal_skip", "allow_is_bidirectional_skip")

#: (id of a config, function name) -> the MaskFunction a call with that config goes through.
_ROUTES: weakref.WeakValueDictionary[tuple[int, str], MaskFunction] = weakref.WeakValueDictionary()


class MaskFunction(torch.nn.Module):
    """A mask builder of ``masking_utils`` as a module: called with the model's config and
    the builder's other arguments. ``alone`` is how a replay of this point alone calls it:
    with the shortcut that returns no mask turned off, so the rule is always a tensor."""

    def __init__(self, function: Callable[..., Any], config: Any) -> None:
        super().__init__()
        self.function = function
        # not a submodule: the config is held as it is, for the call
        object.__setattr__(self, "config", config)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, config=self.config, **kwargs)

    def alone(self, *args: Any, **kwargs: Any) -> Any:
        """The mask built from a capture's arguments, which another transformers may name
        otherwise (5.24's ``cache`` is 5.19's ``past_key_values``; a prefill's is None): a
        None argument the function does not take, or that its parameter defaults to, is
        dropped, and a parameter it requires that the capture did not pass is None."""
        signature = _signature(self.function)
        if signature is not None:
            parameters = signature.parameters
            takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
            if not takes_any:
                kwargs = {k: v for k, v in kwargs.items() if k in parameters or v is not None}
            # a None the parameter defaults to anyway is left out: the same call, and a
            # deprecated alias (5.25's ``past_key_values`` beside ``cache``) warns when given
            kwargs = {
                k: v
                for k, v in kwargs.items()
                if v is not None or k not in parameters or parameters[k].default is not None
            }
            for name, parameter in list(parameters.items())[len(args) + 1 :]:  # after config
                if (
                    parameter.default is parameter.empty
                    and name not in kwargs
                    and (parameter.kind is parameter.POSITIONAL_OR_KEYWORD)
                ):
                    kwargs[name] = None
            for skip in _SKIPS:
                if skip in parameters and skip not in kwargs:
                    kwargs[skip] = False
        return self(*args, **kwargs)

    def extra_repr(self) -> str:
        return getattr(self.function, "__name__", "")


class _Route:
    """What a modeling file's global mask builder becomes: a call whose config an attached
    model holds goes through that model's MaskFunction; any other goes to ``function``."""

    def __init__(self, function: Callable[..., Any], name: str) -> None:
        self.function, self.name = function, name
        self.__name__ = name
        self.__wrapped__ = function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # inside a compiled model's graph: as it is
            return self.function(*args, **kwargs)
        module = _ROUTES.get((id(kwargs.get("config")), self.name))
        if module is None:
            return self.function(*args, **kwargs)
        kwargs.pop("config")
        return module(*args, **kwargs)


def attach_mask_points(model: torch.nn.Module) -> list[str]:
    """Gives every mask builder the model's code can call a ``MaskFunction`` under the
    model that calls it (the innermost pretrained model holding the config it passes:
    ``model`` in a causal LM, ``model.language_model`` in an image-text model), first among
    that model's children, and routes the calls there; the names of those modules. Calling
    it again attaches nothing new."""
    owners: dict[int, tuple[str, torch.nn.Module]] = {}
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(module, "base_model_prefix"):
            owners[id(config)] = (name, module)  # the innermost holder wins
    names = []
    for name, owner in owners.values():
        code = _namespace(type(owner))
        added = []
        for function_name, function in sorted(code.items()):
            if not MASK_FUNCTION.match(function_name) or not callable(function):
                continue
            if isinstance(function, _Route):
                function = function.function
            elif "config" not in _parameters(function):
                continue  # not a builder of the model's masks (flex attention's own)
            else:
                code[function_name] = _Route(function, function_name)
            module = owner._modules.get(function_name)
            if not isinstance(module, MaskFunction):
                module = MaskFunction(function, owner.config)
                owner.add_module(function_name, module)
                added.append(function_name)
            _ROUTES[(id(owner.config), function_name)] = module
            names.append(f"{name}.{function_name}" if name else function_name)
        if added:  # first among the owner's children, before its blocks: forward order
            children = dict(owner._modules)
            owner._modules.clear()
            owner._modules.update({n: children.pop(n) for n in added} | children)
    return names


def _namespace(cls: type) -> dict[str, Any]:
    """The globals ``cls``'s forward reads its mask builders from: its own function's (through
    any decorator), not ``sys.modules``' entry for its module name, which is another module
    object once the file was imported again (pytester's runs drop what they imported)."""
    forward = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    found = getattr(forward, "__globals__", None)
    if isinstance(found, dict) and found.get("__name__") == cls.__module__:
        return found
    module = sys.modules.get(cls.__module__)
    return vars(module) if module is not None else {}


def _signature(function: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(function)
    except (TypeError, ValueError):
        return None


def _parameters(function: Callable[..., Any]) -> set[str]:
    signature = _signature(function)
    return set(signature.parameters) if signature is not None else set()
