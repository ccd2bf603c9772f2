"""The CUDA path of the copy engine: the only module that touches ``torch.cuda``.

Per direction, one side stream ordered after the compute stream (``wait_stream``), so a
store reads KV only after the compute that wrote it, and a load writes only after earlier
work on its destination blocks. The host pool is pinned, copies are ``non_blocking``, and
each job ends with an event created ``blocking=True`` (so a waiter thread sleeps in
``synchronize`` instead of spinning). Submission runs on the engine thread, whose current
stream is vLLM's compute stream.

Streams and events come from factories so that the logic is unit-tested on a CPU with the
fakes of :mod:`kvferry.testing`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._copy import CopyJob, copy_job
from ._layout import KVLayout
from ._pool import HostPool


class EventCompletion:
    """A :class:`~kvferry.transfer.Completion` over a CUDA event recorded after a job."""

    __slots__ = ("_event",)

    def __init__(self, event: Any) -> None:
        self._event = event

    def query(self) -> bool:
        return bool(self._event.query())

    def synchronize(self) -> None:
        self._event.synchronize()

    def exception(self) -> BaseException | None:
        return None  # CUDA reports copy errors at submission (raised there)


class CudaCopyEngine:
    def __init__(
        self,
        layout: KVLayout,
        pool: HostPool,
        *,
        stream_factory: Callable[[], Any] | None = None,
        event_factory: Callable[[], Any] | None = None,
        current_stream: Callable[[], Any] | None = None,
        use_stream: Callable[[Any], Any] | None = None,
    ) -> None:
        if stream_factory is None:
            import torch.cuda

            device = layout.device
            stream_factory = lambda: torch.cuda.Stream(device=device)  # noqa: E731
            event_factory = lambda: torch.cuda.Event(blocking=True)  # noqa: E731
            current_stream = lambda: torch.cuda.current_stream(device)  # noqa: E731
            use_stream = torch.cuda.stream
        assert event_factory and current_stream and use_stream
        self.layout = layout
        self.pool = pool
        self._event_factory = event_factory
        self._current_stream = current_stream
        self._use_stream = use_stream
        self._streams = {"store": stream_factory(), "load": stream_factory()}

    def job_bytes(self, job: CopyJob) -> int:
        return sum(
            len(p.device_blocks) * self.layout.groups[p.group].row_bytes for p in job.parts
        )

    def submit(self, job: CopyJob) -> EventCompletion:
        stream = self._streams[job.direction]
        stream.wait_stream(self._current_stream())
        with self._use_stream(stream):
            copy_job(self.layout, self.pool, job, non_blocking=True)
            event = self._event_factory()
            event.record(stream)
        return EventCompletion(event)

    def close(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()
