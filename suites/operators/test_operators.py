"""The operator suite: operator x candidate x dtype x case, judged against the same-dtype
control. One test function per operator (``test_rms_norm``), with ids such as
``test_rms_norm[fused-bfloat16-unaligned-33x4097]``.

    pytest -n auto suites/operators --candidates my_kernels --device cuda -k rms_norm

With ``--compile [BACKEND]`` each candidate runs through ``torch.compile`` (compiled once per
worker; the reference and the control stay eager); records name the backend
(``compile_backend``, ``compile_mode``, and in ``swap``) and carry the compile time
(``compile_s``) and graph breaks apart from ``duration_s``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from numalign.core.dtypes import torch_dtype
from numalign.ops.check import OperatorVerdict, candidate_function, check_operator
from numalign.ops.phases import phase
from numalign.ops.registry import OPERATORS, Operator, candidates, load_catalogue
from numalign.records import testids
from numalign.records.drift import NodeRecorder
from numalign.records.outcomes import recorded_errors
from numalign.runtime import threads_per_worker
from numalign.runtime.compiled import GraphBreakWarning
from numalign.runtime.variant import Variant
from numalign.session.settings import Settings

load_catalogue()
# One torch thread per core share from collection on (numalign_device sets it up again with
# the rest of torch's configuration): xdist workers must not each spin up every core.
torch.set_num_threads(threads_per_worker())
# Graph breaks under --compile are reported (a warning with Dynamo's reasons, and the
# records' graph_breaks), not failures, even where warnings are errors: the parts between
# breaks still run compiled, and their numerics are what the test judges.
pytestmark = pytest.mark.filterwarnings(
    f"default::{GraphBreakWarning.__module__}.GraphBreakWarning"
)


def _make_test(op: Operator) -> Callable[..., None]:
    @pytest.mark.operator
    def test(
        op_case: testids.Param,
        numalign_device: torch.device,
        numalign_settings: Settings,
        tolerance_policy: object,
        record_drift: NodeRecorder,
    ) -> None:
        __tracebackhide__ = True
        cand, dtype_name, case = op_case.values
        variant = Variant.for_operators(numalign_settings, device=numalign_device, dtype=dtype_name)
        compiled = variant.compile
        context = {"suite": "operators", "candidate": cand.name, "device": str(numalign_device),
                   "case": case.name, **variant.record_fields()}  # fmt: skip
        reason = cand.skip_reason(numalign_device.type, dtype_name, case)
        if reason:
            record_drift.skipped(reason, point=op.name, dtype=dtype_name, **context)
            pytest.skip(reason)
        start = time.perf_counter()
        # a compiler's failure is recorded with this test's fields and what compiling cost
        # (numalign's exception policy); the session goes on
        with recorded_errors(record_drift, point=op.name, dtype=dtype_name, **context):
            results = check_operator(
                op,
                cand,
                case,
                torch_dtype(dtype_name),
                numalign_device,
                policy=tolerance_policy,  # type: ignore[arg-type]
                compiled=compiled,
            )
        duration = time.perf_counter() - start
        if compiled is not None:  # compile time apart from the run time
            spent = candidate_function(op, cand, compiled).stats.take()  # type: ignore[attr-defined]
            context |= spent.record_fields()
            duration -= spent.compile_s
        verdict = OperatorVerdict(cand, case, tuple(results))
        with phase("records"):
            for record in verdict.records(record_drift.nodeid, duration_s=duration, **context):
                record_drift.add(record)
        if not verdict.passed:
            pytest.fail(verdict.message(), pytrace=False)

    test.__name__ = f"test_{op.name}"
    test.__doc__ = op.description
    return test


for _name, _op in OPERATORS.items():
    globals()[f"test_{_name}"] = _make_test(_op)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "op_case" not in metafunc.fixturenames:
        return
    from numalign.plugin import settings_key

    settings = metafunc.config.stash[settings_key]
    op = OPERATORS[metafunc.function.__name__.removeprefix("test_")]
    params = []
    # Case-major order: the candidates of one case and dtype run one after another (on one
    # worker, mostly), so they share the truth, inputs and control kept per worker.
    for case in op.cases_for(settings.tier):
        for dtype in settings.dtypes:
            for cand in candidates(op.name).values():
                text = testids.format_operator(cand.name, dtype, case.name)
                # the parameter reads as the id (as Allure shows it), its objects behind it
                params.append(pytest.param(testids.Param(text, (cand, dtype, case)), id=text))
    metafunc.parametrize("op_case", params)
