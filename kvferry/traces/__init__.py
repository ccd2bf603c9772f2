"""OpenTelemetry traces of kvferry: every request's KV journey, across processes.

The connector calls :class:`SchedulerTracer` (scheduler process) and
:class:`WorkerTracer` (each worker), whose job spans and copy spans are joined through a
W3C ``traceparent`` carried in the job metadata. They use only the OpenTelemetry API and
cost nearly nothing when tracing is off. :func:`setup` builds an SDK provider exporting
over OTLP (Jaeger) and/or to a Jaeger JSON file; ``python -m kvferry.traces summarize``
reads such files. See docs/tracing.md.
"""

from __future__ import annotations

from ._config import KEYS as KEYS
from ._config import TracesConfig as TracesConfig
from ._config import resolve_config as resolve_config
from ._jaeger import check_document as check_document
from ._jaeger import merge_documents as merge_documents
from ._journey import SchedulerTracer as SchedulerTracer
from ._setup import setup as setup
from ._spans import EVENT_FAILED as EVENT_FAILED
from ._spans import SPAN_COPY as SPAN_COPY
from ._spans import SPAN_LOAD as SPAN_LOAD
from ._spans import SPAN_LOOKUP as SPAN_LOOKUP
from ._spans import SPAN_REQUEST as SPAN_REQUEST
from ._spans import SPAN_STORE as SPAN_STORE
from ._spans import WorkerTracer as WorkerTracer
from ._spans import format_traceparent as format_traceparent
from ._spans import get_tracer as get_tracer
from ._spans import parse_traceparent as parse_traceparent
from ._summary import summarize as summarize

__all__ = [
    "EVENT_FAILED",
    "KEYS",
    "SPAN_COPY",
    "SPAN_LOAD",
    "SPAN_LOOKUP",
    "SPAN_REQUEST",
    "SPAN_STORE",
    "SchedulerTracer",
    "TracesConfig",
    "WorkerTracer",
    "check_document",
    "format_traceparent",
    "get_tracer",
    "merge_documents",
    "parse_traceparent",
    "resolve_config",
    "setup",
    "summarize",
]
