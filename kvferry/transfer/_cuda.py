"""The CUDA path of the copy engine: the only module that touches ``torch.cuda``.

Per direction, one side stream ordered after the compute stream (``wait_stream``), so a
store reads KV only after the compute that wrote it, and a load writes only after
earlier work on its destination blocks. The load stream has the higher priority (a
request waits on it). A job is a few batched ops on its stream (see
:mod:`._torchcopy`): device-side gathers/scatters into a staging buffer, and one
contiguous ``non_blocking`` copy per run of host rows to or from the pinned host pool.
Each job ends with an event created ``blocking=True`` (so a waiter thread sleeps in
``synchronize`` instead of spinning).

Who owns what: ``submit`` runs on the thread that owns the transfer actors, whose
current stream is the engine's compute stream (vLLM calls the connector on the engine
thread). Each direction's staging buffer is used only by that direction's stream, so
stream order keeps a job from overwriting staging the previous job still reads.

A job is never reported ended while its copies can still write: if ``submit`` fails
half way, an event is still recorded after what was enqueued, and the job ends, failed,
when that event completes.

Fencing without a CPU wait: before the engine reuses device blocks a store still reads
(a preempted request's, a sliding window's), the store actor calls the job's
:meth:`EventCompletion.order_before_compute`, which makes the compute stream wait on
the job's event (``current_stream().wait_event(event)``). The forward's writes are then
ordered after the store's reads on the device, and the engine thread returns at once.
Like ``submit``, it relies on the current stream of the actors' thread being the
compute stream. The event covers whatever was enqueued, so this holds for a job whose
submission failed half way too.

Streams and events come from factories so that the logic is unit-tested on a CPU with the
fakes of :mod:`kvferry.testing`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._logging import get_logger
from ._copy import CopyJob, Direction, job_bytes
from ._layout import KVLayout
from ._plan import check_job
from ._pool import HostPool
from ._torchcopy import torch_copy_job

DEFAULT_STAGING_BYTES = 64 << 20


class EventCompletion:
    """A :class:`~kvferry.transfer.Completion` over a CUDA event recorded after a job.

    ``error`` is set when the job's submission failed part way: the job still ends only
    when the event (recorded after what was enqueued) completes. An error raised by the
    event itself (a sticky CUDA error) ends the job with that error.

    It is :class:`~kvferry.transfer.DeviceFenced`: ``current_stream`` returns the
    compute stream that :meth:`order_before_compute` makes wait on the event.
    """

    __slots__ = ("_event", "_current_stream", "_error")

    def __init__(
        self,
        event: Any,
        current_stream: Callable[[], Any],
        error: BaseException | None = None,
    ) -> None:
        self._event = event
        self._current_stream = current_stream
        self._error = error

    def order_before_compute(self) -> None:
        """The compute stream waits on this job's event: work enqueued on it afterwards
        (a forward overwriting the job's device blocks) runs after the job's copies.
        Never blocks the calling thread."""
        self._current_stream().wait_event(self._event)

    def query(self) -> bool:
        try:
            return bool(self._event.query())
        except Exception as exc:
            self._error = self._error or exc
            return True

    def synchronize(self) -> None:
        try:
            self._event.synchronize()
        except Exception as exc:
            self._error = self._error or exc

    def exception(self) -> BaseException | None:
        if not self.query():
            return None
        own = getattr(self._event, "exception", None)  # fakes can fail an event
        return self._error or (own() if callable(own) else None)


class CudaCopyEngine:
    """Streams, staging and events for one device; see the module docstring."""

    def __init__(
        self,
        layout: KVLayout,
        pool: HostPool,
        *,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        stream_factory: Callable[[Direction], Any] | None = None,
        event_factory: Callable[[], Any] | None = None,
        current_stream: Callable[[], Any] | None = None,
        use_stream: Callable[[Any], Any] | None = None,
    ) -> None:
        if stream_factory is None:
            import torch.cuda

            device = layout.device

            def stream_factory(direction: Direction) -> Any:
                # Lower number = higher priority: loads overtake stores on the device.
                priority = -1 if direction == "load" else 0
                return torch.cuda.Stream(device=device, priority=priority)  # type: ignore[no-untyped-call]

            def event_factory() -> Any:
                return torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]

            current_stream = lambda: torch.cuda.current_stream(device)  # noqa: E731
            use_stream = torch.cuda.stream
            if not pool.rows.is_pinned():
                get_logger("kvferry.transfer").warning(
                    "host_pool_not_pinned", hint="copies will be synchronous and slow"
                )
        assert event_factory and current_stream and use_stream
        self.layout = layout
        self.pool = pool
        self._event_factory = event_factory
        self._current_stream = current_stream
        self._use_stream = use_stream
        self._streams: dict[Direction, Any] = {
            "store": stream_factory("store"),
            "load": stream_factory("load"),
        }
        self._staging_rows = max(1, staging_bytes // pool.row_bytes)
        self._staging: dict[Direction, torch.Tensor] = {}

    def job_bytes(self, job: CopyJob) -> int:
        return job_bytes(self.layout, job)

    def _staging_for(self, direction: Direction) -> torch.Tensor:
        """Allocated on first use, inside the direction's stream, so the caching
        allocator ties it to that stream."""
        buf = self._staging.get(direction)
        if buf is None:
            buf = torch.empty(
                (self._staging_rows, self.pool.row_bytes),
                dtype=torch.uint8,
                device=self.layout.device,
            )
            self._staging[direction] = buf
        return buf

    def submit(self, job: CopyJob) -> EventCompletion:
        """Enqueue ``job`` on its direction's stream; raises (enqueuing nothing) if it
        names blocks or rows that do not exist."""
        check_job(self.layout, job, self.pool.rows.shape[0], self.pool.row_bytes)
        stream = self._streams[job.direction]
        stream.wait_stream(self._current_stream())
        error: BaseException | None = None
        with self._use_stream(stream):
            try:
                staging = self._staging_for(job.direction)
                torch_copy_job(self.layout, self.pool.rows, job, staging, non_blocking=True)
            except Exception as exc:  # part may be enqueued: end only after it
                error = exc
            event = self._event_factory()
            event.record(stream)
        return EventCompletion(event, self._current_stream, error)

    def close(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()
