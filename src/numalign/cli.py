"""The numalign command line. Every command calls the public library API only."""

from __future__ import annotations

import argparse
import errno
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from numalign.golden.decode import DEFAULT_DECODE_STEPS
from numalign.golden.requests import FAR_LENGTH
from numalign.golden.store import DEFAULT_SETS, discover_sets
from numalign.settings import ATTN_IMPLEMENTATIONS, DEFAULT_TIER, ENGINES, TIERS

#: Where ``numalign run`` keeps the sets it captures: outside the tracked golden/sets (which
#: every ``pytest suites/`` replays), git-ignored.
RUN_SETS = Path(".numalign") / "sets"


def _report(args: argparse.Namespace) -> int:
    """numalign report RUN | numalign report merge RUN... --out DIR"""
    from numalign.report import merge_runs, render_run

    paths = [Path(p) for p in args.paths]
    if args.paths[0] == "merge":
        if len(paths) < 2 or args.out is None:
            print(
                "numalign report merge: give the run folders to merge and --out DIR",
                file=sys.stderr,
            )
            return 2
        run_dir = merge_runs(_existing(paths[1:]), Path(args.out))
    elif len(paths) == 1:
        run_dir = _existing(paths)[0]
    else:
        print(
            "numalign report: one run folder (or: numalign report merge RUN... --out DIR)",
            file=sys.stderr,
        )
        return 2
    baseline = Path(args.baseline) if args.baseline else None
    if baseline is not None and not baseline.exists():
        print(
            f"numalign report: --baseline {baseline}: no such run folder or records file",
            file=sys.stderr,
        )
        return 2
    from numalign.compare.tolerances import load_policy

    rendered = render_run(
        run_dir,
        baseline=baseline,
        factor=args.factor,
        history=Path(args.history) if args.history else None,
        append=False,
        # the thresholds of the project it runs in (its pyproject.toml), as the session's
        thresholds=load_policy(Path("pyproject.toml")).thresholds,
    )
    for path in rendered.written:
        print(path)
    verdict = rendered.verdict
    for note in verdict.notes if verdict else []:  # what the records lack or did not judge
        print(f"numalign report: {note}", file=sys.stderr)
    unsure = verdict is not None and verdict.verdict in ("incomplete", "not judged")
    if rendered.diff is not None:
        print(f"{len(rendered.diff.regressed)} regression(s) against {baseline}")
        if rendered.diff.regressed and args.fail_on_regression:
            return 1
    return 1 if unsure else 0


def _check_dtypes(text: str | None, option: str, command: str) -> None:
    """A comma list of dtypes, checked before any work (``--calibrate bf16`` ran a capture,
    then raised AttributeError)."""
    from numalign.settings import parse_dtypes

    if text:
        try:
            parse_dtypes(text)
        except ValueError as exc:
            raise SystemExit(f"numalign {command}: {option} {text!r}: {exc}") from None


def _check_model(model_dir: str, command: str) -> None:
    from numalign.golden.reference import ModelFolderError, check_model_dir

    try:
        check_model_dir(model_dir)
    except ModelFolderError as exc:
        raise SystemExit(f"numalign {command}: {exc}") from None


def _capture(args: argparse.Namespace) -> int:
    from numalign.golden.reference import Placement, parse_max_memory

    _check_model(args.model_dir, "capture")
    _check_dtypes(args.calibrate, "--calibrate", "capture")
    if args.prompts and not Path(args.prompts).is_file():
        raise SystemExit(f"numalign capture: --prompts {args.prompts}: no such file")
    if args.image and not Path(args.image).is_file():
        raise SystemExit(f"numalign capture: --image {args.image}: no such file")

    placement = None
    if args.device_map:
        try:
            memory = parse_max_memory(args.max_memory or "")
        except ValueError as exc:
            raise SystemExit(f"numalign capture: {exc}") from None
        folder = Path(args.offload_folder) if args.offload_folder else None
        placement = Placement(args.device_map, folder, memory or None)
    elif args.offload_folder or args.max_memory:
        raise SystemExit(
            "numalign capture: --offload-folder and --max-memory place a model with "
            "--device-map (e.g. --device-map auto --offload-folder DIR)"
        )
    if args.stream and placement is not None:
        from numalign.golden.loading import stream_choice

        try:
            stream_choice(args.model_dir, args.reference_dtype, True, placement=placement)
        except ValueError as exc:
            raise SystemExit(f"numalign capture: {exc}") from None
    from numalign.replay.ensemble import Member

    members = None
    if args.calibrate_with:
        try:
            named = [Member.parse(spec) for spec in args.calibrate_with if spec != "none"]
        except ValueError as exc:
            raise SystemExit(f"numalign capture: {exc}") from None
        members = [Member("reference"), *named]
    prompts = None
    if args.prompts:
        prompts = [line for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    try:
        golden = _capture_set(args, prompts, members, placement)
    except OSError as exc:  # a full disk, a folder that cannot be written: nothing was kept
        full = exc.errno == errno.ENOSPC
        raise SystemExit(
            f"numalign capture: {'the disk is full' if full else 'a file could not be written'}"
            f" ({exc.strerror or exc}: {exc.filename or args.out}); nothing was written to "
            f"{args.out} (the temporary folder was removed): "
            + ("free space there" if full else "check the folder's permissions")
            + ", or give another --out"
        ) from None
    print(f"{golden.path}: {len(golden.points)} points, {golden.disk_bytes() / 1e6:.2f} MB")
    return 0


def _capture_set(args: argparse.Namespace, prompts: Any, members: Any, placement: Any) -> Any:
    from numalign.replay.ensemble import capture_calibrated

    return capture_calibrated(
        args.model_dir,
        args.out,
        points=args.points,
        prompts=prompts,
        image=args.image,
        reference_dtype=args.reference_dtype,
        calibrate=[d for d in args.calibrate.split(",") if d],
        members=members,
        continuation=args.continuation,
        decode_steps=args.decode_steps,
        long=args.long,
        far=args.far,
        max_position=args.max_position,
        attn_implementation=args.attn_implementation,
        trust_remote_code=args.trust_remote_code,
        placement=placement,
        force=args.force,
        probes=not args.no_probes,
        stream=args.stream,
    )


def _sweep(args: argparse.Namespace) -> int:
    from numalign.sweep.build import causal_lm_types
    from numalign.sweep.run import TYPE_TIMEOUT_S, select_types, sweep

    if args.names:
        raise SystemExit("numalign zoo sweep: name types with --types a,b (not positionally)")
    if not (Path(args.suites) / "models").is_dir():
        raise SystemExit(
            f"numalign zoo sweep: --suites {args.suites}: no models/ suite in it; run from the "
            "repository root, or give the suites folder of a numalign checkout"
        )
    if args.baseline and not Path(args.baseline).is_file():
        raise SystemExit(f"numalign zoo sweep: --baseline {args.baseline}: no such file")
    try:
        types = select_types(
            causal_lm_types(args.image_text),
            [t for t in args.types.split(",") if t],
            args.limit,
            args.shard,
        )
    except ValueError as exc:
        raise SystemExit(f"numalign zoo sweep: {exc}") from None
    out = Path(args.out or "reports/sweep")
    chosen = f"--types ({len(types)} types)" if args.types else f"--limit {args.limit or 'none'}"
    rows = sweep(
        types, out.resolve(), Path(args.suites).resolve(),
        timeout=args.timeout or TYPE_TIMEOUT_S, resume=args.resume,
        command=f"numalign zoo sweep {chosen}",
    )  # fmt: skip
    from numalign.sweep.table import changes, read_rows, summary

    moved = changes(read_rows(Path(args.baseline)), rows) if args.baseline else []
    for line in moved:
        print(f"numalign sweep: {line}")
    print(f"numalign sweep: {summary(rows)}; table {out / 'sweep.md'}")
    regressed = [line for line in moved if line.startswith("regression")]
    return 1 if regressed and args.fail_on_regression else 0


def _zoo(args: argparse.Namespace) -> int:
    from numalign.golden.zoo import build_zoo
    from numalign.replay.ensemble import capture_calibrated

    if args.action == "sweep":
        return _sweep(args)
    for path in build_zoo(args.out or "golden/models", args.names or None):
        line = f"{path}"
        if args.sets:
            golden = capture_calibrated(path, Path(args.sets) / path.name, progress=False)
            line += f" -> {golden.path} ({len(golden.points)} points)"
        print(line)
    return 0


def _golden(args: argparse.Namespace) -> int:
    from numalign.golden import GoldenSet

    if args.action == "ls":
        return _golden_ls(Path(args.target or DEFAULT_SETS))
    if not args.target:
        print(f"numalign golden {args.action}: give a golden set folder", file=sys.stderr)
        return 2
    g = GoldenSet.open(_set_folder(args.target))
    if args.action == "verify":
        g.verify(contents=True)
        g.check_fresh()
        print(
            f"{g.path}: {len(g.manifest.shards)} shard(s) and {len(g.manifest.tensors)} "
            "tensor(s) verified; model fresh"
        )
        return 0
    if args.action == "power":
        return _golden_power(g)
    m, ref = g.manifest, g.reference
    print(f"set        {g.path}")
    print(f"model      {g.model.name} ({g.model.architecture}) at {g.model_dir}")
    print(f"fingerprint {g.model.fingerprint}")
    print(f"reference  {ref.dtype} on {ref.device}, attention {ref.attn_implementation}, "
          f"torch {ref.torch}, transformers {ref.transformers}")  # fmt: skip
    print(f"requests   {', '.join(r.name for r in g.requests)}")
    print(f"calibrated {', '.join(m.calibration) or 'no'}")
    for dtype, members in m.ensemble.items():
        print(f"  {dtype:9} over {len(members)} member(s): {'; '.join(members)}")
    print(
        f"size       {g.disk_bytes() / 1e6:.2f} MB on disk, "
        f"{g.unique_tensor_bytes() / 1e6:.2f} MB of unique tensors"
    )
    _show_power(m.power)
    for point in g.points:
        calls = [c for request in point.calls.values() for c in request]
        outputs = ", ".join(
            f"{path}: {_described(m.tensors.get(key))}"
            for path, key in (calls[0].outputs.items() if calls else ())
        )
        print(f"  {point.name:52} {point.type:28} {outputs or '(no calls)'}")
    return 0


def _golden_power(g: Any) -> int:
    """``golden power``: the set's power per point computed from its calibration and
    written into its manifest (its model checked fresh first: the figures are of it)."""
    from numalign.replay.set_power import power_line, set_power

    g.check_fresh()
    started = time.monotonic()
    power = set_power(g)
    g.write_power(power)
    outputs = sum(len(modes) for points in power.values() for outputs in points.values()
                  for modes in outputs.values())  # fmt: skip
    print(f"{g.path}: power of {outputs} point output(s) and mode(s) written in "
          f"{time.monotonic() - started:.1f} s; {power_line(power)}")  # fmt: skip
    return 0


def _show_power(power: Any) -> None:
    """``golden show``'s lines of the set's power: per dtype and mode, the median and worst
    figure over its point outputs (or that the set holds none)."""
    from numalign.replay.set_power import power_summary

    if not power:
        print("power      none stored (numalign golden power SET computes it)")
        return
    print("power      what a pass catches: scale relative, bias in RMS (median / worst)")
    for dtype, modes in power_summary(power).items():
        for mode, s in modes.items():
            print(f"  {dtype:9} {mode:11} scale {s['scale_median']:.3g} / {s['scale_worst']:.3g}"
                  f"  bias {s['bias_median']:.3g} / {s['bias_worst']:.3g}"
                  f"  ({int(s['outputs'])} outputs)")  # fmt: skip


def _set_folder(target: str) -> Path:
    """A set's folder from what ``golden show|verify|power`` was given: a folder, or the name of a
    set under the default sets folder as ``golden ls`` prints it (a folder of that name
    where the command runs comes first)."""
    folder = Path(target)
    named = Path(DEFAULT_SETS) / target
    if not folder.is_dir() and folder.parent == Path(".") and named.is_dir():
        return named
    return folder


def _described(info: object) -> str:
    """A tensor's dtype and shape from the manifest, or what is wrong (show never raises)."""
    if info is None:
        return "MISSING from the manifest (numalign golden verify)"
    return f"{getattr(info, 'dtype', '?')}{getattr(info, 'shape', '?')}"


def _golden_ls(folder: Path) -> int:
    """One line per set under ``folder``; a set that cannot be read is a line saying why
    (exit 1), never the end of the listing."""
    from numalign.golden import GoldenSet, GoldenSetError

    if not folder.is_dir():
        print(f"numalign golden ls: {folder}: no such folder", file=sys.stderr)
        return 2
    status = 0
    for path in discover_sets([folder]):
        try:
            g = GoldenSet.open(path)
            fresh = "fresh" if g.model_dir.is_dir() and g.fingerprint_matches() else "STALE"
            print(f"{g.name:24} {g.model.architecture:36} {len(g.points):4} points "
                  f"{g.disk_bytes() / 1e6:8.2f} MB  {fresh}")  # fmt: skip
        except (GoldenSetError, OSError, ValueError) as exc:
            print(f"{path.name:24} BROKEN: {exc}")
            status = 1
    return status


def _inventory(args: argparse.Namespace) -> int:
    from numalign.inventory import inventory

    _check_model(args.model_dir, "inventory")

    result = inventory(args.model_dir, trust_remote_code=args.trust_remote_code)
    print(result.to_json() if args.format == "json" else result.to_markdown(), end="")
    return 0


def _plan(args: argparse.Namespace) -> int:
    """numalign plan MODEL_DIR: what a capture and a replay will take (numalign.plan)."""
    from numalign.plan import plan
    from numalign.settings import parse_size

    _check_model(args.model_dir, "plan")
    _check_dtypes(args.dtype, "--dtype", "plan")
    try:
        device_memory = parse_size(args.device_memory, "--device-memory")
    except ValueError as exc:
        raise SystemExit(f"numalign plan: {exc}") from None
    result = plan(
        args.model_dir, dtypes=tuple(d for d in args.dtype.split(",") if d),
        reference_dtype=args.reference_dtype, device_memory=device_memory, long=args.long,
        far=args.far, max_position=args.max_position, continuation=args.continuation,
        decode_steps=args.decode_steps, trust_remote_code=args.trust_remote_code,
        measured=not args.no_measure,
    )  # fmt: skip
    print(result.to_json() if args.json else result.to_text(), end="")
    return 0


def _check_run_options(args: argparse.Namespace, command: str, **values: object) -> None:
    """The options ``run`` and ``nightly`` hand to the suites, validated before any work as
    the plugin validates them (``Settings.from_options``)."""
    from numalign.settings import Settings

    options = {"device": args.device, "dtype": args.dtype, "tier": args.tier, **values}
    try:
        Settings.from_options(options)
    except ValueError as exc:
        raise SystemExit(f"numalign {command}: {exc}") from None


def _nightly(args: argparse.Namespace) -> int:
    from numalign.nightly import nightly

    _check_run_options(args, "nightly", compile=args.compile)
    if not Path(args.models).is_dir():
        raise SystemExit(
            f"numalign nightly: --models {args.models}: no such folder of model folders "
            "(numalign zoo build writes the zoo's into golden/models)"
        )

    return nightly(
        Path(args.models), Path(args.sets), [Path(s) for s in args.suites], Path(args.report_dir),
        tier=args.tier, device=args.device, dtypes=args.dtype, extra=args.pytest_args or [],
        compile_backend=args.compile,
    )  # fmt: skip


def _run(args: argparse.Namespace) -> int:
    from numalign.nightly import bring_up

    _check_model(args.model_dir, "run")
    _check_run_options(args, "run", tp=str(args.tp))
    if not (Path(args.suites) / "models").is_dir():
        raise SystemExit(
            f"numalign run: --suites {args.suites}: no models/ suite in it; run from the "
            "repository root, or give the suites folder of a numalign checkout"
        )

    return bring_up(
        Path(args.model_dir), Path(args.sets), Path(args.suites), Path(args.report_dir),
        device=args.device, dtypes=args.dtype, tier=args.tier, tp=args.tp, engine=args.engine,
        stream=bool(args.stream),
    )  # fmt: skip


def _cache(args: argparse.Namespace) -> int:
    """numalign cache info | prune: the operator suite's truth cache."""
    from collections import defaultdict

    from numalign.settings import parse_size
    from numalign.truths import cache_entries, default_truth_folder, prune_truths

    folder = Path(args.cache) if args.cache else default_truth_folder(Path.cwd())
    if args.action == "prune":
        try:
            cap = 0 if args.all else parse_size(args.max_size, "--max-size")
        except ValueError as exc:
            raise SystemExit(f"numalign cache prune: {exc}") from None
        removed, freed = prune_truths(folder, cap)
        print(f"{folder}: removed {removed} entries, {freed / 1e6:.1f} MB (least recently used "
              f"first, down to {cap / 1e6:.0f} MB)")  # fmt: skip
        return 0
    entries = cache_entries(folder)
    per_op: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for path, size, _ in entries:
        per_op[path.parent.name][0] += 1
        per_op[path.parent.name][1] += size
    total = sum(size for _, size, _ in entries)
    print(f"{folder}: {len(entries)} entries, {total / 1e6:.1f} MB")
    for op, (count, size) in sorted(per_op.items(), key=lambda kv: -kv[1][1]):
        print(f"  {op:32} {count:6} entries {size / 1e6:10.1f} MB")
    return 0


def _existing(paths: list[Path]) -> list[Path]:
    missing = [p for p in paths if not (p / "records.jsonl").is_file()]
    if missing:
        raise SystemExit(
            f"numalign report: no records.jsonl in {', '.join(map(str, missing))}: give run "
            "folders as written under --report-dir (reports/<run-id>/)"
        )
    return paths


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that names every option's default: argparse's "(default: X)" where the help
    text does not already say it in words (None and False defaults: the help says what
    happens without the option)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, [], argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action)


def _subparser(commands: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        name, formatter_class=_Formatter, allow_abbrev=False, **kwargs
    )
    return parser


def _add_report(commands: Any) -> None:
    """numalign report RUN | report merge RUN... --out DIR"""
    report = _subparser(
        commands,
        "report",
        help="render a run's drift report (or merge runs: report merge RUN... --out DIR)",
        description="Re-renders drift.html, drift.csv and summary.json of a run folder, "
        "optionally against a baseline run; 'report merge RUN... --out DIR' first joins "
        "the records of several runs (shards, machines) into DIR.",
    )
    report.add_argument("paths", nargs="+", metavar="RUN", help="a run folder, or: merge RUN...")
    report.add_argument(
        "--baseline", help="a run folder or records.jsonl to compare against (none: no diff)"
    )
    report.add_argument(
        "--factor", type=float, default=2.0,
        help="a record regresses when its use of budget grows beyond this factor",
    )  # fmt: skip
    report.add_argument(
        "--history", help="history file whose trend the report draws (none: no trend)"
    )
    report.add_argument("--out", help="output run folder of 'report merge' (required there)")
    report.add_argument(
        "--fail-on-regression", action="store_true", help="exit 1 on regressions (off: exit 0)"
    )
    report.set_defaults(handler=_report)


def _add_capture(commands: Any) -> None:
    """numalign capture MODEL_DIR --out SET"""
    cap = _subparser(
        commands,
        "capture",
        help="capture a golden set from a local Hugging Face model folder",
        description="Runs the model (loaded offline with from_pretrained) on built-in or given "
        "prompts (and long requests past every length boundary of the model), records every "
        "capture point's inputs and outputs, the logits, a greedy continuation and a cached "
        "decode, calibrates lower dtypes, and writes the set atomically.",
    )
    cap.add_argument("model_dir", metavar="MODEL_DIR", help="a local Hugging Face model folder")
    cap.add_argument(
        "--out",
        required=True,
        help="the golden set folder, e.g. golden/sets/NAME: a new folder, or a set of this model",
    )
    cap.add_argument(
        "--force",
        action="store_true",
        help="replace a set of another model at --out (kept under its folder's .versions/)",
    )
    cap.add_argument(
        "--points", nargs="+", metavar="PATTERN",
        help="module name patterns (fnmatch) to capture (none: every point of the model)",
    )  # fmt: skip
    cap.add_argument(
        "--prompts", metavar="FILE", help="one prompt per line (none: the built-in prompts)"
    )
    cap.add_argument(
        "--image", metavar="FILE", help="image for image-text models (none: a built-in one)"
    )
    cap.add_argument(
        "--reference-dtype", default="float32", choices=["float32", "float64"],
        help="dtype the reference runs in",
    )  # fmt: skip
    cap.add_argument(
        "--calibrate",
        default="float32,bfloat16,float16",
        help="comma list of dtypes to calibrate ('' for none)",
    )
    cap.add_argument(
        "--calibrate-with",
        action="append",
        metavar="MEMBER",
        help="a member of the calibration ensemble besides the reference, as key=value,... "
        "(onednn=AVX2, aten=default, threads=1, attn=sdpa, dtypes=float32/bfloat16, or an "
        "ENV_VAR=value); repeatable; "
        "replaces the default members (on the CPU: oneDNN and ATen instruction sets below the "
        "machine's, one thread and several, the other attention); 'none': the reference alone",
    )
    _add_capture_requests(cap)
    cap.add_argument(
        "--attn-implementation", choices=ATTN_IMPLEMENTATIONS,
        help="attention implementation of the reference (none: eager)",
    )  # fmt: skip
    cap.add_argument(
        "--trust-remote-code", action="store_true",
        help="run the model folder's own Python code (off: transformers' classes only)",
    )  # fmt: skip
    _add_capture_placement(cap)
    cap.set_defaults(handler=_capture)


def _add_capture_requests(cap: argparse.ArgumentParser) -> None:
    """capture: what the set records beyond the prompts' forward (continuation, decode, long
    and far-position requests)."""
    cap.add_argument("--continuation", type=int, default=8, help="greedy tokens to record")
    cap.add_argument(
        "--decode-steps",
        type=int,
        default=DEFAULT_DECODE_STEPS,
        help="cached decode steps to record per generating request (0: none)",
    )
    cap.add_argument(
        "--long",
        type=int,
        default=None,
        metavar="TOKENS",
        help="length of the long requests (default: past the sliding window, the linear-"
        "attention chunk and the paged replay's page size, from the config; 0: none)",
    )
    cap.add_argument(
        "--far",
        type=int,
        default=FAR_LENGTH,
        metavar="TOKENS",
        help="tokens per row of the far-position request, whose rows sit a quarter, half and "
        "all the way into the model's position range (0: none)",
    )
    cap.add_argument(
        "--max-position",
        type=int,
        default=None,
        metavar="POSITIONS",
        help="the position range the far-position request spans (default: the config's "
        "max_position_embeddings; lower it where a model is served with fewer)",
    )
    cap.add_argument(
        "--no-probes",
        action="store_true",
        help="record no probe calls (by default each norm is also fed rows at its epsilon and "
        "each kind of activation its gating tail, replayed alone: docs/resolution.md)",
    )


def _add_capture_placement(cap: argparse.ArgumentParser) -> None:
    """capture: where a model too large for memory is placed (accelerate's big-model
    placement), or whether its weights stream (``golden.stream``)."""
    from numalign.golden.loading import STREAM_SHARE

    cap.add_argument(
        "--device-map",
        metavar="MAP",
        help="load the model with accelerate's big-model placement (auto, balanced, "
        "sequential): for weights that do not fit in memory; the set is the same "
        "(none: in memory)",
    )
    cap.add_argument(
        "--offload-folder",
        metavar="DIR",
        help="with --device-map: where weights that fit nowhere are offloaded (disk)",
    )
    cap.add_argument(
        "--max-memory",
        metavar="DEVICE=SIZE,...",
        help="with --device-map: memory each device may hold, e.g. cpu=2GiB or 0=20GiB,cpu=64GiB",
    )
    cap.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="stream the reference's weights from the checkpoint's safetensors one unit "
        "(decoder layer, embedding, norm, head) at a time, and every calibration member's: "
        "peak memory one layer's weights, the set the same (default: streamed where the "
        f"weights would take more than {STREAM_SHARE * 100:.0f}%% of the memory available, "
        "said so; --no-stream: whole)",
    )


def _add_inventory(commands: Any) -> None:
    """numalign inventory MODEL_DIR"""
    inv = _subparser(
        commands,
        "inventory",
        help="the catalogue operators a model needs, and which are covered (no weights read)",
        description="Builds the model on the meta device from its config, lists its module "
        "types and the aten operators a forward runs, and maps them to catalogue operators: "
        "where each is used, and whether candidates cover it, only the reference, or nothing.",
    )
    inv.add_argument("model_dir", metavar="MODEL_DIR", help="a local Hugging Face model folder")
    inv.add_argument("--format", choices=["md", "json"], default="md", help="output format")
    inv.add_argument(
        "--trust-remote-code", action="store_true",
        help="run the model folder's own Python code (off: transformers' classes only)",
    )  # fmt: skip
    inv.set_defaults(handler=_inventory)


def _add_plan(commands: Any) -> None:
    """numalign plan MODEL_DIR"""
    plan = _subparser(
        commands,
        "plan",
        help="what capturing and replaying a model will take: memory, ranks, time (no weights "
        "read)",
        description="Builds the model on the meta device from its config and prints, per part "
        "and in total, its weights in the reference and candidate dtypes, the activations, KV "
        "cache and golden set of the capture's requests, the peak memory unstreamed and "
        "streamed (one layer at a time), the pipeline ranks --device-memory needs, and a time "
        "estimate from this machine's measured throughput (docs/plan.md).",
    )
    plan.add_argument("model_dir", metavar="MODEL_DIR", help="a local Hugging Face model folder")
    plan.add_argument("--dtype", default="bfloat16", help="comma list of candidate dtypes to size")
    plan.add_argument(
        "--reference-dtype", default="float32", choices=["float32", "float64"],
        help="dtype the reference (the capture) runs in",
    )  # fmt: skip
    plan.add_argument(
        "--device-memory", default="80GiB", metavar="SIZE",
        help="memory of one device, for the ranks (e.g. 80GiB, 141GB)",
    )  # fmt: skip
    plan.add_argument("--continuation", type=int, default=8, help="as numalign capture's")
    plan.add_argument(
        "--decode-steps", type=int, default=DEFAULT_DECODE_STEPS, help="as numalign capture's"
    )
    plan.add_argument(
        "--long", type=int, default=None, metavar="TOKENS",
        help="as numalign capture's (default: past every length boundary, from the config)",
    )  # fmt: skip
    plan.add_argument(
        "--far", type=int, default=FAR_LENGTH, metavar="TOKENS", help="as numalign capture's"
    )
    plan.add_argument(
        "--max-position", type=int, default=None, metavar="POSITIONS",
        help="as numalign capture's (default: the config's max_position_embeddings)",
    )  # fmt: skip
    plan.add_argument(
        "--trust-remote-code", action="store_true",
        help="run the model folder's own Python code (off: transformers' classes only)",
    )  # fmt: skip
    plan.add_argument("--json", action="store_true", help="print JSON (off: tables)")
    plan.add_argument(
        "--no-measure", action="store_true",
        help="measure nothing, estimate no time (by default about half a second measures "
        "this machine's matmul and read throughput)",
    )  # fmt: skip
    plan.set_defaults(handler=_plan)


def _add_nightly(commands: Any) -> None:
    """numalign nightly"""
    night = _subparser(
        commands,
        "nightly",
        help="recapture sets of changed models, run the suites against the last nightly",
        description="Recaptures the golden set of every model folder whose fingerprint no "
        "longer matches (the previous version is kept under SETS/.versions/), runs the suites "
        "against the previous nightly run as the baseline, and exits non-zero on a failure "
        "or a regression. Models that did not change are not recaptured.",
    )
    night.add_argument("--models", default="golden/models", help="folder of model folders")
    night.add_argument(
        "--sets", default=str(DEFAULT_SETS), help="folder of their golden sets (one per model)"
    )
    night.add_argument("--suites", nargs="+", default=["suites"], help="suite folders to run")
    night.add_argument(
        "--report-dir", default="reports/nightly", help="where the nightly runs and history go"
    )
    _suite_option(night, "--tier", default=TIERS[-1], choices=TIERS,
                  help=f"case grid size: {', '.join(TIERS)} (default {TIERS[-1]})")  # fmt: skip
    _suite_option(night, "--device")
    _suite_option(night, "--dtype")
    _suite_option(
        night, "--compile",
        help="then run layer and model replay through torch.compile (default backend inductor) "
        "into REPORT_DIR/compiled, against tonight's eager run (ci/nightly.sh does; none: "
        "eager only)",
    )  # fmt: skip
    night.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    night.set_defaults(handler=_nightly)


def _add_run(commands: Any) -> None:
    """numalign run MODEL_DIR"""
    run = _subparser(
        commands,
        "run",
        help="bring up a model: inventory, capture if needed, the suites, the reports",
        description="Bring-up of one model folder: its inventory; a capture into "
        "SETS/<folder name> unless a set there has the model's fingerprint; then the model "
        "suites on that set alone and the operator tests of the operators the inventory maps "
        "the model to (by exact name); prints this run's report path.",
    )
    run.add_argument("model_dir", metavar="MODEL_DIR", help="a local Hugging Face model folder")
    run.add_argument(
        "--sets", default=str(RUN_SETS),
        help="where the model's golden set is captured and looked for (outside the tracked "
        "golden/sets, which every pytest suites/ run replays)",
    )  # fmt: skip
    run.add_argument("--suites", default="suites", help="the suites folder of a checkout")
    run.add_argument("--report-dir", default="reports", help="where run reports go")
    _suite_option(run, "--tier", default=DEFAULT_TIER, choices=TIERS)
    _suite_option(run, "--device")
    _suite_option(run, "--dtype")
    _suite_option(run, "--engine", default="transformers", choices=ENGINES)
    _suite_option(run, "--tp", type=int, default=1)
    _suite_option(run, "--stream", action="store_true", default=False)
    run.set_defaults(handler=_run)


def _suite_option(parser: argparse.ArgumentParser, flag: str, **overrides: Any) -> None:
    """A pytest option of the suites (``options.OPTIONS``, the one table) as a command's
    that hands it to them: its help, metavar, nargs and const from the table; ``overrides``
    where the command reads it otherwise (a type, choices, its own default). Not given and
    without a default of the command's, the suites take the table's default, which the help
    names."""
    from numalign.options import OPTIONS

    option = next(o for o in OPTIONS if o.flag == flag)
    kwargs: dict[str, Any] = {"help": option.help, "default": None}
    for key in ("metavar", "nargs", "const"):
        if getattr(option, key) is not None:
            kwargs[key] = getattr(option, key)
    parser.add_argument(flag, **(kwargs | overrides))


def _add_zoo(commands: Any) -> None:
    """numalign zoo build | sweep"""
    zoo = _subparser(commands, "zoo", help="the embedded tiny model zoo, and the day-0 sweep")
    zoo.add_argument(
        "action",
        choices=["build", "sweep"],
        help="build: write the zoo's model folders; sweep: a tiny checkpoint of every "
        "causal-LM type transformers ships, captured, replayed and planted, into a table",
    )
    zoo.add_argument("names", nargs="*", help="zoo models to build (none: all)")
    zoo.add_argument(
        "--out",
        default=None,
        help="where the model folders go (build: golden/models; sweep: reports/sweep, with "
        "sweep.csv and sweep.md)",
    )
    zoo.add_argument(
        "--sets", default=str(DEFAULT_SETS), help="capture their golden sets here ('' not to)"
    )
    zoo.add_argument("--types", default="", help="sweep: comma list of model types (none: all)")
    zoo.add_argument("--limit", type=int, default=None, help="sweep: at most N types")
    zoo.add_argument("--shard", default=None, help="sweep: I/N, every N-th type from the I-th")
    zoo.add_argument(
        "--image-text", action="store_true", help="sweep: the image-text-to-text types too"
    )
    zoo.add_argument("--timeout", type=float, default=None, help="sweep: seconds one type may take")
    zoo.add_argument(
        "--resume", action="store_true", help="sweep: keep the CSV's rows, sweep the rest"
    )
    zoo.add_argument("--baseline", default=None, help="sweep: a previous sweep.csv to diff")
    zoo.add_argument(
        "--fail-on-regression",
        action="store_true",
        help="sweep: exit 1 when a type regressed against --baseline",
    )
    zoo.add_argument("--suites", default="suites", help="sweep: the suites folder")
    zoo.set_defaults(handler=_zoo)


def _add_cache(commands: Any) -> None:
    """numalign cache info | prune"""
    cache = _subparser(
        commands,
        "cache",
        help="the operator suite's truth cache: its size, or trim it",
        description="info: entries and size per operator; prune: remove the least recently "
        "used entries down to --max-size (--all: every entry). A session keeps the cache "
        "under --truth-cache-size (pytest option) by itself.",
    )
    cache.add_argument("action", choices=["info", "prune"], help="info: sizes; prune: trim")
    cache.add_argument(
        "--cache", metavar="DIR",
        help="the truth folder (none: $NUMALIGN_CACHE/truths, else .numalign-cache/truths)",
    )  # fmt: skip
    cache.add_argument(
        "--max-size", default="4GB", metavar="SIZE", help="prune: the size to trim down to"
    )
    cache.add_argument("--all", action="store_true", help="prune: every entry (off: to size)")
    cache.set_defaults(handler=_cache)


def _add_golden(commands: Any) -> None:
    """numalign golden ls | show | verify | power"""
    golden = _subparser(commands, "golden", help="list, show and verify golden sets")
    golden.add_argument(
        "action", choices=["ls", "show", "verify", "power"],
        help="ls: the sets of a folder; show: one set's contents; verify: its checksums and "
        "its model's fingerprint; power: (re)compute and store what a pass at each point "
        "would catch, from its calibration",
    )  # fmt: skip
    golden.add_argument(
        "target", nargs="?",
        help=f"a set folder or a set's name under {DEFAULT_SETS} (ls: a folder of sets, "
        f"none: {DEFAULT_SETS})",
    )  # fmt: skip
    golden.set_defaults(handler=_golden)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command. Abbreviations are off everywhere (``--device`` is not
    ``--device-map``), and every option says its default."""
    from numalign import __version__

    parser = argparse.ArgumentParser(
        prog="numalign",
        description="Numerical alignment and regression suite for LLMs on AI accelerators. "
        "The suites run under pytest: pytest -n auto suites/",
        allow_abbrev=False,
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"numalign {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    _add_report(commands)
    _add_capture(commands)
    _add_inventory(commands)
    _add_plan(commands)
    _add_nightly(commands)
    _add_run(commands)
    _add_zoo(commands)
    _add_cache(commands)
    _add_golden(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.handler(args))
    except (OSError, ValueError, RuntimeError) as exc:  # GoldenSetError is a RuntimeError
        print(f"numalign {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
