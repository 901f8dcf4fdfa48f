"""Run reports: the controller's record collector, tables, baseline diff, history, HTML."""

from numalign.report.baseline import BaselineDiff, diff_runs
from numalign.report.collector import DriftCollector
from numalign.report.html import render_html
from numalign.report.run import merge_runs, render_run
from numalign.report.tables import records_frame, summarize, write_tables
from numalign.session.option_values import DEFAULT_REGRESSION_FACTOR

__all__ = [
    "DEFAULT_REGRESSION_FACTOR",
    "BaselineDiff",
    "DriftCollector",
    "diff_runs",
    "merge_runs",
    "records_frame",
    "render_html",
    "render_run",
    "summarize",
    "write_tables",
]
