"""Inventory: what a model needs from the catalogue, read without its weights.

The model is built on the meta device from its config (no weight is read), its module types
are listed, and one forward on meta tensors is traced with a dispatch mode to list the aten
operators it runs; data-dependent operators (``.item()``, ``nonzero``) get stand-in values so
the trace goes on (a data-dependent branch may then take the other way: the list of operators
is what is sought, not the values). Both map to catalogue operators; the table says, per
operator, where the model uses it and whether candidates cover it. What maps to nothing is
missing: the list a bring-up starts from.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: aten operators that are data movement or elementwise glue: not listed as missing.
GLUE = {
    "view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "clone", "copy_",
    "contiguous", "slice", "select", "unsqueeze", "squeeze", "cat", "stack", "split", "chunk",
    "add", "sub", "mul", "div", "neg", "pow", "mean", "sum", "to", "_to_copy", "detach",
    "arange", "zeros", "ones", "full", "empty", "new_zeros", "new_ones", "new_empty", "lift_fresh",
    "masked_fill", "where", "eq", "ne", "lt", "le", "gt", "ge", "bitwise_and", "bitwise_or",
    "logical_not", "index", "index_select", "gather", "scatter", "fill_", "zero_", "alias",
    "unbind", "repeat", "repeat_interleave", "triu", "tril", "max", "min", "amax", "abs", "exp",
    "log", "sqrt", "reciprocal", "bernoulli_", "div_", "clamp", "any", "all", "item",
    "_local_scalar_dense", "flatten", "constant_pad_nd", "scatter_", "index_put_", "copy",
    "expand_as", "type_as", "float", "narrow", "_reshape_alias", "empty_like", "zeros_like",
    "ones_like", "full_like", "bitwise_not", "scalar_tensor", "split_with_sizes", "argmax",
    "floor_divide", "remainder", "sign", "diff", "_assert_async", "is_nonzero", "maximum",
    "minimum", "rsub", "one_hot", "nonzero", "view_as", "sym_size", "sym_numel", "unfold",
}  # fmt: skip


#: Operators that stand for a whole module, children included (the Conv3d inside a patch
#: embedding); other mapped modules leave their children to be mapped on their own.
ABSORBS_CHILDREN = ("patch_embed",)


@dataclass
class Inventory:
    model: str
    architecture: str
    module_types: dict[str, list[str]] = field(default_factory=dict)
    aten_ops: dict[str, int] = field(default_factory=dict)
    trace_error: str | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(
            {"model": self.model, "architecture": self.architecture, "operators": self.rows,
             "module_types": self.module_types, "aten_ops": self.aten_ops,
             "trace_error": self.trace_error}, indent=2)  # fmt: skip

    def to_markdown(self) -> str:
        lines = [
            f"# {self.model} ({self.architecture})", "",
            "| operator | where used | status |", "| --- | --- | --- |",
        ]  # fmt: skip
        for row in self.rows:
            where = ", ".join(row["where"][:4]) + (
                f" (+{len(row['where']) - 4})" if len(row["where"]) > 4 else ""
            )
            lines.append(f"| {row['operator']} | {where} | {row['status']} |")
        if self.trace_error:
            lines += [
                "",
                f"The aten trace stopped early ({self.trace_error}); module types are complete.",
            ]
        return "\n".join(lines) + "\n"


def inventory(model_dir: str | Path, *, trust_remote_code: bool = False) -> Inventory:
    """The operators the model in ``model_dir`` uses (built on the meta device: no weights
    load), by module type and by the aten ops of one traced forward, each with where it is
    used and whether the catalogue covers it, and what no operator stands for."""
    from numalign.ops.registry import load_catalogue

    load_catalogue()
    folder = Path(model_dir)
    model = _meta_model(folder, trust_remote_code)
    result = Inventory(model=folder.name, architecture=type(model).__name__)
    types: dict[str, list[str]] = defaultdict(list)
    for name, module in model.named_modules():
        if name:
            types[type(module).__name__].append(name)
    result.module_types = dict(types)
    counts, result.trace_error = _trace_aten(model)
    result.aten_ops = dict(sorted(counts.items()))
    result.rows = _rows(model, types, counts)
    return result


def _meta_model(folder: Path, trust_remote_code: bool) -> Any:
    """The model of ``folder``'s config on the meta device, in eval mode."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(
        folder, local_files_only=True, trust_remote_code=trust_remote_code
    )
    arch = (getattr(config, "architectures", None) or ["AutoModelForCausalLM"])[0]
    cls = getattr(transformers, arch, transformers.AutoModelForCausalLM)
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"  # grouped kernels check dtypes meta cannot
    with torch.device("meta"):
        model = (
            cls._from_config(config) if hasattr(cls, "_from_config") else cls.from_config(config)
        )
    return model.eval()


def _trace_aten(model: Any) -> tuple[dict[str, int], str | None]:
    """How many times one forward of 8 tokens calls each aten op (by ``_variant`` name), and
    why the trace stopped early where it did (None: it ran through)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: dict[str, int] = defaultdict(int)

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, _types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            name = _variant(func.overloadpacket.__name__, kwargs or {})
            counts[name] += 1
            if name == "_local_scalar_dense":
                # .item() of a meta tensor has no value: a stand-in keeps the trace going
                # (a data-dependent branch may go the other way; the ops are what we list)
                return 1.0 if args[0].is_floating_point() else 1
            if name == "nonzero":  # a data-dependent shape: stand in one hit
                return torch.zeros((1, args[0].dim()), dtype=torch.long, device="meta")
            return func(*args, **(kwargs or {}))

    ids = torch.ones(1, 8, dtype=torch.long, device="meta")
    try:
        with torch.no_grad(), Recorder():
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    except Exception as exc:  # data-dependent ops cannot run on meta tensors
        return counts, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return counts, None


def _rows(model: Any, types: dict[str, list[str]], counts: dict[str, int]) -> list[dict[str, Any]]:
    """The inventory's rows: each catalogue operator the model uses (by module or by aten op)
    with where and its coverage, then the module types with parameters and the aten ops that
    no operator stands for."""
    from numalign.ops.registry import OPERATORS, candidates

    rows: list[dict[str, Any]] = []
    where: dict[str, set[str]] = defaultdict(set)
    for op in OPERATORS.values():
        for kind, names in types.items():
            used = [n for n in names if op.stands_for_module(model.get_submodule(n))]
            if op.stands_for(kind) and used:
                where[op.name].update(used)
    aten_map = aten_to_operators()
    for aten, op_names in aten_map.items():
        if aten in counts:
            for op_name in op_names:
                check = OPERATORS[op_name].hf_config_check
                if check is not None and not check(model.config):
                    continue
                if not any(op_covers(op_name, t) for t in types):
                    where[op_name].add(f"aten.{aten}")
    for name in sorted(where):
        status = "covered by candidates" if len(candidates(name)) else "reference only"
        rows.append({"operator": name, "where": natural_sorted(where[name]), "status": status})
    mapped = {n for names in where.values() for n in names}
    absorbing = {n for op_name in ABSORBS_CHILDREN for n in where.get(op_name, ())}
    for kind, names in sorted(types.items()):
        uncovered = [
            n
            for n in names
            if n not in mapped and not any(n.startswith(m + ".") for m in absorbing)
        ]
        module = model.get_submodule(names[0])
        has_params = any(p.numel() for p in module.parameters(recurse=False))
        if has_params and uncovered:
            rows.append({"operator": f"(module {kind})", "where": natural_sorted(uncovered),
                         "status": _missing(kind)})  # fmt: skip
    for aten in sorted(counts):
        if aten not in aten_map and aten not in GLUE:
            rows.append({"operator": f"(aten.{aten})", "where": ["forward"], "status": "missing"})
    return rows


def natural_sorted(names: Iterable[str]) -> list[str]:
    """Module names in the model's order of layers: numbers compared as numbers
    (``layers.2`` before ``layers.10``), the rest as text."""
    return sorted(names, key=lambda n: [(0, int(p), "") if p.isdigit() else (1, 0, p)
                                        for p in re.split(r"(\d+)", n)])  # fmt: skip


def _missing(kind: str) -> str:
    """A module type no operator stands for: ``missing``, naming the operators it is a form
    of that they lack (a gated RMSNorm is a form of ``rms_norm`` with a silu(gate) factor)."""
    from numalign.ops.registry import OPERATORS

    forms = sorted(op.name for op in OPERATORS.values() if op.extended_by(kind))
    if not forms:
        return "missing"
    return f"missing: a form of {', '.join(forms)} the catalogue lacks"


def _variant(name: str, kwargs: dict[str, Any]) -> str:
    """An aten operator's name, with the keyword that picks another catalogue operator:
    ``gelu`` is the exact (erf) GELU unless ``approximate="tanh"``."""
    if name == "gelu" and kwargs.get("approximate", "none") != "none":
        return f"gelu(approximate={kwargs['approximate']})"
    return name


def aten_to_operators() -> dict[str, tuple[str, ...]]:
    """aten operators -> the catalogue operators that declare them (``Operator.aten``)."""
    from numalign.ops.registry import OPERATORS, load_catalogue

    load_catalogue()
    table: dict[str, tuple[str, ...]] = {}
    for op in OPERATORS.values():
        for aten in op.aten:
            table[aten] = (*table.get(aten, ()), op.name)
    return table


def op_covers(op_name: str, module_type: str) -> bool:
    from numalign.ops.registry import OPERATORS

    return OPERATORS[op_name].stands_for(module_type)
