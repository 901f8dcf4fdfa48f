"""The nightly flow and the one-command bring-up.

``nightly``: every model folder whose fingerprint no longer matches its golden set gets a new
version of the set (the previous one is kept under ``<sets>/.versions/``); then the suites
run against the previous nightly run as the baseline, with the history carried, and the exit
status is non-zero on a failure or a regression. A model that did not change is not
recaptured.

Compiled backends are part of the nightly: after the eager run, layer and full-model replay
of the zoo run again through ``torch.compile`` (``--compile``, Inductor by default) into
``<report-dir>/compiled/``, with tonight's eager run as the baseline, so that its drift.html
shows compiled against eager side by side. A compiled record whose use of budget merely
grows past eager's is not a regression there (fusion legitimately changes the rounding); a
compiled test that fails, or a compilation error, fails the nightly. The compiled runs keep
their own history (``compiled/history.jsonl``).

``run``: inventory, a capture when there is no fresh set, the suites, and the report paths.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from numalign.core import finite_json
from numalign.golden import GoldenSet, GoldenSetError
from numalign.golden.capture_spec import CaptureSpec
from numalign.replay.ensemble import DEFAULT_CALIBRATION, capture_calibrated

VERSIONS = ".versions"
#: Suite files a compiled nightly run covers: layer, full-model and decode replay (decode with
#: the KV caches; the paged engine runs its own forward). The operator suite compiled costs a
#: compilation per candidate, dtype and case configuration (its time: docs/compiled.md): run
#: it by hand or at a PR (``pytest suites/operators --compile``).
COMPILED_SUITE_FILES = ("test_layers.py", "test_model.py", "test_decode.py")
#: Folder of the compiled runs under the nightly report folder.
COMPILED_DIR = "compiled"
#: Rows of each kind of the ratchet the nightly prints under its line (regressions.json and
#: drift.html have them all).
RATCHET_SHOWN = 10


@dataclass
class Refresh:
    recaptured: list[str] = field(default_factory=list)
    fresh: list[str] = field(default_factory=list)
    archived: list[Path] = field(default_factory=list)


def refresh_sets(
    models: Path, sets: Path, *, calibrate: Sequence[str] = DEFAULT_CALIBRATION
) -> Refresh:
    """Recaptures the set of every model folder under ``models`` whose set under ``sets`` is
    missing or stale; the previous version of a set is kept under ``sets/.versions/NAME/``."""
    result = Refresh()
    for model_dir in sorted(p for p in models.iterdir() if (p / "config.json").is_file()):
        target = sets / model_dir.name
        if (target / "manifest.json").is_file():
            try:
                golden = GoldenSet.open(target)
                if golden.fingerprint_matches(model_dir):
                    print(f"numalign nightly: {model_dir.name} is fresh", flush=True)
                    result.fresh.append(model_dir.name)
                    continue
                stamp = (golden.manifest.created or "unknown").replace(":", "")
            except GoldenSetError:
                stamp = "unreadable"
            keep = sets / VERSIONS / model_dir.name / stamp
            if keep.exists():
                shutil.rmtree(keep)
            keep.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(target, keep)
            result.archived.append(keep)
        print(f"numalign nightly: recapturing {model_dir.name} (its model changed)", flush=True)
        capture_calibrated(model_dir, target, calibrate=calibrate)
        result.recaptured.append(model_dir.name)
    return result


def run_suites(
    suites: Sequence[Path | str],
    report_dir: Path,
    *,
    tier: str,
    device: str | None = None,
    dtypes: str | None = None,
    baseline: Path | None = None,
    history: Path | None = None,
    golden: Sequence[Path] = (),
    extra: Sequence[str] = (),
    workers: str = "auto",
    fail_on_regression: bool = True,
) -> tuple[int, Path | None]:
    """``pytest -n auto`` over the suites (folders, files or test node ids); returns its exit
    status and the run folder this session wrote, None where it wrote none (a usage error, no
    test ran): never an older run's. With a baseline, a regression fails the run unless
    ``fail_on_regression`` is False (the baseline is then a comparison only: a compiled run
    against the eager one)."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-n",
        workers,
        *map(str, suites),
        "--tier",
        tier,
        "--report-dir",
        str(report_dir),
        "-p",
        "no:cacheprovider",
        "-q",
    ]
    if device:
        cmd += ["--device", device]
    if dtypes:
        cmd += ["--dtype", dtypes]
    if history:
        cmd += ["--history", str(history)]
    if baseline:
        cmd += ["--drift-baseline", str(baseline)]
        cmd += ["--fail-on-regression"] if fail_on_regression else []
    for folder in golden:
        cmd += ["--golden", str(folder)]
    cmd += list(extra)
    latest = report_dir / "latest"
    before = latest.resolve() if latest.exists() else None
    print(f"numalign: running pytest on {len(suites)} suite path(s) into {report_dir}", flush=True)
    status = subprocess.call(cmd)
    after = latest.resolve() if latest.exists() else None
    produced = after is not None and after != before and (after / "records.jsonl").is_file()
    return status, (after if produced else None)


def nightly(
    models: Path,
    sets: Path,
    suites: Sequence[Path],
    report_dir: Path,
    *,
    tier: str = "nightly",
    device: str | None = None,
    dtypes: str | None = None,
    extra: Sequence[str] = (),
    compile_backend: str | None = None,
) -> int:
    """The nightly flow; returns the exit status (non-zero on a failure or a regression).
    With ``compile_backend`` (None: none), layer and model replay run compiled afterwards
    (``run_compiled``)."""
    latest = report_dir / "latest"
    baseline = latest.resolve() if latest.exists() else None
    print(f"numalign nightly: [1/{2 + bool(compile_backend)}] golden sets of {models}", flush=True)
    refresh = refresh_sets(models, sets)
    print(
        f"numalign nightly: recaptured {', '.join(refresh.recaptured) or 'nothing'}; "
        f"fresh: {', '.join(refresh.fresh) or 'none'}"
    )
    for kept in refresh.archived:
        print(f"numalign nightly: previous version kept in {kept}")
    print(f"numalign nightly: [2/{2 + bool(compile_backend)}] the suites", flush=True)
    status, run_dir = run_suites(
        suites,
        report_dir,
        tier=tier,
        device=device,
        dtypes=dtypes,
        baseline=baseline,
        history=report_dir / "history.jsonl",
        golden=[sets],
        extra=extra,
    )
    if run_dir is not None:
        print(
            f"numalign nightly: report {run_dir / 'drift.html'}"
            + (f" (baseline {baseline})" if baseline else " (first run: no baseline)")
        )
        for line in ratchet_lines(run_dir):
            print(f"numalign nightly: {line}")
    if compile_backend:
        print(f"numalign nightly: [3/3] the suites compiled ({compile_backend})", flush=True)
        compiled_status = run_compiled(
            suites, report_dir / COMPILED_DIR, compile_backend, eager_run=run_dir, tier=tier,
            device=device, dtypes=dtypes, golden=[sets], extra=extra,
        )  # fmt: skip
        status = status or compiled_status
    return status


def ratchet_lines(run_dir: Path, shown: int = RATCHET_SHOWN) -> list[str]:
    """The ratchet of a run against its baseline, from its regressions.json
    (``report.ratchet.ratchet_lines``); none where the run had no baseline."""
    from numalign.report.ratchet import ratchet_lines as lines_of

    path = run_dir / "regressions.json"
    if not path.is_file():
        return []
    return lines_of(finite_json.decode(json.loads(path.read_text(encoding="utf-8"))), shown)


def run_compiled(
    suites: Sequence[Path],
    report_dir: Path,
    backend: str,
    *,
    eager_run: Path | None,
    tier: str,
    device: str | None = None,
    dtypes: str | None = None,
    golden: Sequence[Path] = (),
    extra: Sequence[str] = (),
) -> int:
    """Layer, full-model and decode replay through ``torch.compile`` with ``backend``, into
    ``report_dir``, against ``eager_run`` as the baseline (compiled against eager side by
    side in drift.html; growth is not a regression). Returns the exit status (0 when there
    are no model suites to run)."""
    files = [f for s in suites for name in COMPILED_SUITE_FILES for f in sorted(s.rglob(name))]
    if not files:
        return 0
    status, run_dir = run_suites(
        files, report_dir, tier=tier, device=device, dtypes=dtypes, baseline=eager_run,
        history=report_dir / "history.jsonl", golden=golden,
        extra=[*extra, "--compile", backend], fail_on_regression=False,
    )  # fmt: skip
    if run_dir is not None:
        print(f"numalign nightly: compiled ({backend}) report {run_dir / 'drift.html'}")
    return status


def operator_tests(suites_root: Path, operators: Sequence[str]) -> list[str]:
    """The node ids of the operator suite's tests of ``operators`` (exact names: never a
    substring: ``-k test_attention`` would also select ``test_attention_sinks``)."""
    from numalign.ops.registry import OPERATORS, load_catalogue

    load_catalogue()
    module = suites_root / "operators" / "test_operators.py"
    return [f"{module}::test_{op}" for op in operators if op in OPERATORS]


def _fresh_set(target: Path, model_dir: Path) -> bool:
    """Whether ``target`` holds a readable golden set of ``model_dir``'s fingerprint."""
    if not (target / "manifest.json").is_file():
        return False
    try:
        return GoldenSet.open(target).fingerprint_matches(model_dir)
    except GoldenSetError:
        return False


def bring_up(
    model_dir: Path,
    sets: Path,
    suites_root: Path,
    report_dir: Path,
    *,
    device: str | None = None,
    dtypes: str | None = None,
    tier: str = "pr",
    tp: int = 1,
    engine: str = "transformers",
    stream: bool = False,
    serving: str | None = None,
    pp: int = 1,
) -> int:
    """Inventory, a capture when there is no fresh set, the suites on this model (on ``tp``
    tensor-parallel ranks, or ``pp`` pipeline ranks, when above 1; through ``engine``'s model
    code; with its weights streamed unit by unit under ``stream``; a serving engine in the
    arrangements ``serving`` names) and on the operators it uses, and the report paths.

    Nothing is guessed: the model's set is ``sets/<model folder name>``, replayed alone
    (``--golden SET --golden-only``: a zoo set of the same name is not replayed) after its
    fingerprint is checked against the model folder; the operator tests are those of the
    operators the inventory maps this model to that have candidates, by exact test name. The
    report path printed is this run's, and only when the run wrote one."""
    from numalign.golden.model_folder import check_model_dir
    from numalign.ops.inventory import inventory

    model_dir = check_model_dir(model_dir).resolve()
    suites_root = Path(suites_root)
    if not (suites_root / "models").is_dir():
        raise FileNotFoundError(
            f"--suites {suites_root}: no models/ suite in it; give the suites folder of a "
            "numalign checkout (default: suites, run from the repository root)"
        )
    print(f"numalign run: [1/3] inventory of {model_dir}", flush=True)
    inv = inventory(model_dir)
    print(inv.to_markdown(), flush=True)
    target = sets / model_dir.name
    if _fresh_set(target, model_dir):
        print(f"numalign run: [2/3] golden set {target} is fresh (same fingerprint)", flush=True)
    else:
        print(f"numalign run: [2/3] capturing {target}", flush=True)
        # --stream streams the capture too; else the capture chooses by the memory available
        capture_calibrated(model_dir, target, CaptureSpec(stream=True if stream else None))
    golden = GoldenSet.open(target)
    golden.check_fresh(model_dir)
    operators = [row["operator"] for row in inv.rows if row["status"] == "covered by candidates"]
    tests = operator_tests(suites_root, operators)
    print(
        f"numalign run: [3/3] replaying {golden.name} ({golden.model.fingerprint[:12]}) and "
        f"the operators it uses: {', '.join(operators) or 'none with candidates'}",
        flush=True,
    )
    status, run_dir = run_suites(
        [suites_root / "models", *tests],
        report_dir,
        tier=tier,
        device=device,
        dtypes=dtypes,
        golden=[target],
        extra=[
            "--golden-only",
            *(["--tp", str(tp)] if tp > 1 else []),
            *(["--pp", str(pp)] if pp > 1 else []),
            *(["--engine", engine] if engine != "transformers" else []),
            *(["--stream"] if stream else []),
            *(["--serving", serving] if serving else []),
        ],
    )
    if run_dir is not None:
        print(f"numalign run: report {run_dir / 'drift.html'}, records {run_dir / 'records.jsonl'}")
    else:
        print(f"numalign run: pytest exited {status} and wrote no report (see its output above)")
    return status
