"""The numalign pytest options as data: one :class:`Option` per command-line option and ini
key, in the order ``pytest --help`` lists them. The plugin registers them; ``Settings.
from_options`` validates their values (by :attr:`Option.name`); ci/options_reference.py
writes docs/reference/options.md from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from numalign.serving import ARRANGEMENTS, DEFAULT_SERVING
from numalign.settings import (
    ATTN_IMPLEMENTATIONS,
    CACHE_IMPLEMENTATIONS,
    DEFAULT_CACHE_IMPLEMENTATIONS,
    DEFAULT_DTYPES,
    DEFAULT_TIER,
    DEFAULT_VLLM_MEMORY,
    TIERS,
)

#: pytest's ini types an option's ini key may have.
INI_TYPES: tuple[str, ...] = ("string", "linelist", "paths", "bool")


@dataclass(frozen=True)
class Option:
    """One numalign option: its flag, its ini key (also its ``dest``), its help, its ini type
    and default (what the session gets when neither the flag nor the ini key is given), and
    how argparse reads the flag (``action``: ``append`` for a repeatable option,
    ``store_true`` for a switch; ``nargs``/``const`` for an optional value)."""

    flag: str
    ini: str
    help: str
    ini_type: str = "string"
    default: Any = ""
    action: str | None = None
    metavar: str | None = None
    nargs: str | None = None
    const: str | None = None

    @property
    def name(self) -> str:
        """The key of its value in ``Settings.from_options``: ``--tp-timeout`` -> ``tp_timeout``."""
        return self.flag.removeprefix("--").replace("-", "_")

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
    ),
    Option(
        "--device-plugin",
        "numalign_device_plugins",
        "module imported before device detection, e.g. a vendor's torch extension (repeatable)",
        ini_type="linelist",
        default=[],
        action="append",
    ),
    Option(
        "--dtype",
        "numalign_dtype",
        f"comma list of dtypes candidates run in (default {','.join(DEFAULT_DTYPES)})",
        default=",".join(DEFAULT_DTYPES),
    ),
    Option(
        "--tier",
        "numalign_tier",
        f"case grid size: {', '.join(TIERS)} (default {DEFAULT_TIER})",
        default=DEFAULT_TIER,
    ),
    Option(
        "--golden",
        "numalign_golden",
        "extra golden set folder (repeatable)",
        ini_type="paths",
        default=[],
        action="append",
    ),
    Option(
        "--golden-only",
        "numalign_golden_only",
        "model suites replay only the --golden sets, not <rootdir>/golden/sets (numalign run "
        "replays the set of its model alone)",
        ini_type="bool",
        default=False,
        action="store_true",
    ),
    Option(
        "--candidates",
        "numalign_candidates",
        "module that registers candidates with @numalign.candidate (repeatable)",
        ini_type="linelist",
        default=[],
        action="append",
    ),
    Option(
        "--report-dir",
        "numalign_report_dir",
        "where run reports go (default reports/)",
        default="reports",
    ),
    Option(
        "--drift-baseline",
        "numalign_drift_baseline",
        "a run folder or records.jsonl to compare this run against",
        default="",
    ),
    Option(
        "--regression-factor",
        "numalign_regression_factor",
        "a record regresses when its use of budget grows beyond this factor (default 2)",
        default="2.0",
    ),
    Option(
        "--fail-on-regression",
        "numalign_fail_on_regression",
        "fail the session when a record regressed against --drift-baseline",
        ini_type="bool",
        default=False,
        action="store_true",
    ),
    Option(
        "--history",
        "numalign_history",
        "history file runs are appended to (default <report-dir>/history.jsonl)",
        default="",
    ),
    Option(
        "--swap",
        "numalign_swap",
        "OPERATOR=CANDIDATE: run models with every module the operator stands for replaced by "
        "the candidate (repeatable; all=NAME takes a candidate set)",
        ini_type="linelist",
        default=[],
        action="append",
    ),
    Option(
        "--attn-implementation",
        "numalign_attn_implementation",
        "transformers attention implementation for model replay: eager or one transformers "
        "offers (" + ", ".join(ATTN_IMPLEMENTATIONS) + ", flash_attention_2, ...)",
        default="",
    ),
    Option(
        "--engine",
        "numalign_engine",
        "what replays the model suites' models: transformers (the reference's modelling "
        "code) or vllm (vLLM's own model code, its modules mapped to the capture points; "
        "see docs/vllm.md)",
        default="transformers",
    ),
    Option(
        "--vllm-memory",
        "numalign_vllm_memory",
        "share of the device's memory (on CPU: of RAM) vLLM reserves for its KV cache "
        f"(gpu_memory_utilization; default {DEFAULT_VLLM_MEMORY})",
        default=str(DEFAULT_VLLM_MEMORY),
    ),
    Option(
        "--serving",
        "numalign_serving",
        "how the serving engine serves the golden requests, one model and decode test each: "
        f"all, or a comma list of {', '.join(ARRANGEMENTS)} (default {DEFAULT_SERVING}; "
        "--engine vllm; see docs/vllm.md)",
        default=DEFAULT_SERVING,
    ),
    Option(
        "--experts-implementation",
        "numalign_experts_implementation",
        "transformers experts implementation of MoE models for model replay: eager, "
        "batched_mm, grouped_mm",
        default="",
    ),
    Option(
        "--cache-implementation",
        "numalign_cache_implementation",
        "comma list of what decode replay runs with: "
        + ", ".join(CACHE_IMPLEMENTATIONS)
        + f" (default {','.join(DEFAULT_CACHE_IMPLEMENTATIONS)})",
        default=",".join(DEFAULT_CACHE_IMPLEMENTATIONS),
    ),
    Option(
        "--shard",
        "numalign_shard",
        "I/N: run only the I-th of N shards of the tests, split by a stable hash of test ids "
        "(join the runs with numalign report merge)",
        default="",
    ),
    Option(
        "--allow-tf32",
        "numalign_allow_tf32",
        "allow TF32 matmuls on CUDA (off by default)",
        ini_type="bool",
        default=False,
        action="store_true",
    ),
    Option(
        "--truth-cache",
        "numalign_truth_cache",
        "folder of the operator suite's cached float64 truths, relative to the rootdir "
        "(default .numalign-cache/truths, or $NUMALIGN_CACHE/truths); off: no cache",
        default="",
    ),
    Option(
        "--truth-cache-size",
        "numalign_truth_cache_size",
        "size the truth cache is kept under, least recently used entries evicted first "
        "(4GB, 500MB, 2GiB; 0: no cap; default 4GB)",
        default="4GB",
        metavar="SIZE",
    ),
    Option(
        "--keep-runs",
        "numalign_keep_runs",
        "run folders the report folder keeps: older runs are removed at the end of a session, "
        "never the latest nor the baseline (0: keep every run; default 10)",
        default="10",
        metavar="N",
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
    ),
    Option(
        "--compile-mode",
        "numalign_compile_mode",
        "torch.compile mode with --compile: default, reduce-overhead, max-autotune, "
        "max-autotune-no-cudagraphs",
        default="",
    ),
    Option(
        "--tp",
        "numalign_tp",
        "replay models tensor-parallel on N ranks of torch.distributed (transformers' "
        "tp_plan; gloo on cpu, nccl/xccl/hccl on accelerators); each xdist worker launches its "
        "own group of N ranks with torchrun",
        default="1",
        metavar="N",
    ),
    Option(
        "--pp",
        "numalign_pp",
        "replay models pipeline-parallel on N ranks of torch.distributed, each holding a "
        "contiguous range of the decoder layers, the activations passed rank to rank; started "
        "and timed as --tp's ranks (--tp-launcher, --tp-timeout); see docs/pipeline-parallel.md",
        default="1",
        metavar="N",
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
    ),
    Option(
        "--tp-timeout",
        "numalign_tp_timeout",
        "seconds one replay may take on the tensor-parallel ranks before a hung rank is "
        "stopped and its test fails",
        default="600",
        metavar="SECONDS",
    ),
    Option(
        "--stream",
        "numalign_stream",
        "model suites stream each model's weights from its safetensors checkpoint: only the "
        "unit running (a decoder layer, the embedding, the head) is on the device, for models "
        "whose weights do not fit on it; the same verdicts, each forward reads the weights "
        "once (not with --tp, --compile, --swap or --engine vllm; see docs/models.md)",
        ini_type="bool",
        default=False,
        action="store_true",
    ),
)
