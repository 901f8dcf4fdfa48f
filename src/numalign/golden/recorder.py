"""What a capture keeps of each call of a capture point: a ``Recorder`` turns the call's
inputs and outputs into a manifest ``Call`` whose tensors are in the shard writer, keyword
and positional inputs in their own shape (``key_tree``), anything else as JSON.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from numalign.compare.output_kind import TENSOR, kind_of
from numalign.core.dtypes import dtype_name
from numalign.golden.manifest import Call, KeyTree
from numalign.golden.nonfinite import NonFinite, count_nonfinite
from numalign.golden.positions import kept_positions
from numalign.golden.reference import flatten, jsonable
from numalign.golden.routing import point_tensors
from numalign.golden.shards import ShardWriter
from numalign.golden.statistics_info import KeptWhole


@dataclass
class Recorder:
    """Turns each call of a capture point into a ``Call`` whose tensors are in the writer."""

    writer: ShardWriter
    #: each point's calls, by point and request, in the order they were made
    calls: dict[str, dict[str, list[Call]]] = field(default_factory=dict)
    #: the first call whose outputs are not all finite (``nonfinite.NonFinite``)
    nonfinite: NonFinite | None = None
    #: the current request's attention mask ([batch, sequence]): padded positions may hold
    #: NaN (a query row with every key masked) and are never compared
    mask: Any = None
    #: the points that are masks the model builds (``golden.mask_points``): their outputs are
    #: stored as where each position may attend, whatever form the attention takes them in
    mask_points: frozenset[str] = frozenset()
    #: each point's output kinds by path (``compare.output_kind``), decided here as recorded
    kinds: dict[str, dict[str, str]] = field(default_factory=dict)
    #: which tensors are kept whole, the others as statistics only (``KeptWhole``)
    kept: KeptWhole = field(default_factory=KeptWhole)

    def on_call(
        self, request: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        import torch

        put = self.writer.put if self.kept.whole(name) else self._put_statistics
        calls = self.calls.setdefault(name, {}).setdefault(request, [])
        base = f"{request}/{name}/{len(calls)}"
        kw_keys: dict[str, KeyTree] = {}
        kw_json: dict[str, Any] = {}
        for k, v in kwargs.items():

            def put_kwarg(path: str, t: Any, k: str = k) -> str:
                return put(f"{base}/kwargs/{k}/{path}", t)

            keys = key_tree(v, put_kwarg)
            if keys is not None:
                kw_keys[k] = keys
            else:
                kw_json[k] = jsonable(v)
        arg_keys = tuple(_positional_keys(a, f"{base}/args/{i}", put) for i, a in enumerate(args))
        arg_json = tuple(
            None if k is not None else jsonable(a) for a, k in zip(args, arg_keys, strict=True)
        )
        if name in self.mask_points and isinstance(output, torch.Tensor):
            from numalign.compare.exact import attends

            output = attends(output)
        tensors = point_tensors(output)  # a router's as its logits and routing
        kinds = self.kinds.setdefault(name, {})
        for p, t in tensors:
            kinds.setdefault(
                p, kind_of(p, dtype_name(t.dtype), mask_point=name in self.mask_points)
            )
        outputs = {
            p: (put if kinds[p] == TENSOR else self.writer.put)(f"{base}/out/{p}", t)
            for p, t in tensors
        }
        # the point's main output (hidden states; not attention weights, whose padded query
        # rows are NaN where every key is masked), at the positions the mask keeps
        first = tensors[0] if tensors else None
        if self.nonfinite is None and first is not None:
            bad = count_nonfinite(first[1], self.mask)
            if bad:
                self.nonfinite = (request, name, first[0], bad, first[1].numel())
        calls.append(Call(arg_keys, arg_json, kw_keys, kw_json, outputs))

    def _put_statistics(self, key: str, tensor: Any) -> str:
        """``tensor`` kept as statistics of the positions the request's mask keeps, where the
        set keeps it so (``KeptWhole``); whole otherwise."""
        if self.kept.small(tensor):
            return self.writer.put(key, tensor)
        kept = kept_positions(tensor.detach(), self.mask)
        return self.writer.put_statistics(key, tensor, kept, self.kept.width)


def key_tree(value: Any, put: Callable[[str, Any], str]) -> KeyTree | None:
    """An input's tensors (keyword or positional) stored through ``put(path, tensor)``, in
    the input's own shape (``manifest.KeyTree``): a tensor's key, tuples and lists as lists,
    dicts (Zaya's masks by kind, DeepSeek-V4's rotary tables by layer type) as dicts, None
    kept; None where the value holds no tensor or anything else besides (a cache, an
    object), which the manifest keeps as JSON instead."""
    import torch

    leaves = list(flatten(value))
    if not any(isinstance(t, torch.Tensor) for _, t in leaves) or not all(
        t is None or isinstance(t, torch.Tensor) for _, t in leaves
    ):
        return None

    def tree(v: Any, path: str) -> KeyTree:
        if v is None:
            return None
        if isinstance(v, torch.Tensor):
            return put(path or "0", v)
        if isinstance(v, dict) or (hasattr(v, "to_tuple") and hasattr(v, "keys")):
            return {str(k): tree(v[k], f"{path}.{k}" if path else str(k)) for k in v}
        return [tree(x, f"{path}.{i}" if path else str(i)) for i, x in enumerate(v)]

    return tree(value, "")


def _positional_keys(value: Any, key: str, put: Callable[[str, Any], str]) -> KeyTree | None:
    """A positional input's tensors in its own shape (``key_tree``), as keyword inputs are,
    never as JSON, which would feed them back as None (Qwen4-Exp's attention takes its rotary
    tables as a positional tuple): a plain tensor under ``key``, as every set format holds
    it, the tensors of a tuple, list or dict under ``key/PATH``."""
    import torch

    if isinstance(value, torch.Tensor):
        return put(key, value)
    return key_tree(value, lambda path, t: put(f"{key}/{path}", t))
