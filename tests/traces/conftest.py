from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvferry.traces import SchedulerTracer, WorkerTracer


class Recorder:
    """A tracer provider whose spans are kept in memory, ended spans only."""

    def __init__(self, name: str) -> None:
        from opentelemetry.sdk.resources import Resource

        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": name}), shutdown_on_exit=False
        )
        # Simple: a span is exported when it ends, on the ending thread — deterministic.
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def spans(self, name: str | None = None) -> list:  # type: ignore[type-arg]
        return [s for s in self.exporter.get_finished_spans() if name is None or s.name == name]

    def one(self, name: str):  # type: ignore[no-untyped-def]
        found = self.spans(name)
        assert len(found) == 1, [s.name for s in self.spans()]
        return found[0]


@pytest.fixture
def sched_rec() -> Iterator[Recorder]:
    rec = Recorder("scheduler")
    yield rec
    rec.provider.shutdown()


@pytest.fixture
def worker_rec() -> Iterator[Recorder]:
    rec = Recorder("worker")
    yield rec
    rec.provider.shutdown()


@pytest.fixture
def sched(sched_rec: Recorder) -> SchedulerTracer:
    return SchedulerTracer(sched_rec.provider)


@pytest.fixture
def worker(worker_rec: Recorder) -> WorkerTracer:
    return WorkerTracer(worker_rec.provider, rank=0)
