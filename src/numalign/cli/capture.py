"""numalign capture: a golden set of a model folder, calibrated."""

from __future__ import annotations

import argparse
import errno
import sys
from pathlib import Path
from typing import Any

from numalign.cli.common import check_dtypes, check_model, subparser
from numalign.core.statistics import DEFAULT_WIDTH
from numalign.golden.capture_spec import DEFAULT_CONTINUATION, CaptureSpec
from numalign.golden.decode import DEFAULT_DECODE_STEPS
from numalign.golden.requests import FAR_LENGTH
from numalign.session.option_values import ATTN_IMPLEMENTATIONS


def _capture(args: argparse.Namespace) -> int:
    from numalign.golden.reference import Placement, parse_max_memory

    check_model(args.model_dir, "capture")
    check_dtypes(args.calibrate, "--calibrate", "capture")
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
    if args.full_points:
        _estimate(args)
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
    from numalign.golden.statistics_info import statistics_summary

    stats = golden.manifest.statistics
    kept = statistics_summary(stats, sum(golden.manifest.tensors[s.sketch].bytes
                                         for s in stats.values()))  # fmt: skip
    if kept:
        print(f"{golden.path}: {kept}")
    return 0


def _estimate(args: argparse.Namespace) -> None:
    """The set's size with ``--full-points``, estimated before the capture from the model's
    config (``numalign plan``'s golden-set estimate), and whole."""
    from numalign.plan import plan
    from numalign.plan.text import size

    try:
        golden = plan(
            args.model_dir, reference_dtype=args.reference_dtype, long=args.long, far=args.far,
            max_position=args.max_position, continuation=args.continuation,
            decode_steps=args.decode_steps, trust_remote_code=args.trust_remote_code,
            measured=False, full_points=tuple(args.full_points), sketch_width=args.sketch_width,
        ).data["golden"]  # fmt: skip
    except Exception as exc:  # an estimate only: the capture goes on without it
        print(f"numalign capture: no size estimate ({exc})", file=sys.stderr)
        return
    print(
        f"numalign capture: the set will take about {size(golden['bytes'])} with "
        f"--full-points {' '.join(args.full_points)} (whole: about "
        f"{size(golden['whole_bytes'])}; numalign plan's estimate)",
        file=sys.stderr, flush=True,
    )  # fmt: skip


def _capture_set(args: argparse.Namespace, prompts: Any, members: Any, placement: Any) -> Any:
    from numalign.replay.ensemble import capture_calibrated

    spec = CaptureSpec(
        points=args.points,
        prompts=prompts,
        image=args.image,
        reference_dtype=args.reference_dtype,
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
        full_points=args.full_points,
        sketch_width=args.sketch_width,
    )
    calibrate = [d for d in args.calibrate.split(",") if d]
    return capture_calibrated(args.model_dir, args.out, spec, calibrate=calibrate, members=members)


def add_capture(commands: Any) -> None:
    """numalign capture MODEL_DIR --out SET"""
    cap = subparser(
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
        "--full-points", nargs="+", metavar="PATTERN",
        help="module name patterns (fnmatch) whose points keep their tensors whole; every other "
        "point keeps exact statistics and a sketch of its floating outputs, judged by them "
        "inside the whole model (none: every tensor whole; docs/golden-sets.md)",
    )  # fmt: skip
    cap.add_argument(
        "--sketch-width", type=int, default=DEFAULT_WIDTH, metavar="BUCKETS",
        help="with --full-points: buckets of each statistics-only tensor's sketch; its relative "
        "L2 estimate is within 3*sqrt(1/(2*BUCKETS)) (6.6%% at the default)",
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
    cap.add_argument(
        "--continuation", type=int, default=DEFAULT_CONTINUATION, help="greedy tokens to record"
    )
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
