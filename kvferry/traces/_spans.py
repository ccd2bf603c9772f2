"""The spans of a request's KV journey, as the connector's two halves see it.

Who owns what / which thread: a ``SchedulerTracer`` (``_journey.py``) lives in the
scheduler process and a :class:`WorkerTracer` in each worker process; vLLM calls the
connector on its engine thread only, so neither is locked and both must be called from
that one thread. Spans held open are detached (``start_span``, never made current): a job
runs across several engine steps, and no context manager can span them.

Scheduler side, per request (span names are ``"{verb} {object}"`` and low-cardinality,
ids go in ``kvferry.*`` attributes)::

    kvferry                      root: first seen → finished and every job ended
    ├── lookup kv_blocks         tokens asked / hit, one per lookup
    ├── load kv_blocks           one per load job: planned → acknowledged by all workers
    │   └── copy kv_blocks       (worker process) the copy itself, bytes, GB/s
    └── store kv_blocks          one per store job, likewise

A job span hands out a W3C ``traceparent`` for the job metadata; the worker's copy span
becomes its child through it, so both processes' spans land in one trace.

When tracing is off (no provider, a no-op provider, ``OTEL_SDK_DISABLED``) every method
returns at its first line: no span object, no dict entry, no timestamp.
"""

from __future__ import annotations

from typing import Final, Literal

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from .. import __version__

SPAN_REQUEST: Final = "kvferry"
"""Root span of one request's KV journey."""
SPAN_LOOKUP: Final = "lookup kv_blocks"
SPAN_LOAD: Final = "load kv_blocks"
SPAN_STORE: Final = "store kv_blocks"
SPAN_COPY: Final = "copy kv_blocks"
"""Worker side: the copy of one job, on one worker."""
EVENT_FAILED: Final = "failed"

Direction = Literal["load", "store"]

PROPAGATOR = TraceContextTextMapPropagator()


def get_tracer(tracer_provider: trace.TracerProvider | None = None) -> trace.Tracer:
    """kvferry's tracer from ``tracer_provider``, or from the global provider when None."""
    return trace.get_tracer("kvferry", __version__, tracer_provider=tracer_provider)


def live_tracer(tracer_provider: trace.TracerProvider | None) -> trace.Tracer | None:
    """A tracer that records, or None when tracing is off.

    Decided once, at construction: a global provider installed later is not picked up
    (the connector is built at engine start, after any tracing setup).
    """
    provider = trace.get_tracer_provider() if tracer_provider is None else tracer_provider
    if isinstance(provider, trace.NoOpTracerProvider | trace.ProxyTracerProvider):
        return None
    tracer = get_tracer(provider)
    # The SDK's provider hands out a no-op tracer under OTEL_SDK_DISABLED=true.
    if isinstance(tracer, trace.NoOpTracer | trace.ProxyTracer):
        return None
    return tracer


def format_traceparent(span: Span) -> str | None:
    """The W3C ``traceparent`` of ``span``; None when it is not sampled.

    An unsampled span gives None rather than a ``-00`` header: the worker then creates
    nothing, which is what the sampler decided.
    """
    ctx = span.get_span_context()
    if not ctx.is_valid or not ctx.trace_flags.sampled:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def parse_traceparent(traceparent: str) -> Context | None:
    """The remote parent context of a ``traceparent``; None if it is malformed."""
    ctx = PROPAGATOR.extract({"traceparent": traceparent})
    if not trace.get_current_span(ctx).get_span_context().is_valid:
        return None
    return ctx


class WorkerTracer:
    """The worker half's spans: one copy span per job and worker, after the fact.

    The copy ran on a copy thread or a CUDA stream; its times are known only when the
    engine thread observes its completion, so the span is created then with explicit
    start and end times, and is never left open.
    """

    def __init__(
        self, tracer_provider: trace.TracerProvider | None = None, *, rank: int | None = None
    ) -> None:
        self._tracer = live_tracer(tracer_provider)
        self._rank = rank

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def record_copy(
        self,
        traceparent: str | None,
        *,
        job_id: int,
        direction: Direction,
        nbytes: int,
        blocks: int,
        start_ns: int,
        end_ns: int,
        ok: bool = True,
        error: str | None = None,
        queued_ns: int | None = None,
    ) -> None:
        """Record the copy of job ``job_id`` as a child of its scheduler job span.

        ``start_ns`` / ``end_ns`` are wall-clock (``time.time_ns()``) times of the copy
        itself; ``queued_ns``, when known, when the job was submitted (the wait behind
        other copies is ``start_ns - queued_ns``). Nothing is recorded without a
        ``traceparent`` (tracing off, or not sampled, in the scheduler).
        """
        if self._tracer is None or traceparent is None:
            return
        parent = parse_traceparent(traceparent)
        if parent is None:
            return
        seconds = max(end_ns - start_ns, 0) / 1e9
        attributes: dict[str, AttributeValue] = {
            "kvferry.job_id": job_id,
            "kvferry.direction": direction,
            "kvferry.bytes": nbytes,
            "kvferry.blocks": blocks,
            "kvferry.gb_per_s": nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        }
        if self._rank is not None:
            attributes["kvferry.rank"] = self._rank
        if queued_ns is not None:
            attributes["kvferry.queue_wait_s"] = max(start_ns - queued_ns, 0) / 1e9
        span = self._tracer.start_span(
            SPAN_COPY,
            context=parent,
            start_time=start_ns,
            attributes=attributes,
        )
        if not ok:
            reason = error or "copy failed"
            span.add_event(EVENT_FAILED, {"kvferry.reason": reason}, timestamp=end_ns)
            span.set_attribute("error.type", "kvferry.TransferError")
            span.set_status(Status(StatusCode.ERROR, reason))
        span.end(end_time=end_ns)
