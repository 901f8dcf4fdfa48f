"""A green run always tested something: a session whose numalign suite
tests all skipped exits non-zero and says so; sessions without suite tests are untouched."""

from __future__ import annotations

import pytest

SUITE_TESTS = """
import pytest

@pytest.mark.model
def test_replay_a():
    pytest.skip("experts implementation 'x' is not offered")

@pytest.mark.layer
def test_replay_b():
    pytest.skip("experts implementation 'x' is not offered")
"""


def test_all_suite_tests_skipped_is_a_failure_that_says_so(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(SUITE_TESTS)
    result = pytester.runpytest("--report-dir", str(pytester.path / "reports"))
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    result.stdout.fnmatch_lines([
        "*numalign: 2 test(s) of numalign's suites selected, none ran (all skipped: "
        "experts implementation 'x' is not offered); nothing was tested*"
    ])  # fmt: skip


def test_one_suite_test_that_ran_keeps_the_session_green(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        SUITE_TESTS + "\n@pytest.mark.operator\ndef test_ran():\n    pass\n"
        "\n@pytest.mark.operator\n@pytest.mark.xfail(reason='known')\ndef test_xf():\n"
        "    assert False\n"
    )
    result = pytester.runpytest("--report-dir", str(pytester.path / "reports"))
    assert result.ret == pytest.ExitCode.OK
    assert "none ran" not in result.stdout.str()


def test_skips_outside_the_suites_are_not_numalign_s_business(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("import pytest\ndef test_x():\n    pytest.skip('not here')\n")
    result = pytester.runpytest("--report-dir", str(pytester.path / "reports"))
    assert result.ret == pytest.ExitCode.OK


def test_under_xdist_the_controller_sees_the_workers_skips(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(SUITE_TESTS)
    result = pytester.runpytest_subprocess(
        "-n", "2", "-p", "no:cacheprovider", "--report-dir", str(pytester.path / "reports")
    )
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    result.stdout.fnmatch_lines(["*none ran (all skipped*"])
