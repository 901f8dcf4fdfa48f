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

from numalign.cases import Case
from numalign.opcheck import candidate_function, check_operator
from numalign.phases import phase
from numalign.record import NodeRecorder
from numalign.registry import OPERATORS, Candidate, Operator, candidates, load_catalogue
from numalign.runtime import threads_per_worker
from numalign.runtime.compiled import CompileError, GraphBreakWarning
from numalign.runtime.variant import Variant
from numalign.settings import Settings

load_catalogue()
# One torch thread per core share from collection on (numalign_device sets it up again with
# the rest of torch's configuration): xdist workers must not each spin up every core.
torch.set_num_threads(threads_per_worker())
_PARAMS: dict[tuple[str, str], tuple[Candidate, str, Case]] = {}
# Graph breaks under --compile are reported (a warning with Dynamo's reasons, and the
# records' graph_breaks), not failures, even where warnings are errors: the parts between
# breaks still run compiled, and their numerics are what the test judges.
pytestmark = pytest.mark.filterwarnings(
    f"default::{GraphBreakWarning.__module__}.GraphBreakWarning"
)


def _make_test(op: Operator) -> Callable[..., None]:
    @pytest.mark.operator
    def test(
        op_case: str,
        numalign_device: torch.device,
        numalign_settings: Settings,
        tolerance_policy: object,
        record_drift: NodeRecorder,
    ) -> None:
        __tracebackhide__ = True
        cand, dtype_name, case = _PARAMS[(op.name, op_case)]
        variant = Variant.for_operators(numalign_settings, device=numalign_device, dtype=dtype_name)
        compiled = variant.compile
        context = {"suite": "operators", "candidate": cand.name, "device": str(numalign_device),
                   "case": case.name, **variant.record_fields()}  # fmt: skip
        reason = cand.skip_reason(numalign_device.type, dtype_name, case)
        if reason:
            record_drift.skipped(reason, point=op.name, dtype=dtype_name, **context)
            pytest.skip(reason)
        start = time.perf_counter()
        try:
            results = check_operator(
                op,
                cand,
                case,
                getattr(torch, dtype_name),
                numalign_device,
                policy=tolerance_policy,  # type: ignore[arg-type]
                compiled=compiled,
            )
        except CompileError as exc:  # the backend's failure, named; the session goes on
            context |= exc.record_fields()  # what compiling cost this test, not the next
            record_drift.error(exc, point=op.name, dtype=dtype_name, **context)
            if exc.known:  # an upstream compiler bug: expected while it lasts, recorded
                pytest.xfail(f"known compiler bug: {exc.known}\n{exc}")
            pytest.fail(str(exc), pytrace=False)
        duration = time.perf_counter() - start
        if compiled is not None:  # compile time apart from the run time
            spent = candidate_function(op, cand, compiled).stats.take()  # type: ignore[attr-defined]
            context |= spent.record_fields()
            duration -= spent.compile_s
        with phase("records"):
            for result in results:
                record_drift(result, duration_s=duration, **context)
        failed = [r for r in results if not r.passed]
        if failed:
            pytest.fail(
                f"candidate {cand.name!r} ({cand.module}) on case {case.name} [{case.regime}]:\n"
                + "\n\n".join(r.message() for r in failed),
                pytrace=False,
            )

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
    ids = []
    # Case-major order: the candidates of one case and dtype run one after another (on one
    # worker, mostly), so they share the truth, inputs and control kept per worker.
    for case in op.cases_for(settings.tier):
        for dtype in settings.dtypes:
            for cand in candidates(op.name).values():
                param = f"{cand.name}-{dtype}-{case.name}"
                _PARAMS[(op.name, param)] = (cand, dtype, case)
                ids.append(param)
    # The parameter is the readable id (as Allure and --collect-only show it); the objects
    # behind it are looked up in the test.
    metafunc.parametrize("op_case", ids, ids=ids)
