"""The scheduler half's spans: a journey per request, a span per job.

Who owns what / which thread: one :class:`SchedulerTracer` per scheduler process, called
by the connector on vLLM's engine thread only (so it takes no lock). It owns the spans it
holds open across engine steps; they are detached (``start_span``, never made current)
and ended explicitly, at the latest by :meth:`SchedulerTracer.close_all`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import attrs
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from ._spans import (
    EVENT_FAILED,
    PROPAGATOR,
    SPAN_LOAD,
    SPAN_LOOKUP,
    SPAN_REQUEST,
    SPAN_STORE,
    Direction,
    format_traceparent,
    live_tracer,
)


@attrs.define(eq=False)
class _Journey:
    span: Span
    context: Context
    jobs: set[int] = attrs.field(factory=set)
    finished: bool = False
    lookups: int = 0
    tokens_hit: int = 0
    """Of the last lookup: vLLM looks a waiting request up again each step it waits."""
    tokens_loaded: int = 0
    tokens_stored: int = 0
    failed_jobs: int = 0


@attrs.define(eq=False)
class _JobSpan:
    span: Span
    req_id: str
    direction: Direction
    tokens: int


class SchedulerTracer:
    """The scheduler half's spans: one journey per request, one span per job.

    Every method is safe to call whatever the state (a request never seen, a job already
    ended): an unknown id is ignored or starts the journey it implies, never raises. No
    span is left open by :meth:`close_all`, which the connector calls at shutdown.
    """

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self._tracer = live_tracer(tracer_provider)
        self._journeys: dict[str, _Journey] = {}
        self._jobs: dict[int, _JobSpan] = {}

    @property
    def enabled(self) -> bool:
        """Whether spans are recorded; callers may skip computing costly arguments."""
        return self._tracer is not None

    def open_spans(self) -> int:
        """Spans started and not yet ended (journeys and jobs)."""
        return len(self._journeys) + len(self._jobs)

    # -- request journey -----------------------------------------------------------------

    def request_started(
        self, req_id: str, *, trace_headers: Mapping[str, str] | None = None
    ) -> None:
        """Start the journey of ``req_id`` if it has none (idempotent).

        ``trace_headers`` are the request's incoming W3C headers (vLLM's
        ``Request.trace_headers``): when they carry a ``traceparent``, the journey joins
        that trace instead of starting its own.
        """
        if self._tracer is None or req_id in self._journeys:
            return
        self._journey(req_id, trace_headers)

    def _journey(self, req_id: str, trace_headers: Mapping[str, str] | None = None) -> _Journey:
        assert self._tracer is not None
        j = self._journeys.get(req_id)
        if j is not None:
            return j
        # An explicit empty Context makes this a root span whatever context is current.
        parent = PROPAGATOR.extract(trace_headers) if trace_headers else Context()
        span = self._tracer.start_span(
            SPAN_REQUEST, context=parent, attributes={"kvferry.request_id": req_id}
        )
        j = self._journeys[req_id] = _Journey(span=span, context=trace.set_span_in_context(span))
        return j

    def request_finished(self, req_id: str) -> None:
        """vLLM finished the request: its journey ends now, or when its last job ends."""
        if self._tracer is None:
            return
        j = self._journeys.get(req_id)
        if j is None:
            return
        j.finished = True
        if not j.jobs:
            self._end_journey(req_id, j)

    def _end_journey(self, req_id: str, j: _Journey, end_ns: int | None = None) -> None:
        del self._journeys[req_id]
        if j.span.is_recording():
            j.span.set_attributes(
                {
                    "kvferry.lookups": j.lookups,
                    "kvferry.tokens_hit": j.tokens_hit,
                    "kvferry.tokens_loaded": j.tokens_loaded,
                    "kvferry.tokens_stored": j.tokens_stored,
                    "kvferry.failed_jobs": j.failed_jobs,
                }
            )
        j.span.end(end_time=end_ns)

    # -- lookup --------------------------------------------------------------------------

    def lookup(
        self,
        req_id: str,
        *,
        tokens_asked: int,
        tokens_hit: int,
        tokens_local: int = 0,
        start_ns: int | None = None,
    ) -> None:
        """Record one lookup, which ran from ``start_ns`` (``time.time_ns()``) until now.

        ``tokens_asked`` are the tokens beyond the engine's own ``tokens_local`` that
        kvferry was asked for, ``tokens_hit`` those it will load.
        """
        if self._tracer is None:
            return
        end_ns = time.time_ns()
        j = self._journey(req_id)
        j.lookups += 1
        j.tokens_hit = tokens_hit
        span = self._tracer.start_span(
            SPAN_LOOKUP,
            context=j.context,
            start_time=end_ns if start_ns is None else start_ns,
            attributes={
                "kvferry.request_id": req_id,
                "kvferry.tokens_asked": tokens_asked,
                "kvferry.tokens_hit": tokens_hit,
                "kvferry.tokens_local": tokens_local,
            },
        )
        span.end(end_time=end_ns)

    # -- jobs ----------------------------------------------------------------------------

    def job_planned(
        self, req_id: str, job_id: int, *, direction: Direction, blocks: int, tokens: int
    ) -> str | None:
        """Start the span of a load or store job; returns the ``traceparent`` to carry.

        Put the result in the job's metadata (``JobSpec.traceparent``); None when tracing
        is off or the trace is not sampled.
        """
        if self._tracer is None:
            return None
        j = self._journey(req_id)
        span = self._tracer.start_span(
            SPAN_LOAD if direction == "load" else SPAN_STORE,
            context=j.context,
            attributes={
                "kvferry.request_id": req_id,
                "kvferry.job_id": job_id,
                "kvferry.direction": direction,
                "kvferry.blocks": blocks,
                "kvferry.tokens": tokens,
            },
        )
        old = self._jobs.get(job_id)
        if old is not None:  # a reused id would otherwise leak the first span
            self.job_ended(job_id, ok=False, error="job id reused")
        self._jobs[job_id] = _JobSpan(span=span, req_id=req_id, direction=direction, tokens=tokens)
        j.jobs.add(job_id)
        return format_traceparent(span)

    def job_ended(
        self, job_id: int, *, ok: bool, error: str | None = None, workers_failed: int = 0
    ) -> None:
        """Every worker acknowledged ``job_id``: end its span (error status when not ok).

        Ends the request's journey too if the request finished and this was its last job.
        """
        if self._tracer is None:
            return
        job = self._jobs.pop(job_id, None)
        if job is None:
            return
        span = job.span
        # Success leaves the status UNSET, as OpenTelemetry asks of instrumentation.
        if not ok:
            reason = error or f"failed on {workers_failed} worker(s)"
            span.add_event(
                EVENT_FAILED,
                {"kvferry.reason": reason, "kvferry.workers_failed": workers_failed},
            )
            span.set_attribute("error.type", "kvferry.TransferError")
            span.set_status(Status(StatusCode.ERROR, reason))
        span.end()
        j = self._journeys.get(job.req_id)
        if j is None:
            return
        j.jobs.discard(job_id)
        if not ok:
            j.failed_jobs += 1
        elif job.direction == "load":
            j.tokens_loaded += job.tokens
        else:
            j.tokens_stored += job.tokens
        if j.finished and not j.jobs:
            self._end_journey(job.req_id, j)

    # -- events --------------------------------------------------------------------------

    def failed(self, *, reason: str, req_id: str | None = None, job_id: int | None = None) -> None:
        """Something failed outside a job's end (a vanished key, a rejected store)."""
        self.add_event(
            EVENT_FAILED, req_id=req_id, job_id=job_id, attributes={"kvferry.reason": reason}
        )

    def add_event(
        self,
        name: str,
        *,
        req_id: str | None = None,
        job_id: int | None = None,
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> None:
        """An event on job ``job_id``'s span if open, else on ``req_id``'s journey if open.

        Dropped when neither is open: an event needs a span to belong to.
        """
        if self._tracer is None:
            return
        job = self._jobs.get(job_id) if job_id is not None else None
        if job is not None:
            job.span.add_event(name, attributes)
            return
        j = self._journeys.get(req_id) if req_id is not None else None
        if j is not None:
            j.span.add_event(name, attributes)

    # -- shutdown ------------------------------------------------------------------------

    def close_all(self, reason: str = "shutdown") -> None:
        """End every open span (jobs first, then journeys), marking them unfinished."""
        if self._tracer is None:
            return
        for job_id in list(self._jobs):
            job = self._jobs.pop(job_id)
            job.span.set_attribute("kvferry.unfinished", reason)
            job.span.end()
        for req_id in list(self._journeys):
            j = self._journeys[req_id]
            j.jobs.clear()
            j.span.set_attribute("kvferry.unfinished", reason)
            self._end_journey(req_id, j)
