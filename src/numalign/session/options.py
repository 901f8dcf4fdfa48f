"""The numalign options as data: one :class:`Option` per command-line option and ini key, in
the order ``pytest --help`` lists them, each with the ``Settings`` field it sets and how its
value is read. Everything else is built from this table: the plugin registers it
(``pytest_addoption``), ``Settings.from_options`` validates by it, the commands that hand
options on to the suites (``numalign run``, ``nightly``) add them with :func:`add_to`, and
ci/options_reference.py writes docs/reference/options.md from it."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any

from numalign.runtime.devices import validate_device
from numalign.runtime.serving import ARRANGEMENTS, DEFAULT_SERVING, parse_serving
from numalign.session.option_values import (
    ATTN_IMPLEMENTATIONS,
    CACHE_IMPLEMENTATIONS,
    DEFAULT_CACHE_IMPLEMENTATIONS,
    DEFAULT_DTYPES,
    DEFAULT_ENGINE,
    DEFAULT_REGRESSION_FACTOR,
    DEFAULT_TIER,
    DEFAULT_VLLM_MEMORY,
    TIERS,
    optional_path,
    optional_text,
    parse_attn_implementation,
    parse_cache_implementations,
    parse_count,
    parse_engine,
    parse_experts_implementation,
    parse_ranks,
    parse_regression_factor,
    parse_run_dtypes,
    parse_seconds,
    parse_shard,
    parse_share,
    parse_size,
    parse_tier,
    parse_tp,
)

#: pytest's ini types an option's ini key may have.
INI_TYPES: tuple[str, ...] = ("string", "linelist", "paths", "bool")


@dataclass(frozen=True)
class Option:
    """One numalign option: its flag, its ini key (also its pytest ``dest``), its help, the
    ``Settings`` field it sets (``setting``) and, for a text option, the parser of its text
    (``parse``: text -> the field's value, ValueError naming the option); its ini type and
    default (what the session gets when neither the flag nor the ini key is given), and how
    argparse reads the flag (``action``: ``append`` for a repeatable option, ``store_true``
    for a switch; ``nargs``/``const`` for an optional value)."""

    flag: str
    ini: str
    help: str
    _: KW_ONLY
    setting: str
    parse: Callable[[str], Any] | None = None
    ini_type: str = "string"
    default: Any = ""
    action: str | None = None
    metavar: str | None = None
    nargs: str | None = None
    const: str | None = None

    def __post_init__(self) -> None:
        if self.ini_type not in INI_TYPES:
            raise ValueError(f"{self.flag}: ini type {self.ini_type!r} is not one of {INI_TYPES}")
        if (self.parse is None) != (self.ini_type != "string"):
            raise ValueError(f"{self.flag}: a text option has a parser, and no other has one")

    @property
    def name(self) -> str:
        """The key of its value in ``Settings.from_options``: ``--tp-timeout`` -> ``tp_timeout``."""
        return self.flag.removeprefix("--").replace("-", "_")

    def read(self, value: Any) -> Any:
        """Its ``Settings`` value, from the value pytest or a command gives: a switch's as a
        bool, a repeatable option's list as a tuple (of paths for ``paths``), a text through
        ``parse`` (None read as empty, a number as its text); ValueError from ``parse``."""
        if self.ini_type == "bool":
            return bool(value)
        if self.ini_type == "paths":
            return tuple(Path(p) for p in value)
        if self.ini_type == "linelist":
            return tuple(value)
        assert self.parse is not None  # __post_init__: every text option has one
        return self.parse("" if value is None else str(value))

    def argparse_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of its ``addoption`` besides the flag, ``dest`` and help."""
        kwargs: dict[str, Any] = {}
        if self.action is not None:
            kwargs["action"] = self.action
        if self.action == "store_true":
            kwargs["default"] = None  # unset on the command line: the ini key decides
        for key in ("metavar", "nargs", "const"):
            if getattr(self, key) is not None:
                kwargs[key] = getattr(self, key)
        return kwargs


#: Every numalign option, in the order ``pytest --help`` lists them.
OPTIONS: tuple[Option, ...] = (
    Option(
        "--device",
        "numalign_device",
        "where candidates run: auto (first of cuda, xpu, npu, mps, else cpu), cpu, cuda:1, ...",
        default="auto",
        setting="device",
        parse=validate_device,
    ),
    Option(
        "--device-plugin",
        "numalign_device_plugins",
        "module imported before device detection, e.g. a vendor's torch extension (repeatable)",
        ini_type="linelist",
        default=[],
        action="append",
        setting="device_plugins",
    ),
    Option(
        "--dtype",
        "numalign_dtype",
        f"comma list of dtypes candidates run in (default {','.join(DEFAULT_DTYPES)})",
        default=",".join(DEFAULT_DTYPES),
        setting="dtypes",
        parse=parse_run_dtypes,
    ),
    Option(
        "--tier",
        "numalign_tier",
        f"case grid size: {', '.join(TIERS)} (default {DEFAULT_TIER})",
        default=DEFAULT_TIER,
        setting="tier",
        parse=parse_tier,
    ),
    Option(
        "--golden",
        "numalign_golden",
        "extra golden set folder (repeatable)",
        ini_type="paths",
        default=[],
        action="append",
        setting="golden_dirs",
    ),
    Option(
        "--golden-only",
        "numalign_golden_only",
        "model suites replay only the --golden sets, not <rootdir>/golden/sets (numalign run "
        "replays the set of its model alone)",
        ini_type="bool",
        default=False,
        action="store_true",
        setting="golden_only",
    ),
    Option(
        "--candidates",
        "numalign_candidates",
        "module that registers candidates with @numalign.candidate (repeatable)",
        ini_type="linelist",
        default=[],
        action="append",
        setting="candidate_modules",
    ),
    Option(
        "--report-dir",
        "numalign_report_dir",
        "where run reports go (default reports/)",
        default="reports",
        setting="report_dir",
        parse=Path,
    ),
    Option(
        "--drift-baseline",
        "numalign_drift_baseline",
        "a run folder or records.jsonl to compare this run against",
        default="",
        setting="baseline",
        parse=optional_path,
    ),
    Option(
        "--regression-factor",
        "numalign_regression_factor",
        "a record regresses when its use of budget grows beyond this factor (default 2)",
        default=str(DEFAULT_REGRESSION_FACTOR),
        setting="regression_factor",
        parse=parse_regression_factor,
    ),
    Option(
        "--fail-on-regression",
        "numalign_fail_on_regression",
        "fail the session when a record regressed against --drift-baseline",
        ini_type="bool",
        default=False,
        action="store_true",
        setting="fail_on_regression",
    ),
    Option(
        "--history",
        "numalign_history",
        "history file runs are appended to (default <report-dir>/history.jsonl)",
        default="",
        setting="history",
        parse=optional_path,
    ),
    Option(
        "--swap",
        "numalign_swap",
        "OPERATOR=CANDIDATE: run models with every module the operator stands for replaced by "
        "the candidate (repeatable; all=NAME takes a candidate set)",
        ini_type="linelist",
        default=[],
        action="append",
        setting="swaps",
    ),
    Option(
        "--attn-implementation",
        "numalign_attn_implementation",
        "transformers attention implementation for model replay: eager or one transformers "
        "offers (" + ", ".join(ATTN_IMPLEMENTATIONS) + ", flash_attention_2, ...)",
        default="",
        setting="attn_implementation",
        parse=parse_attn_implementation,
    ),
    Option(
        "--engine",
        "numalign_engine",
        "what replays the model suites' models: transformers (the reference's modelling "
        "code) or vllm (vLLM's own model code, its modules mapped to the capture points; "
        "see docs/vllm.md)",
        default=DEFAULT_ENGINE,
        setting="engine",
        parse=parse_engine,
    ),
    Option(
        "--vllm-memory",
        "numalign_vllm_memory",
        "share of the device's memory (on CPU: of RAM) vLLM reserves for its KV cache "
        f"(gpu_memory_utilization; default {DEFAULT_VLLM_MEMORY})",
        default=str(DEFAULT_VLLM_MEMORY),
        setting="vllm_memory",
        parse=lambda text: parse_share(text, "--vllm-memory"),
    ),
    Option(
        "--serving",
        "numalign_serving",
        "how the serving engine serves the golden requests, one model and decode test each: "
        f"all, or a comma list of {', '.join(ARRANGEMENTS)} (default {DEFAULT_SERVING}; "
        "--engine vllm; see docs/vllm.md)",
        default=DEFAULT_SERVING,
        setting="serving",
        parse=parse_serving,
    ),
    Option(
        "--experts-implementation",
        "numalign_experts_implementation",
        "transformers experts implementation of MoE models for model replay: eager, "
        "batched_mm, grouped_mm",
        default="",
        setting="experts_implementation",
        parse=parse_experts_implementation,
    ),
    Option(
        "--cache-implementation",
        "numalign_cache_implementation",
        "comma list of what decode replay runs with: "
        + ", ".join(CACHE_IMPLEMENTATIONS)
        + f" (default {','.join(DEFAULT_CACHE_IMPLEMENTATIONS)})",
        default=",".join(DEFAULT_CACHE_IMPLEMENTATIONS),
        setting="cache_implementations",
        parse=parse_cache_implementations,
    ),
    Option(
        "--shard",
        "numalign_shard",
        "I/N: run only the I-th of N shards of the tests, split by a stable hash of test ids "
        "(join the runs with numalign report merge)",
        default="",
        setting="shard",
        parse=parse_shard,
    ),
    Option(
        "--allow-tf32",
        "numalign_allow_tf32",
        "allow TF32 matmuls on CUDA (off by default)",
        ini_type="bool",
        default=False,
        action="store_true",
        setting="allow_tf32",
    ),
    Option(
        "--truth-cache",
        "numalign_truth_cache",
        "folder of the operator suite's cached float64 truths, relative to the rootdir "
        "(default .numalign-cache/truths, or $NUMALIGN_CACHE/truths); off: no cache",
        default="",
        setting="truth_cache",
        parse=optional_path,
    ),
    Option(
        "--truth-cache-size",
        "numalign_truth_cache_size",
        "size the truth cache is kept under, least recently used entries evicted first "
        "(4GB, 500MB, 2GiB; 0: no cap; default 4GB)",
        default="4GB",
        metavar="SIZE",
        setting="truth_cache_max_bytes",
        parse=lambda text: parse_size(text, "--truth-cache-size"),
    ),
    Option(
        "--keep-runs",
        "numalign_keep_runs",
        "run folders the report folder keeps: older runs are removed at the end of a session, "
        "never the latest nor the baseline (0: keep every run; default 10)",
        default="10",
        metavar="N",
        setting="keep_runs",
        parse=lambda text: parse_count(text, "--keep-runs"),
    ),
    Option(
        "--compile",
        "numalign_compile",
        "run candidates, layers and models through torch.compile with this backend (default "
        "inductor when given without a value; any registered backend, a vendor's through "
        "--device-plugin); records name it in swap",
        default="",
        nargs="?",
        const="inductor",
        metavar="BACKEND",
        setting="compile_backend",
        parse=optional_text,
    ),
    Option(
        "--compile-mode",
        "numalign_compile_mode",
        "torch.compile mode with --compile: default, reduce-overhead, max-autotune, "
        "max-autotune-no-cudagraphs",
        default="",
        setting="compile_mode",
        parse=optional_text,
    ),
    Option(
        "--tp",
        "numalign_tp",
        "replay models tensor-parallel on N ranks of torch.distributed (transformers' "
        "tp_plan; gloo on cpu, nccl/xccl/hccl on accelerators); each xdist worker launches its "
        "own group of N ranks with torchrun",
        default="1",
        metavar="N",
        setting="tp",
        parse=parse_tp,
    ),
    Option(
        "--pp",
        "numalign_pp",
        "replay models pipeline-parallel on N ranks of torch.distributed, each holding a "
        "contiguous range of the decoder layers, the activations passed rank to rank; started "
        "and timed as --tp's ranks (--tp-launcher, --tp-timeout); see docs/pipeline-parallel.md",
        default="1",
        metavar="N",
        setting="pp",
        parse=lambda text: parse_ranks(text, "--pp", "pipeline"),
    ),
    Option(
        "--tp-launcher",
        "numalign_tp_launcher",
        "the command that starts the --tp ranks, for several machines (e.g. srun ... torchrun "
        "--nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HEAD:29500); "
        "numalign appends '-m numalign.replay.tp_rank --connect HOST:PORT'. Default: torchrun "
        "--standalone with N processes on this machine",
        default="",
        metavar="COMMAND",
        setting="tp_launcher",
        parse=optional_text,
    ),
    Option(
        "--tp-timeout",
        "numalign_tp_timeout",
        "seconds one replay may take on the tensor-parallel ranks before a hung rank is "
        "stopped and its test fails",
        default="600",
        metavar="SECONDS",
        setting="tp_timeout",
        parse=lambda text: parse_seconds(text, "--tp-timeout"),
    ),
    Option(
        "--stream",
        "numalign_stream",
        "model suites stream each model's weights from its safetensors checkpoint: only the "
        "unit running (a decoder layer, the embedding, the head) is on the device, for models "
        "whose weights do not fit on it; the same verdicts, each forward reads the weights "
        "once; compiled (--compile), each unit compiled alone; under --tp, each rank's shard "
        "(not with --engine vllm; see docs/models.md)",
        ini_type="bool",
        default=False,
        action="store_true",
        setting="stream",
    ),
)


#: The options by :attr:`Option.name`.
BY_NAME: Mapping[str, Option] = {option.name: option for option in OPTIONS}

#: Where a command's parser keeps the names of the options :func:`add_to` gave it.
_ADDED = "suite_options"


def add_to(
    parser: argparse.ArgumentParser,
    names: Iterable[str],
    *,
    defaults: bool = False,
    **overrides: Any,
) -> None:
    """Adds the options ``names`` (:attr:`Option.name`) to a command that hands them on to
    the suites, as pytest has them: the same flag, help, action, metavar, nargs and const.
    Not given, each is None, so the suites take their ini key, else the table's default
    (which the help names); with ``defaults``, the table's default, for a command that reads
    the value itself. ``overrides`` are argparse keywords of the command's own for every
    name given (a type, choices, a default or help of its own). :func:`command_values` reads
    them back."""
    names = tuple(names)
    for name in names:
        option = BY_NAME[name]
        kwargs = {"help": option.help, **option.argparse_kwargs()}
        kwargs["default"] = option.default if defaults else None
        parser.add_argument(option.flag, **(kwargs | overrides))
    parser.set_defaults(**{_ADDED: (*(parser.get_default(_ADDED) or ()), *names)})


def command_values(args: argparse.Namespace) -> dict[str, Any]:
    """The values of the options :func:`add_to` gave the command ``args`` were parsed by, by
    :attr:`Option.name`, as ``Settings.from_options`` takes them (None: not given)."""
    return {name: getattr(args, name) for name in getattr(args, _ADDED, ())}
