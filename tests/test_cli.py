"""The numalign command line."""

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import numalign
from numalign.cli import main

LLAMA = Path(__file__).resolve().parents[1] / "golden" / "models" / "tiny-llama"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "numalign.cli", *args], capture_output=True, text=True
    )


def test_version() -> None:
    out = run("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"numalign {numalign.__version__}"


def test_console_script_is_installed() -> None:
    out = subprocess.run(["numalign", "--version"], capture_output=True, text=True)
    assert out.stdout.strip() == f"numalign {numalign.__version__}"


def test_help_without_a_command(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main([]) == 0
    assert "usage: numalign" in capsys.readouterr().out


def test_unknown_command_is_an_error() -> None:
    out = run("frobnicate")
    assert out.returncode == 2
    assert "invalid choice" in out.stderr


def test_zoo_build_capture_ls_show_verify(tmp_path) -> None:  # type: ignore[no-untyped-def]
    models, sets = tmp_path / "models", tmp_path / "sets"
    out = run("zoo", "build", "tiny-gpt2", "--out", str(models), "--sets", str(sets))
    assert out.returncode == 0, out.stderr
    assert (models / "tiny-gpt2" / "model.safetensors").is_file()
    out = run("capture", str(models / "tiny-gpt2"), "--out", str(sets / "again"), "--calibrate", "")
    assert out.returncode == 0, out.stderr
    listing = run("golden", "ls", str(sets)).stdout
    assert "tiny-gpt2" in listing and "again" in listing and "fresh" in listing
    shown = run("golden", "show", str(sets / "tiny-gpt2")).stdout
    assert "GPT2LMHeadModel" in shown and "transformer.h.0.mlp" in shown
    assert run("golden", "verify", str(sets / "tiny-gpt2")).returncode == 0
    bad = run("golden", "show", str(tmp_path / "nowhere"))
    assert bad.returncode == 1 and "no manifest" in bad.stderr


def test_report_renders_and_merges(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        record = {"test_id": f"t::{name}", "point": "p", "suite": "operators", "dtype": "float32",
                  "verdict": "passed", "budget_used": 0.1, "metrics": {}}  # fmt: skip
        (tmp_path / name / "records.jsonl").write_text(json.dumps(record) + "\n")
    out = run("report", str(tmp_path / "a"), "--baseline", str(tmp_path / "b"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "a" / "drift.html").is_file()
    assert "0 regression(s)" in out.stdout
    merged = run(
        "report", "merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "m")
    )
    assert merged.returncode == 0, merged.stderr
    assert len((tmp_path / "m" / "records.jsonl").read_text().splitlines()) == 2
    missing = run("report", str(tmp_path / "nowhere"))
    assert missing.returncode != 0 and "no records.jsonl" in missing.stderr


def test_inventory_lists_operators_where_used_and_status() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = run("inventory", str(root / "golden" / "models" / "tiny-qwen3-next"))
    assert out.returncode == 0, out.stderr
    assert (
        "| gated_delta_rule | model.layers.0.linear_attn, model.layers.2.linear_attn "
        "| covered by candidates |" in out.stdout
    )
    assert "| (module Qwen3NextRMSNormGated) |" in out.stdout and "missing" in out.stdout
    as_json = run(
        "inventory", str(root / "golden" / "models" / "tiny-qwen2-vl"), "--format", "json"
    )
    import json

    data = json.loads(as_json.stdout)
    ops = {row["operator"]: row for row in data["operators"]}
    assert ops["patch_embed"]["where"] == ["model.visual.patch_embed"]
    assert "(module Conv3d)" not in ops  # inside the mapped patch embedding
    assert data["module_types"]["Qwen2VLVisionBlock"] == [
        "model.visual.blocks.0",
        "model.visual.blocks.1",
    ]


def test_inventory_maps_the_exact_gelu_of_an_encoder_to_gelu_erf_only() -> None:
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = run("inventory", str(root / "golden" / "models" / "tiny-bert"), "--format", "json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    ops = {row["operator"]: row for row in data["operators"]}
    assert "gelu_tanh" not in ops  # BERT's GELU is the exact one (erf)
    assert ops["gelu_erf"]["where"] == [
        "encoder.layer.0.intermediate.intermediate_act_fn",
        "encoder.layer.1.intermediate.intermediate_act_fn",
    ]
    assert data["aten_ops"]["gelu"] == 2 and "gelu(approximate=tanh)" not in data["aten_ops"]


# torch warns when its distributed operators register a second time, which happens when an
# earlier in-process pytester run dropped torch's modules from sys.modules (order-dependent)
@pytest.mark.filterwarnings("ignore:.*previously registered kernel:UserWarning")
@pytest.mark.parametrize(
    ("option", "value"),
    [("--tp", "2"), ("--pp", "2"), ("--engine", "vllm")],
    ids=["tp", "pp", "engine"],
)
def test_run_passes_the_ranks_and_the_engine_to_the_suites(  # type: ignore[no-untyped-def]
    monkeypatch, tmp_path, option, value
) -> None:
    from pathlib import Path

    from numalign.cli import nightly_flow as nightly

    root = Path(__file__).resolve().parents[1]
    asked: dict[str, object] = {}

    def run_suites(suites, report_dir, **kwargs):  # type: ignore[no-untyped-def]
        asked.update(kwargs)
        return 0, None

    monkeypatch.setattr(nightly, "run_suites", run_suites)
    # the zoo's own set is fresh: nothing is captured
    model, sets = root / "golden" / "models" / "tiny-llama", root / "golden" / "sets"
    command = ["run", str(model), option, value, "--sets", str(sets), "--report-dir", str(tmp_path)]
    if option == "--engine" and importlib.util.find_spec("vllm") is None:
        # checked before any work, as the plugin checks it: how to install vLLM
        with pytest.raises(SystemExit, match="vLLM is not installed in this environment"):
            main(command)
        return
    status = main(command)
    assert status == 0
    extra = list(asked["extra"])  # type: ignore[call-overload]
    assert extra[extra.index(option) + 1] == value


@pytest.mark.parametrize(
    ("args", "message"),
    [  # issue 27: accepted (the counts), or a raw traceback (the dtype)
        (["--decode-steps", "-1"], "--decode-steps -1: a number of tokens, 0 or more"),
        (["--continuation", "-3"], "--continuation -3: a number of tokens, 0 or more"),
        (["--image", "no/such.png"], "--image no/such.png: no such file"),
        (
            ["--calibrate", "bfloat17"],
            "--calibrate 'bfloat17': unknown dtype bfloat17; allowed: float32, bfloat16",
        ),
    ],
)
def test_capture_refuses_bad_counts_files_and_dtypes(
    tmp_path: Path, args: list[str], message: str
) -> None:
    out = run("capture", str(LLAMA), "--out", str(tmp_path / "set"), *args)
    assert out.returncode == 1, out.stderr
    assert f"numalign capture: {message}" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "set").exists()


def test_capture_on_a_full_disk_says_so_and_leaves_nothing(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Issue 27, item 11: a disk that fills while capture writes its shards gave a raw
    traceback; now one line says what happened and what to do, and nothing is left behind
    (no set, no temporary folder)."""
    import errno

    from numalign.golden import shards

    def full(self, key, tensor):  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, "No space left on device", str(self.folder))

    monkeypatch.setattr(shards.ShardWriter, "put", full)
    out = tmp_path / "sets" / "tiny-llama"
    with pytest.raises(SystemExit) as exited:
        main(["capture", str(LLAMA), "--out", str(out), "--calibrate", ""])
    message = str(exited.value)
    assert message.startswith("numalign capture: the disk is full (No space left on device")
    assert "free space there, or give another --out" in message
    assert not out.exists() and list((tmp_path / "sets").iterdir()) == []


def test_golden_show_and_verify_take_a_name_as_ls_prints_it() -> None:
    root = Path(__file__).resolve().parents[1]
    listed = subprocess.run([sys.executable, "-m", "numalign.cli", "golden", "ls"], cwd=root,
                            capture_output=True, text=True).stdout  # fmt: skip
    name = listed.split()[0]  # the first set's name, as ls prints it
    for action in ("show", "verify"):
        out = subprocess.run([sys.executable, "-m", "numalign.cli", "golden", action, name],
                             cwd=root, capture_output=True, text=True)  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert f"golden/sets/{name}" in out.stdout


def test_golden_upgrade_rewrites_a_format_3_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json
    import shutil

    root = Path(__file__).resolve().parents[1]
    folder = tmp_path / "tiny-bert"
    shutil.copytree(root / "golden" / "sets" / "tiny-bert", folder)
    manifest = folder / "manifest.json"
    data = json.loads(manifest.read_text())
    kinds = {p["name"]: p.pop("kinds") for p in data["points"]}
    data["format"] = "numalign.golden/3"
    manifest.write_text(json.dumps(data, indent=1))
    assert main(["golden", "upgrade", str(folder)]) == 0
    assert "numalign.golden/3 rewritten as numalign.golden/4" in capsys.readouterr().out
    upgraded = json.loads(manifest.read_text())
    assert {p["name"]: p["kinds"] for p in upgraded["points"]} == kinds
    assert main(["golden", "upgrade", str(folder)]) == 0
    assert "already numalign.golden/4" in capsys.readouterr().out


#: What each command hands on to the suites, added from the option table (options.add_to).
HANDED_ON = {
    "run": {"report_dir", "tier", "device", "dtype", "engine", "tp", "pp", "stream", "serving"},
    "nightly": {"tier", "device", "dtype", "compile"},
}
#: The suites' options a command words its own way: nightly's tier defaults to the last one,
#: its --compile is a compiled run after the eager one, and its --report-dir holds the
#: nightly runs and their history.
OWN_HELP = {("nightly", "--tier"), ("nightly", "--compile"), ("nightly", "--report-dir")}


def test_run_and_nightly_take_the_suites_options_from_the_one_table() -> None:
    from numalign.cli import build_parser
    from numalign.session.options import OPTIONS

    pytest_like = argparse.ArgumentParser()  # each option as the plugin gives it to pytest
    table = {o.flag: (o, pytest_like.add_argument(o.flag, **o.argparse_kwargs())) for o in OPTIONS}
    commands = next(a for a in build_parser()._actions if a.choices and "run" in a.choices)
    for name, names in HANDED_ON.items():
        sub = commands.choices[name]
        assert set(sub.get_default("suite_options")) == names
        for action in sub._actions:
            if not action.option_strings or action.option_strings[0] not in table:
                continue
            option, expected = table[action.option_strings[0]]
            read = (type(action), action.metavar, action.nargs, action.const)
            assert read == (type(expected), expected.metavar, expected.nargs, expected.const)
            if (name, option.flag) not in OWN_HELP:
                assert option.name in names and action.help == option.help, (name, option.flag)


def test_run_checks_what_it_hands_on_before_any_work(tmp_path: Path) -> None:
    sets = tmp_path / "sets"
    with pytest.raises(SystemExit, match="numalign run: --pp is not supported together with --tp"):
        main(["run", str(LLAMA), "--pp", "2", "--tp", "2", "--sets", str(sets)])
    with pytest.raises(SystemExit, match="numalign run: --serving: unknown arrangement bogus"):
        main(["run", str(LLAMA), "--serving", "bogus", "--sets", str(sets)])
    assert not sets.exists()  # nothing captured
