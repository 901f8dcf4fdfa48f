"""CI and nightly: shards that join into the unsharded run, the nightly flow on the zoo, and
pipeline files that parse."""

from __future__ import annotations

import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from numalign.records.drift import DriftRecord, read_records
from numalign.session.option_values import parse_shard
from numalign.session.settings import in_shard

ROOT = Path(__file__).resolve().parents[2]
OPERATORS = ROOT / "suites" / "operators" / "test_operators.py"


def test_shards_partition_test_ids() -> None:
    ids = [f"suite::test_{i}" for i in range(1000)]
    shards = [[t for t in ids if in_shard(t, (i, 3))] for i in (1, 2, 3)]
    assert sorted(t for shard in shards for t in shard) == sorted(ids)  # each in one shard
    assert all(250 < len(s) < 420 for s in shards)  # a hash split: about a third each
    assert parse_shard("2/3") == (2, 3)
    for bad in ("0/3", "4/3", "x", "1-2"):
        with pytest.raises(ValueError, match="write I/N"):
            parse_shard(bad)


def _suite(report: Path, *args: str) -> list[dict]:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(OPERATORS),
            "--tier",
            "smoke",
            "-k",
            "rms_norm or softmax",
            "--report-dir",
            str(report),
            "-p",
            "no:cacheprovider",
            "-q",
            *args,
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return read_records(report / "latest")


def test_shards_merged_give_the_records_of_the_unsharded_run(tmp_path: Path) -> None:
    whole = _suite(tmp_path / "whole")
    one = _suite(tmp_path / "one", "--shard", "1/2")
    two = _suite(tmp_path / "two", "--shard", "2/2")
    assert one and two
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "numalign.cli",
            "report",
            "merge",
            str((tmp_path / "one" / "latest").resolve()),
            str((tmp_path / "two" / "latest").resolve()),
            "--out",
            str(tmp_path / "merged"),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    merged = read_records(tmp_path / "merged")

    def table(records: list[DriftRecord]) -> dict[str, tuple]:
        return {r.key: (r.verdict, r.metrics["max_abs"], r.metrics["rel_l2"]) for r in records}

    # deterministic inputs: the same comparisons, the same numbers
    assert table(merged) == table(whole)


def test_nightly_recaptures_only_changed_models_and_compares_with_the_last_run(
    tmp_path: Path,
) -> None:
    import json

    from safetensors.torch import load_file, save_file

    models, sets, reports = tmp_path / "models", tmp_path / "sets", tmp_path / "reports"
    for name in ("tiny-llama", "tiny-gpt2"):
        shutil.copytree(ROOT / "golden" / "models" / name, models / f"nightly-{name}")
    # tiny-llama's set is the zoo's (its model unchanged: fresh); tiny-gpt2 has none yet
    shutil.copytree(ROOT / "golden" / "sets" / "tiny-llama", sets / "nightly-tiny-llama")
    manifest_path = sets / "nightly-tiny-llama" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["model"]["path"] = str(models / "nightly-tiny-llama")
    manifest_path.write_text(json.dumps(manifest))
    select = ["-k", "nightly-"]  # only the copies, not the repository's own sets

    def nightly() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable, "-m", "numalign.cli", "nightly", "--models", str(models),
                "--sets", str(sets),
                # the whole-model suite in one dtype: this test's subject is what the nightly
                # recaptures and compares, not the suites (CI's nightly smoke runs them all)
                "--suites", str(ROOT / "suites" / "models" / "test_model.py"),
                "--report-dir", str(reports), "--tier", "smoke", "--dtype", "float32", "--",
                "-n", "0", *select,
            ],
            cwd=ROOT, capture_output=True, text=True,
        )  # fmt: skip

    first = nightly()
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    # a model without a set is captured, one whose set matches its files is not
    assert "recaptured nightly-tiny-gpt2; fresh: nightly-tiny-llama" in first.stdout
    assert "first run: no baseline" in first.stdout
    assert not (sets / ".versions").exists()  # nothing replaced

    weights = models / "nightly-tiny-gpt2" / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["transformer.ln_f.weight"] = tensors["transformer.ln_f.weight"] * 1.25
    save_file(tensors, str(weights), metadata={"format": "pt"})
    second = nightly()
    assert "recaptured nightly-tiny-gpt2; fresh: nightly-tiny-llama" in second.stdout
    assert "(baseline " in second.stdout  # against the first run
    kept = list((sets / ".versions" / "nightly-tiny-gpt2").iterdir())
    assert len(kept) == 1 and (kept[0] / "manifest.json").is_file()  # the previous version
    regressions = (reports / "latest" / "regressions.json").read_text()
    assert "nightly-tiny-gpt2" in regressions  # the report shows what moved: new fingerprints
    html = (reports / "latest" / "drift.html").read_text()
    assert "Regressions against the baseline" in html


def test_workflows_parse_and_run_the_scripts() -> None:
    for name in ("pr.yml", "nightly.yml"):
        workflow = yaml.safe_load((ROOT / "ci" / "github" / name).read_text())
        assert workflow["jobs"], name
        steps = [s for job in workflow["jobs"].values() for s in job["steps"]]
        assert all("uses" in s or "run" in s for s in steps)
    pr = (ROOT / "ci" / "github" / "pr.yml").read_text()
    assert "ci/pr-gate.sh" in pr and "upload-artifact" in pr
    nightly = (ROOT / "ci" / "github" / "nightly.yml").read_text()
    assert "ci/nightly.sh" in nightly and "numalign report merge" in nightly
    for script in ("pr-gate.sh", "nightly.sh", "allure-report.sh"):
        assert subprocess.run(["bash", "-n", str(ROOT / "ci" / script)]).returncode == 0


def test_run_brings_up_a_model_in_one_command(tmp_path: Path) -> None:
    model = tmp_path / "models" / "bringup-gpt2"
    shutil.copytree(ROOT / "golden" / "models" / "tiny-gpt2", model)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "numalign.cli",
            "run",
            str(model),
            "--sets",
            str(tmp_path / "sets"),
            "--suites",
            str(ROOT / "suites"),
            "--report-dir",
            str(tmp_path / "reports"),
            "--tier",
            "smoke",
            "--dtype",
            "float32",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "| layer_norm |" in out.stdout  # the inventory
    assert (
        "capturing" in out.stdout
        and (tmp_path / "sets" / "bringup-gpt2" / "manifest.json").is_file()
    )
    assert "numalign run: report" in out.stdout
    records = read_records(tmp_path / "reports" / "latest")
    assert {r.suite for r in records} == {"models", "operators"}
    assert any(r.model == "bringup-gpt2" for r in records)
    # the capture holds a cached decode, and decode replay ran on it (every cache)
    decode = {r.swap for r in records if r.model == "bringup-gpt2" and r.mode == "decode"}
    assert decode == {"cache=dynamic", "cache=static", "cache=paged"}


def _honest_matrix() -> types.ModuleType:
    import importlib.util

    spec = importlib.util.spec_from_file_location("honest_matrix", ROOT / "ci" / "honest_matrix.py")
    assert spec is not None and spec.loader is not None
    matrix = importlib.util.module_from_spec(spec)
    sys.modules["honest_matrix"] = matrix  # its dataclasses look their module up
    spec.loader.exec_module(matrix)
    return matrix


def test_the_honest_matrix_swaps_reach_every_swept_sample_type_with_the_module() -> None:
    """The matrix replays a sample of the day-0 sweep's types; each swap variant's ``-k``
    filter must keep every sample type that has its module (a filter that dropped one would
    leave that type's norms out of the swap unnoticed) and drop the ones without it."""
    from _pytest.mark.expression import Expression
    from transformers import AutoModelForCausalLM

    from numalign.ops.registry import OPERATORS, load_catalogue
    from numalign.sweep.build import causal_lm_types, tiny_config

    matrix = _honest_matrix()
    load_catalogue()
    assert set(matrix.SWEEP_SAMPLE) <= set(causal_lm_types())
    variants = {v.name: v for v in matrix.VARIANTS}
    for model_type in matrix.SWEEP_SAMPLE:
        model = AutoModelForCausalLM.from_config(tiny_config(model_type))
        for op, name in (("rms_norm", "swap-fused-rms-norm"),
                         ("layer_norm", "swap-var-mean-layer-norm")):  # fmt: skip
            has = any(OPERATORS[op].stands_for_module(m) for m in model.modules())
            expression = variants[name].args[variants[name].args.index("-k") + 1]
            # pytest's own -k grammar; a name matches where it is part of the set's name
            kept = Expression.compile(expression).evaluate(model_type.__contains__)
            assert kept == has, (model_type, name, expression)


def test_the_honest_matrix_runs_in_ci_with_variants_that_are_not_calibration_members() -> None:
    from numalign.replay.ensemble import default_members

    matrix = _honest_matrix()
    assert "ci/honest_matrix.py" in (ROOT / ".ci" / "run").read_text()
    # on every kind of CPU the zoo may be captured on, no variant is a member: passing the
    # matrix is not passing by construction
    for flags in (
        frozenset({"avx2"}),
        frozenset({"avx2", "avx512f", "avx512_bf16"}),
        frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}),
    ):
        members = [m.env for m in default_members("eager", flags=flags, cores=2)]
        for variant in matrix.VARIANTS:
            if variant.env:  # kernels selected otherwise than by every member
                assert variant.env not in members, (variant.name, flags)
