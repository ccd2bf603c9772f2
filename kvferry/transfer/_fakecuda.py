"""A fake CUDA device for the CUDA engine's logic on a CPU (re-exported by
:mod:`kvferry.testing`).

:class:`FakeCudaDevice` is a :class:`~kvferry.transfer._cuda.DeviceOps` over CPU tensors:
every op runs when it is enqueued, streams record what they were ordered after, and each
thread has its own current stream (as CUDA's are), so a test can give the engine's thread
a compute stream the actors' thread does not have. Kernel launches run the real Triton
kernel in Triton's interpreter. It counts what the engine asked of the device.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from typing import Any

import attrs
import torch


@attrs.define(eq=False)
class FakeCudaEvent:
    """A completion the test fires by hand: ``query()`` is False until :meth:`fire`."""

    _fired: bool = False
    _error: BaseException | None = None
    recorded_on: Any = None
    fire_on_record: bool = False

    def record(self, stream: Any = None) -> None:
        self.recorded_on = stream
        if self.fire_on_record:
            self.fire()

    def query(self) -> bool:
        return self._fired

    def synchronize(self) -> None:
        if not self._fired:
            raise RuntimeError("FakeCudaEvent.synchronize() before fire(): the test would hang")

    def exception(self) -> BaseException | None:
        return self._error if self._fired else None

    def fire(self, error: BaseException | None = None) -> None:
        self._fired = True
        self._error = error


@attrs.define(eq=False)
class FakeStream:
    """A stand-in for ``torch.cuda.Stream`` that records what it was ordered after:
    other streams (``wait_stream``) in ``waited_on``, events (``wait_event``) in
    ``waited_events``."""

    name: str = ""
    waited_on: list[Any] = attrs.field(factory=list)
    waited_events: list[Any] = attrs.field(factory=list)

    def wait_stream(self, other: Any) -> None:
        self.waited_on.append(other)

    def wait_event(self, event: Any) -> None:
        self.waited_events.append(event)

    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def fake_use_stream(stream: Any) -> Iterator[None]:
    """A stand-in for ``torch.cuda.stream(s)`` that changes nothing."""
    yield


class FakeCudaDevice:
    """The device ops of :class:`~kvferry.transfer.CudaCopyEngine`, on CPU tensors.

    ``fire_events``: events complete when recorded (the ops already ran); otherwise the
    test fires them (``events``). ``reach_host``: whether kernels can reach host memory
    (the interpreted kernel can: it runs on the CPU), which the direct path needs.
    ``batched_copies``: whether the device has one call for many copies.
    ``default_stream`` is every thread's current stream until :meth:`current` sets
    another for the calling thread.
    """

    device = torch.device("cpu")

    def __init__(
        self, *, fire_events: bool = True, reach_host: bool = True, batched_copies: bool = True
    ) -> None:
        self.fire_events = fire_events
        self.batched_copies = batched_copies
        self.memcpy_batches = 0
        self.reach_host = reach_host
        self.launch_programs: list[int] = []
        """Per launch, its programs along the rows."""
        self.default_stream = FakeStream(name="default")
        self.streams: list[FakeStream] = []
        self.events: list[FakeCudaEvent] = []
        self.kernel_launches = 0
        self.uploads = 0
        self.memcpys = 0
        self.bound_threads: list[str] = []
        self._local = threading.local()

    # -- what the engine calls
    def bind_thread(self) -> None:
        """Counts the threads bound (the engine's issue thread binds itself)."""
        self.bound_threads.append(threading.current_thread().name)

    def new_stream(self, direction: str) -> FakeStream:
        stream = FakeStream(name=f"{direction}#{len(self.streams)}")
        self.streams.append(stream)
        return stream

    def new_event(self, blocking: bool = True) -> FakeCudaEvent:
        event = FakeCudaEvent(fire_on_record=self.fire_events)
        self.events.append(event)
        return event

    def current_stream(self) -> Any:
        return getattr(self._local, "stream", None) or self.default_stream

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return self.current(stream)

    def set_stream(self, stream: Any) -> None:
        self._local.stream = stream

    def pinned(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int64)

    def host_accessible(self, host: torch.Tensor) -> bool:
        return self.reach_host

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        self.uploads += 1
        return host.clone()

    def memcpy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.memcpys += 1
        dst.copy_(src)

    def memcpy_batch(self, dsts: Any, srcs: Any, sizes: Any, stream: Any) -> bool:
        """Each copy at once (raw addresses: CPU memory here), counted in ``memcpys``;
        with ``batched_copies=False``, False (the engine copies run by run)."""
        if not self.batched_copies:
            return False
        self.memcpy_batches += 1
        for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
            ctypes.memmove(d, s, n)
            self.memcpys += 1
        return True

    def copy_rows(
        self,
        rows: torch.Tensor,
        lo: int,
        hi: int,
        num_rows: int,
        templates: torch.Tensor,
        max_pages: int,
        elem_bytes: int,
        to_device: bool,
        row_programs: int,
    ) -> None:
        from ._triton import copy_rows

        self.kernel_launches += 1
        self.launch_programs.append(max(1, min(hi - lo, row_programs)))
        copy_rows(rows, lo, hi, num_rows, templates, max_pages, elem_bytes, to_device, row_programs)

    # -- for tests
    @contextlib.contextmanager
    def current(self, stream: Any) -> Iterator[Any]:
        """Make ``stream`` the calling thread's current stream for the block."""
        before = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield stream
        finally:
            self._local.stream = before
