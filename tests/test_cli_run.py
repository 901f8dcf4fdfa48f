"""``numalign run`` never guesses, and every command's options are exact and explained: the
set of its own model alone, operator tests by exact name, its own report only, help and a
default for every option, no abbreviations, path and config errors before any work."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from numalign.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def _actions(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.Action]]:
    """Every action of every parser (the command's path, the action)."""
    out: list[tuple[str, argparse.Action]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += [(f"{name} {a.dest}", a) for a in sub._actions]
        else:
            out.append((action.dest, action))
    return out


def test_every_option_has_help_and_says_its_default() -> None:
    parser = build_parser()
    for where, action in _actions(parser):
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        assert action.help, f"{where}: no help text"
    for name, sub in parser._subparsers._group_actions[0].choices.items():  # type: ignore[union-attr]
        formatter = sub._get_formatter()
        for action in sub._actions:
            if action.default in (None, False, [], argparse.SUPPRESS):
                continue  # its help says what happens without it
            shown = formatter._get_help_string(action) or ""  # type: ignore[attr-defined]
            assert "default" in shown, f"numalign {name} {action.dest}: no default in its help"
        assert "(default: .numalign/sets)" in " ".join(sub.format_help().split()) or name != "run"


def test_no_parser_takes_abbreviations() -> None:
    parser = build_parser()
    assert parser.allow_abbrev is False
    for sub in parser._subparsers._group_actions[0].choices.values():  # type: ignore[union-attr]
        assert sub.allow_abbrev is False
    # capture --device once meant --device-map (a CUDA traceback on a CPU machine)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["capture", "model", "--out", "x", "--device", "cuda"])
    assert exc.value.code == 2


@pytest.mark.parametrize("command", ["inventory", "run", "capture"])
def test_a_wrong_model_path_is_an_error_in_numaligns_words(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = ["--out", str(tmp_path / "set")] if command == "capture" else []
    missing = tmp_path / "no-such-model"
    with pytest.raises(SystemExit) as exc:
        main([command, str(missing), *extra])
    text = str(exc.value.code)
    assert f"numalign {command}: model folder {missing}: no such folder" in text
    assert "huggingface-cli download" in text and "Repo id" not in text
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit) as exc:
        main([command, str(empty), *extra])
    assert f"model folder {empty}: no config.json in it" in str(exc.value.code)
    (empty / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(SystemExit) as exc:
        main([command, str(empty), *extra])
    assert "config.json: no model_type key" in str(exc.value.code)
    assert not (tmp_path / "set").exists()  # nothing started


def test_capture_checks_its_dtypes_before_any_work(tmp_path: Path) -> None:
    model = ROOT / "golden" / "models" / "tiny-llama"
    with pytest.raises(SystemExit) as exc:
        main(["capture", str(model), "--out", str(tmp_path / "s"), "--calibrate", "bf16"])
    assert "numalign capture: --calibrate 'bf16': unknown dtype bf16; allowed:" in str(
        exc.value.code
    )
    assert not (tmp_path / "s").exists()


def test_run_checks_dtype_and_device_before_any_work(tmp_path: Path) -> None:
    model = ROOT / "golden" / "models" / "tiny-llama"
    with pytest.raises(SystemExit) as exc:
        main(["run", str(model), "--dtype", "bf16", "--sets", str(tmp_path)])
    assert "numalign run: --dtype 'bf16': unknown dtype bf16" in str(exc.value.code)
    with pytest.raises(SystemExit) as exc:
        main(["run", str(model), "--device", "gpu", "--sets", str(tmp_path)])
    assert "numalign run: unknown device 'gpu'" in str(exc.value.code)
    with pytest.raises(SystemExit) as exc:
        main(["run", str(model), "--serving", "prefix", "--sets", str(tmp_path)])
    assert "numalign run: --serving: unknown arrangement prefix" in str(exc.value.code)
    with pytest.raises(SystemExit) as exc:  # arrangements are a serving engine's
        main(["run", str(model), "--serving", "alone", "--sets", str(tmp_path)])
    assert "replay with --engine vllm" in str(exc.value.code)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def bert(tmp_path: Path) -> tuple[Path, Path]:
    """A model folder named ``bert`` (a substring of the zoo's tiny-bert) with its own set,
    the zoo's tiny-bert copied under the other name (same files: same fingerprint)."""
    model, sets = tmp_path / "models" / "bert", tmp_path / "sets"
    shutil.copytree(ROOT / "golden" / "models" / "tiny-bert", model)
    shutil.copytree(ROOT / "golden" / "sets" / "tiny-bert", sets / "bert")
    return model, sets


def test_run_replays_its_own_set_alone_and_its_operators_by_exact_name(
    bert: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from numalign.cli import nightly_flow as nightly

    model, sets = bert
    asked: dict[str, object] = {}

    def run_suites(suites, report_dir, **kwargs):  # type: ignore[no-untyped-def]
        asked.update(kwargs, suites=[str(s) for s in suites])
        return 0, None

    monkeypatch.setattr(nightly, "run_suites", run_suites)
    status = main(["run", str(model), "--sets", str(sets), "--report-dir", str(tmp_path / "r")])
    assert status == 0
    assert asked["golden"] == [sets / "bert"]
    extra = list(asked["extra"])  # type: ignore[call-overload]
    assert "--golden-only" in extra and "-k" not in extra  # never a substring selection
    suites = list(asked["suites"])  # type: ignore[call-overload]
    assert suites[0] == "suites/models"
    operators = [s.rpartition("::")[2] for s in suites[1:]]
    assert all(s.startswith("suites/operators/test_operators.py::test_") for s in suites[1:])
    assert "test_gelu_erf" in operators  # BERT's exact GELU, from its inventory
    assert "test_attention_sinks" not in operators and "test_linear_attention" not in operators
    assert "--stream" not in extra
    status = main(["run", str(model), "--sets", str(sets), "--report-dir", str(tmp_path / "r"),
                   "--stream"])  # fmt: skip
    assert status == 0 and "--stream" in list(asked["extra"])  # type: ignore[call-overload]


def test_golden_only_collects_the_given_set_alone(bert: tuple[Path, Path]) -> None:
    _, sets = bert
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "suites/models/test_model.py", "--collect-only", "-q",
         "-p", "no:cacheprovider", "--golden", str(sets / "bert"), "--golden-only",
         "--dtype", "float32"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    ids = [line for line in done.stdout.splitlines() if "::test_model[" in line]
    assert ids == ["suites/models/test_model.py::test_model[bert-float32]"], done.stdout


def test_two_sets_of_one_name_are_an_error_naming_both(bert: tuple[Path, Path]) -> None:
    from numalign.golden import GoldenSetError
    from numalign.replay.sets import suite_sets

    _, sets = bert
    clash = sets / "other" / "tiny-bert"
    shutil.copytree(sets / "bert", clash)
    with pytest.raises(GoldenSetError) as exc:
        suite_sets(ROOT, [clash])
    text = str(exc.value)
    assert "golden sets share a name (tiny-bert: " in text
    assert str(ROOT / "golden" / "sets" / "tiny-bert") in text and str(clash) in text
    assert suite_sets(ROOT, [clash], only=True) == [clash]  # alone, no clash


def test_a_run_that_wrote_no_report_names_none(tmp_path: Path) -> None:
    from numalign.cli.nightly_flow import run_suites

    reports = tmp_path / "reports"
    old = reports / "20200101-000000-1"
    old.mkdir(parents=True)
    (old / "records.jsonl").write_text("")
    (reports / "latest").symlink_to(old.name)
    status, run_dir = run_suites([ROOT / "suites" / "models"], reports, tier="bogus", workers="0")
    assert status != 0  # a usage error: --tier bogus
    assert run_dir is None  # not the older run's folder


def test_the_nightly_says_what_it_does_with_each_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from numalign.cli.nightly_flow import refresh_sets

    models, sets = tmp_path / "models", tmp_path / "sets"
    for name in ("tiny-llama", "tiny-gpt2"):
        shutil.copytree(ROOT / "golden" / "models" / name, models / name)
        shutil.copytree(ROOT / "golden" / "sets" / name, sets / name)
    refresh = refresh_sets(models, sets)
    assert refresh.fresh == ["tiny-gpt2", "tiny-llama"] and refresh.recaptured == []
    out = capsys.readouterr().out.splitlines()
    assert out == ["numalign nightly: tiny-gpt2 is fresh", "numalign nightly: tiny-llama is fresh"]
