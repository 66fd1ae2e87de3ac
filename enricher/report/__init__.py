"""`kvmiss report`: a self-contained HTML report (and PNG charts) of why requests missed the
prefix cache, from attribution records or enriched OTLP/JSON spans (data), drawn with
matplotlib (charts) into one HTML file (page). `kvmiss demo` writes the same report with
its stream timeline, route-to-BlockStored latency and ground truth as context.
"""

from kvmiss.enricher.report.data import (
    InputError,
    Row,
    SpanFileTail,
    Totals,
    load_context,
    load_records,
    load_spans,
)
from kvmiss.enricher.report.page import write_report

__all__ = ["InputError", "Row", "SpanFileTail", "Totals", "load_context", "load_records",
           "load_spans", "write_report"]
