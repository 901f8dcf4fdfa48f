"""The suites' test-id grammar (numalign.records.testids): every kind formats and parses back, and
today's ids stay byte-identical (baselines match records by test id)."""

from __future__ import annotations

import pytest

from numalign.records import testids
from numalign.records.drift import context_from_test_id
from numalign.records.testids import Param, ReplayCase, TestId, parse, parse_replay_group

OPS = "suites/operators/test_operators.py"
LAYERS = "suites/models/test_layers.py"
MODEL = "suites/models/test_model.py"
DECODE = "suites/models/test_decode.py"

#: Ids as `pytest --collect-only -q suites` gave them before the grammar had a module.
REAL_IDS = {
    f"{OPS}::test_kv_quant_attention[exp2-float16-int8-noncontig-1x4x2x31x31x64]": TestId(
        OPS, "test_kv_quant_attention", "operators", "float16", operator="kv_quant_attention",
        candidate="exp2", case="int8-noncontig-1x4x2x31x31x64",
    ),
    f"{LAYERS}::test_layer[tiny-bert/embeddings.word_embeddings-float32]": TestId(
        LAYERS, "test_layer", "models", "float32", model="tiny-bert",
        point="embeddings.word_embeddings",
    ),
    f"{MODEL}::test_model[tiny-llama-bfloat16]": TestId(
        MODEL, "test_model", "models", "bfloat16", model="tiny-llama"
    ),
    f"{DECODE}::test_decode[tiny-bert-float32-paged]": TestId(
        DECODE, "test_decode", "models", "float32", model="tiny-bert", cache="paged"
    ),
}  # fmt: skip


@pytest.mark.parametrize("test_id", list(REAL_IDS))
def test_todays_ids_parse_to_their_parts(test_id: str) -> None:
    assert parse(test_id) == REAL_IDS[test_id]


def test_todays_ids_are_what_the_formats_write() -> None:
    ops, layer, model, decode = (i.partition("[")[2][:-1] for i in REAL_IDS)
    assert testids.format_operator("exp2", "float16", "int8-noncontig-1x4x2x31x31x64") == ops
    assert testids.format_layer("tiny-bert", "embeddings.word_embeddings", "float32") == layer
    assert testids.format_model("tiny-llama", "bfloat16") == model
    assert testids.format_decode("tiny-bert", "float32", "paged") == decode


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_every_kind_round_trips(dtype: str) -> None:
    """Hyphens in candidates, sets, points and cases survive: the split is at the dtype."""
    op = parse(f"{OPS}::test_rms_norm[{testids.format_operator('my-fused', dtype, 'a-1x2')}]")
    assert (op.operator, op.candidate, op.dtype, op.case) == (
        "rms_norm",
        "my-fused",
        dtype,
        "a-1x2",
    )
    layer = parse(f"{LAYERS}::test_layer[{testids.format_layer('tiny-x', 'm.l-1', dtype)}]")
    assert (layer.model, layer.point, layer.dtype, layer.cache) == ("tiny-x", "m.l-1", dtype, None)
    model = parse(f"{MODEL}::test_model[{testids.format_model('tiny-x', dtype)}]")
    assert (model.model, model.point, model.dtype) == ("tiny-x", None, dtype)
    decode = parse(
        f"{DECODE}::test_decode[{testids.format_decode('tiny-x', dtype, 'offloaded_static')}]"
    )
    assert (decode.model, decode.dtype, decode.cache) == ("tiny-x", dtype, "offloaded_static")
    group = testids.format_replay_group("golden/sets/tiny-x", dtype)
    assert parse_replay_group(group) == ("golden/sets/tiny-x", dtype)  # fmt: skip


def test_a_serving_arrangement_is_the_last_part_and_the_default_is_not_written() -> None:
    assert testids.format_model("tiny-x", "float32", "batched") == "tiny-x-float32"
    text = testids.format_model("tiny-x", "float32", "prefix-cached")
    assert text == "tiny-x-float32-prefix-cached"
    model = parse(f"{MODEL}::test_model[{text}]")
    assert (model.model, model.dtype, model.cache, model.serving) == (
        "tiny-x", "float32", None, "prefix-cached"
    )  # fmt: skip
    text = testids.format_decode("tiny-x", "bfloat16", "paged", "chunked-8")
    decode = parse(f"{DECODE}::test_decode[{text}]")
    assert (decode.cache, decode.serving) == ("paged", "chunked-8")


def test_an_unreadable_set_and_a_plain_test_say_what_they_can() -> None:
    unreadable = f"{LAYERS}::test_layer[{testids.format_unreadable_layer('tiny-x')}]"
    assert unreadable.endswith("[tiny-x/(unreadable)]")
    assert parse(unreadable) == TestId(LAYERS, "test_layer", "models")
    assert parse("tests/test_x.py::test_plain") == TestId("tests/test_x.py", "test_plain")
    assert context_from_test_id(unreadable) == {"suite": "models"}


def test_records_of_tests_that_raised_keep_the_record_fields_they_had() -> None:
    decode = context_from_test_id(f"{DECODE}::test_decode[tiny-bert-float32-paged]")
    assert decode == {"suite": "models", "dtype": "float32", "model": "tiny-bert",
                      "candidate": "transformers", "point": None, "mode": "decode"}  # fmt: skip
    op = context_from_test_id(next(iter(REAL_IDS)))
    assert op == {
        "suite": "operators", "dtype": "float16", "candidate": "exp2",
        "case": "int8-noncontig-1x4x2x31x31x64", "point": "kv_quant_attention",
    }  # fmt: skip


def test_a_param_reads_as_its_text_and_carries_its_values() -> None:
    """Allure and --collect-only show the parameter's text as before; tests read values."""
    case = ReplayCase("golden/sets/tiny-x", "float16", point="m.l")
    param = testids.replay_param(case, testids.format_layer("tiny-x", "m.l", "float16"))
    (value,) = param.values
    assert isinstance(value, Param) and isinstance(value, str)
    assert value == "golden/sets/tiny-x::tiny-x/m.l-float16" and value.values is case
    assert repr(value) == repr("golden/sets/tiny-x::tiny-x/m.l-float16")
    assert param.id == "tiny-x/m.l-float16"
    (mark,) = param.marks
    assert (mark.name, mark.args) == ("replay_group", ("golden/sets/tiny-x-float16",))
    assert not testids.replay_param(ReplayCase("golden/sets/tiny-x"), "tiny-x/(unreadable)").marks
