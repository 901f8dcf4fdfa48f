"""Run reports: the controller's record collector, tables, summaries."""

from numalign.report.collector import DriftCollector
from numalign.report.tables import records_frame, summarize, write_tables

__all__ = ["DriftCollector", "records_frame", "summarize", "write_tables"]
