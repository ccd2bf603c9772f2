"""With tracing off, the API the connector calls unconditionally creates no span at all."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk import trace as sdk_trace

from kvferry.traces import SchedulerTracer, WorkerTracer


@pytest.fixture
def no_span_may_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a span was started while tracing is off")

    for cls in (trace.NoOpTracer, trace.ProxyTracer, sdk_trace.Tracer):
        monkeypatch.setattr(cls, "start_span", forbidden)


def drive(sched: SchedulerTracer, worker: WorkerTracer) -> None:
    """Every call the connector makes in a request's life."""
    sched.request_started(
        "r", trace_headers={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    )
    sched.lookup("r", tokens_asked=10, tokens_hit=5, start_ns=1)
    tp = sched.job_planned("r", 1, direction="load", blocks=1, tokens=5)
    assert tp is None
    worker.record_copy(tp, job_id=1, direction="load", nbytes=10, blocks=1, start_ns=1, end_ns=2)
    worker.record_copy(
        "00-" + "1" * 32 + "-" + "2" * 16 + "-01",
        job_id=1,
        direction="load",
        nbytes=10,
        blocks=1,
        start_ns=1,
        end_ns=2,
    )
    sched.failed(reason="x", req_id="r")
    sched.job_ended(1, ok=False, error="x")
    sched.request_finished("r")
    sched.close_all()
    assert sched.open_spans() == 0


@pytest.mark.usefixtures("no_span_may_start")
def test_no_provider_and_no_global_provider_means_off(monkeypatch: pytest.MonkeyPatch) -> None:
    # What the global provider is until an application installs one (whatever other
    # tests of this process did).
    monkeypatch.setattr(trace, "get_tracer_provider", trace.ProxyTracerProvider)
    sched, worker = SchedulerTracer(), WorkerTracer()
    assert not sched.enabled and not worker.enabled
    drive(sched, worker)


@pytest.mark.usefixtures("no_span_may_start")
def test_noop_provider_means_off() -> None:
    sched = SchedulerTracer(trace.NoOpTracerProvider())
    worker = WorkerTracer(trace.NoOpTracerProvider())
    assert not sched.enabled and not worker.enabled
    drive(sched, worker)


@pytest.mark.usefixtures("no_span_may_start")
def test_sdk_disabled_by_environment_means_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    provider = sdk_trace.TracerProvider(shutdown_on_exit=False)
    sched, worker = SchedulerTracer(provider), WorkerTracer(provider)
    assert not sched.enabled and not worker.enabled
    drive(sched, worker)


def test_off_keeps_no_state() -> None:
    sched = SchedulerTracer(trace.NoOpTracerProvider())
    for i in range(1000):
        sched.request_started(f"r{i}")
        sched.job_planned(f"r{i}", i, direction="store", blocks=1, tokens=1)
    assert sched.open_spans() == 0
