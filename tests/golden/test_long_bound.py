"""A ``--long`` the model's positions or this machine's memory cannot take is refused before
the model loads, saying by how much and which length fits (``golden.long_bound``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

# loaded at collection: a pytester run inline in the same worker restores sys.modules after
# it, and torch's operator libraries imported again after that warn (an error here)
import torch.distributed.tensor  # noqa: F401
import transformers.models.llama.configuration_llama  # noqa: F401

import numalign.golden.capture as capture
from numalign.cli import main
from numalign.golden.long_bound import LongRequestError, check_long, long_request_bytes

ROOT = Path(__file__).resolve().parents[2]
# Llama-like sizes: 4 layers of hidden 64, 4 heads, 256 positions, a 256-token vocabulary
CONFIG = SimpleNamespace(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=256, max_position_embeddings=256,
)  # fmt: skip


def test_a_length_past_the_positions_is_refused_with_the_length_that_fits() -> None:
    with pytest.raises(LongRequestError) as caught:
        check_long(CONFIG, 250, generated=8, dtype_bytes=4, eager=True, available=None)
    message = str(caught.value)
    # 250 + 8 generated tokens reach 258 > 256: the longest that fits is 256 - 8
    assert "position 258" in message and "--long 248" in message
    check_long(CONFIG, 248, generated=8, dtype_bytes=4, eager=True, available=None)


def test_a_length_past_the_memory_is_refused_with_the_longest_that_fits() -> None:
    # positions are no bound here; eager attention's scores grow with the square of the length
    config = SimpleNamespace(**{**vars(CONFIG), "max_position_embeddings": 1 << 20})
    available = sum(long_request_bytes(config, 4096, 4, eager=True).values())
    check_long(config, 4096, generated=8, dtype_bytes=4, eager=True, available=available)
    with pytest.raises(LongRequestError) as caught:
        check_long(config, 8192, generated=8, dtype_bytes=4, eager=True, available=available)
    message = str(caught.value)
    assert "--long 4096 or less" in message  # the bisection lands on the length that fitted
    assert "attention scores" in message and "sdpa" in message
    # sdpa holds no score matrix: the same length needs less than eager's bound
    sdpa = sum(long_request_bytes(config, 8192, 4, eager=False).values())
    assert sdpa < sum(long_request_bytes(config, 8192, 4, eager=True).values())


def test_the_default_length_is_never_refused_for_its_positions() -> None:
    # the default (None) keeps within the positions by construction (long_length)
    check_long(CONFIG, None, generated=8, dtype_bytes=4, eager=True, available=None)


def test_capture_refuses_a_long_request_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def load_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the --long check")

    monkeypatch.setattr(capture, "load_reference", load_model)
    code = main(["capture", str(ROOT / "golden" / "models" / "tiny-llama"),
                 "--out", str(tmp_path / "set"), "--long", "100000"])  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err
    assert "past the model's 256 positions" in err and "--long" in err
    assert not (tmp_path / "set").exists()  # nothing written
