"""The CUDA path of the copy engine: the only module that touches ``torch.cuda``.

A step batch (every job of one direction that the engine step hands over) is planned
with numpy (:mod:`._pages`) into a row table (a few words per engine block, whatever the
number of layers), uploaded once per batch from a pinned buffer (torch's pinned
allocator keeps it until the upload ran). Two paths (:data:`CopyPath`):

**staged** (the default). The table is in staging order, cut into pieces of one staging
slot, with the runs of consecutive host rows of each piece. Per direction there are two
streams, a *kernel* stream and a *DMA* stream, and a ring of staging slots in device
memory. For each piece:

- store: the kernel stream gathers the piece's pages (one Triton launch,
  :mod:`._triton`) into a slot; the DMA stream waits for that and copies the piece's runs
  of host rows into the pinned host pool;
- load: the DMA stream copies the runs into a slot; the kernel stream waits for that and
  scatters the slot into the engine's blocks (one launch).

A piece's runs go in one driver call (``cuMemcpyBatchAsync`` through ctypes, checked
once on a probe copy; without it, one ``copy_`` per run). The gather of piece k+1
overlaps the DMA of piece k, and loads and stores run at once on their own streams
(loads at the higher priority). A slot is reused only after its last use ended: the
stream about to write it waits on that use's event — a device-side wait, so when the
ring is full, later pieces are queued on the device and issued as slots free, and the
thread that enqueues never waits. The host link is crossed by the copy engines, so the
multiprocessors are busy only for the gathers and scatters, at device-memory speed.

**direct**. One launch for the whole batch: the kernel reads and writes the host rows
themselves (pinned memory is mapped into the device's address space), with no staging
memory and no DMA. It needs the least CPU per batch and reaches the link at small pages,
but its programs hold multiprocessors while they wait on the link: measured on an H200,
bf16 matrix products beside it ran 3.1-4.3x as long (2.0-2.3x with one program per
page), beside staged copies 0.97-1.04x (``benchmarks/transfer_cuda.py``). So it is for
hosts where copies rarely overlap compute.

Ordering against the engine's compute: the caller captures a :class:`ComputeMark` on
the thread that runs the engine's forward, inside the engine's call (vLLM runs each
model thread on its own compute stream; the actors may run on another thread, whose
current stream is not the engine's). The batch's first stream waits on the event the
mark recorded, so a store reads KV only after the forward that wrote it, and a load
writes blocks only after earlier work on them. Fencing a store before the engine reuses
its blocks (:meth:`EventCompletion.order_before_compute`) makes the mark's compute
stream wait on the job's event: no CPU wait.

**Who enqueues** (:data:`IssueMode`). By default the engine's *issue thread* does all of
the above: the calling thread (the engine's, under the stepped runtime) only captures
the compute mark, wraps the jobs and hands them over, and the issue thread checks them,
plans the batch and enqueues it, batches in the order handed. So the calling thread's
cost per batch is a few tens of microseconds whatever the batch's size (measured on an
H200 host: 37-94 µs a 64-job step batch, where enqueuing it took the issue thread 1.6-7
ms). Until the issue thread has enqueued a job its completion has not ended, and a fence
(:meth:`IssuedCompletion.order_before_compute`) waits for the issue thread (CPU work,
never the device) before making the compute stream wait. ``issue="inline"`` enqueues on
the calling thread, before ``submit_batch`` returns. An interpreter exiting with an
engine open lets its issue thread finish what it holds. The thread holds its engine only
through the batches it has yet to enqueue: an engine dropped without ``close()`` is
collected once they are, and its thread ends after its lanes' streams' work.

Every job ends with an event created ``blocking=True`` (a waiter thread sleeps in
``synchronize`` instead of spinning). A job is never reported ended while its copies
can still write: if a batch fails half way, the jobs not fully enqueued end, failed,
with an event recorded after everything the batch enqueued.

Streams, events, uploads and launches go through a :class:`DeviceOps`, so the engine's
logic runs on a CPU with the fakes of :mod:`kvferry.testing` (and the Triton kernel under
``TRITON_INTERPRET=1``).

Who owns what: the engine is called from one thread (the transfer actors' loop); its
lanes, counters and staging slots belong to the thread that enqueues (the issue thread,
or that caller with ``issue="inline"``), the slots are written only by its streams, and a
batch's host rows only by its copies until its jobs ended.
"""

from __future__ import annotations

import atexit
import ctypes
import queue
import threading
import time
import weakref
from collections.abc import Generator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal, Protocol

import attrs
import numpy as np
import torch

from .._errors import HostMemoryError
from .._logging import get_logger
from ._copy import Completion, CopyJob, Direction, EndedCompletion, job_bytes
from ._layout import KVLayout
from ._pages import (
    I64,
    BatchPlan,
    PageTemplate,
    Templates,
    element_bytes,
    plan_batch,
    plan_rows,
    row_table,
)
from ._plan import check_batch
from ._pool import HostPool

DEFAULT_STAGING_BYTES = 64 << 20
"""Device memory for staging, per direction, split into :data:`DEFAULT_RING_SLOTS` slots."""
DEFAULT_RING_SLOTS = 2
"""Two slots keep the link busy (a gather or scatter runs at device-memory speed, so the
next piece is staged long before the link is done with the last), and make pieces as
large as the staging memory allows: the calling thread's cost is per piece."""

MAX_ROW_PROGRAMS = 1024
"""The kernel's default cap on programs along the rows of one launch (each program then
loops over its share of rows); the same as :data:`kvferry.transfer._triton.MAX_ROW_PROGRAMS`,
named here so that the engine's module needs no Triton to import."""


IssueMode = Literal["thread", "inline"]
"""Which thread checks, plans and enqueues a batch's work on the device: ``thread`` (the
default: the engine's issue thread; the calling thread only hands the jobs over, and
``submit`` checks its one job first, to raise) or ``inline`` (the calling thread itself,
before ``submit_batch`` returns)."""


CopyPath = Literal["staged", "direct"]
"""How a batch crosses the host link: ``staged`` (the default: a short kernel between the
engine's blocks and a device staging ring, the DMA engines between the ring and host
memory) or ``direct`` (one kernel reads and writes the pinned host rows themselves, over
the link); see the module docstring for what each costs."""


class DeviceOps(Protocol):
    """What the engine needs of a device (real: :class:`TorchCudaOps`; fakes:
    :class:`kvferry.testing.FakeCudaDevice`)."""

    device: torch.device

    def bind_thread(self) -> None:
        """Make the device the calling thread's current one (the issue thread calls it
        once, before its first batch)."""

    def new_stream(self, direction: Direction) -> Any: ...

    def new_event(self, blocking: bool = True) -> Any:
        """An event (``record(stream)``, ``query()``, ``synchronize()``); ``blocking``:
        a thread in ``synchronize`` sleeps instead of spinning (events only streams wait
        on need not be)."""

    def current_stream(self) -> Any:
        """The calling thread's current stream."""

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]: ...

    def set_stream(self, stream: Any) -> None:
        """Make ``stream`` the calling thread's current stream (the issue thread's own:
        nothing to restore)."""

    def pinned(self, n: int) -> torch.Tensor:
        """A pinned int64 host buffer of ``n`` elements."""

    def host_accessible(self, host: torch.Tensor) -> bool:
        """Whether a kernel can read and write ``host`` at its own address (page-locked
        memory mapped into the device's address space): the direct path needs it."""

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` (pinned) copied to the device on the current stream, without waiting."""

    def memcpy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A contiguous copy (host↔device) on the current stream, without waiting."""

    def memcpy_batch(self, dsts: I64, srcs: I64, sizes: I64, stream: Any) -> bool:
        """The copies ``sizes[i]`` bytes ``srcs[i]`` → ``dsts[i]`` (raw addresses, host or
        device) on ``stream`` in one call, without waiting; False (nothing enqueued)
        where the device has no such call (the engine then copies run by run)."""

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
        """One kernel launch on the current stream: every page of rows ``lo:hi`` of the
        row table, at most ``row_programs`` programs along the rows (see
        :func:`kvferry.transfer._triton.copy_rows`)."""


class TorchCudaOps:
    """:class:`DeviceOps` of a real CUDA device."""

    def __init__(self, device: torch.device) -> None:
        import torch.cuda

        self.device = device
        self._cuda = torch.cuda
        # "cuda" alone means the creating thread's current device, which another
        # thread does not share
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        # Probed now, when the engine is made (before serving): the probe waits for its
        # own copy, and for what the current stream had enqueued before it.
        self._batch = _batch_copy()

    def bind_thread(self) -> None:
        self._cuda.set_device(self._index)

    def new_stream(self, direction: Direction) -> Any:
        # Lower number = higher priority: loads overtake stores on the device.
        priority = -1 if direction == "load" else 0
        return self._cuda.Stream(device=self.device, priority=priority)  # type: ignore[no-untyped-call]

    def new_event(self, blocking: bool = True) -> Any:
        return self._cuda.Event(blocking=blocking)  # type: ignore[no-untyped-call]

    def current_stream(self) -> Any:
        return self._cuda.current_stream(self.device)

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        return self._cuda.stream(stream)

    def set_stream(self, stream: Any) -> None:
        self._cuda.set_stream(stream)

    def pinned(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int64, pin_memory=True)

    def host_accessible(self, host: torch.Tensor) -> bool:
        return bool(host.is_pinned()) and _host_pointer_usable(self.device)

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, non_blocking=True)

    def memcpy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def memcpy_batch(self, dsts: I64, srcs: I64, sizes: I64, stream: Any) -> bool:
        if self._batch is None:
            return False
        self._batch.copy(dsts, srcs, sizes, stream.cuda_stream)
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

        copy_rows(rows, lo, hi, num_rows, templates, max_pages, elem_bytes, to_device, row_programs)


@attrs.frozen
class ComputeMark:
    """Where the engine's compute stood when a job was handed over: its compute stream
    (captured on the engine's thread) and an event recorded on it then."""

    stream: Any = attrs.field(eq=False)
    event: Any = attrs.field(eq=False)


class EventCompletion:
    """A :class:`~kvferry.transfer.Completion` over a CUDA event recorded after a job.

    ``error`` is set when the job's submission failed part way: the job still ends only
    when the event (recorded after what was enqueued) completes. An error raised by the
    event itself (a sticky CUDA error) ends the job with that error.

    It is :class:`~kvferry.transfer.DeviceFenced`: :meth:`order_before_compute` makes a
    compute stream wait on the event.
    """

    __slots__ = ("_event", "_compute", "_error")

    def __init__(self, event: Any, compute: Any, error: BaseException | None = None) -> None:
        self._event = event
        self._compute = compute
        self._error = error

    def order_before_compute(self, mark: Any = None) -> None:
        """The compute stream (``mark``'s, else the one the job was ordered after) waits
        on this job's event: work enqueued on it afterwards (a forward overwriting the
        job's device blocks) runs after the job's copies. Never blocks the calling
        thread."""
        stream = mark.stream if isinstance(mark, ComputeMark) else self._compute
        stream.wait_event(self._event)

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


class IssuedCompletion:
    """The completion of a job handed to the issue thread: not ended until that thread
    has enqueued the job's batch, then the completion the job got there (an
    :class:`EventCompletion`, or an ended one).

    Waiting for the issue thread is a wait on the CPU work ahead of the job in that
    thread (which never waits on the device), never on the device itself: so
    :meth:`order_before_compute` may wait for it, and must, since a stream waiting on an
    event not yet recorded waits for nothing.
    """

    __slots__ = ("_batch", "_index")

    def __init__(self, batch: _Handed, index: int) -> None:
        self._batch = batch
        self._index = index

    def _enqueued(self) -> Completion | None:
        batch = self._batch
        return batch.done[self._index] if batch.issued.is_set() else None

    def _wait_enqueued(self) -> Completion:
        self._batch.issued.wait()
        return self._batch.done[self._index]

    def order_before_compute(self, mark: Any = None) -> None:
        """As :meth:`EventCompletion.order_before_compute`, once the job is enqueued;
        a job that ended without enqueuing anything needs no fence."""
        inner = self._wait_enqueued()
        if isinstance(inner, EventCompletion):
            inner.order_before_compute(mark)

    def query(self) -> bool:
        inner = self._enqueued()
        return inner is not None and inner.query()

    def synchronize(self) -> None:
        self._wait_enqueued().synchronize()

    def exception(self) -> BaseException | None:
        inner = self._enqueued()
        return None if inner is None else inner.exception()


@attrs.define(eq=False)
class _Handed:
    """A batch handed to the issue thread: its jobs (``checked``: already checked),
    and the compute mark; once enqueued, a completion per job index in ``done``, then
    ``issued`` set (one event for the whole batch)."""

    jobs: Sequence[CopyJob]
    mark: ComputeMark
    checked: bool
    done: dict[int, Completion] = attrs.field(factory=dict)
    issued: threading.Event = attrs.field(factory=threading.Event)


@attrs.frozen(kw_only=True)
class CudaEngineStatistics:
    """Counters of a :class:`CudaCopyEngine` (what it asked of the device), and the CPU
    time its issue thread spent enqueuing (``issue_cpu_s``; 0 with ``issue="inline"``)."""

    batches: int
    jobs: int
    pieces: int
    kernel_launches: int
    dma_copies: int
    table_uploads: int
    issue_cpu_s: float = 0.0


@attrs.define(eq=False)
class _Lane:
    """One direction: its two streams and its ring of staging slots."""

    kernel: Any
    dma: Any
    slots: list[torch.Tensor]
    free: list[Any]
    """Per slot, the event after its last use (None: never used)."""
    handed: list[Any]
    """Per slot, the event the second stream of a piece waits on (re-recorded)."""
    templates: torch.Tensor
    """The page templates, on the device (uploaded on this lane's kernel stream)."""
    bases: Any = None
    """The slots' device addresses."""
    next: int = 0


class CudaCopyEngine:
    """Streams and events for one device (and, on the staged path, a staging ring); see
    the module docstring.

    ``issue`` picks the thread that enqueues batches on the device (:data:`IssueMode`).
    ``path`` picks how batches cross the host link (:data:`CopyPath`). ``row_programs``
    caps the kernel's programs along the rows of a launch (fewer: fewer of the device's
    multiprocessors busy with a copy at once). On the staged path, ``staging_bytes`` of
    device memory per direction, split into ``ring_slots`` slots (at least one host row
    each). ``ops`` replaces the device (tests pass fakes).
    """

    def __init__(
        self,
        layout: KVLayout,
        pool: HostPool,
        *,
        path: CopyPath = "staged",
        issue: IssueMode = "thread",
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        ring_slots: int = DEFAULT_RING_SLOTS,
        row_programs: int = MAX_ROW_PROGRAMS,
        ops: DeviceOps | None = None,
    ) -> None:
        if ring_slots < 1:
            raise ValueError(f"ring_slots must be >= 1, got {ring_slots}")
        if row_programs < 1:
            raise ValueError(f"row_programs must be >= 1, got {row_programs}")
        if path not in ("staged", "direct"):
            raise ValueError(f"path must be 'staged' or 'direct', got {path!r}")
        if issue not in ("thread", "inline"):
            raise ValueError(f"issue must be 'thread' or 'inline', got {issue!r}")
        if ops is None:
            ops = TorchCudaOps(layout.device)
            if not pool.rows.is_pinned():
                get_logger("kvferry.transfer").warning(
                    "host_pool_not_pinned", hint="copies will be synchronous and slow"
                )
        if path == "direct" and not ops.host_accessible(pool.rows):
            raise ValueError(
                "path='direct' needs a host pool the device can reach (a pinned pool, "
                "HostPool(pin=True), on a device that maps registered host memory)"
            )
        self.path: CopyPath = path
        self.issue: IssueMode = issue
        self.row_programs = row_programs
        self.layout = layout
        self.pool = pool
        self.ops = ops
        self.slot_rows = max(1, staging_bytes // ring_slots // pool.row_bytes)
        self.ring_slots = ring_slots
        self._templates = Templates.of([PageTemplate.of(g) for g in layout.groups])
        # Every address the kernel forms is a template offset plus multiples of block
        # strides and staging rows (staging slots are allocator-aligned): the widest
        # element dividing those divides every page.
        self._elem = element_bytes(
            np.concatenate(
                (self._templates.table.ravel(), np.array([pool.row_bytes, 256], np.int64))
            )
        )
        self._lanes: dict[Direction, _Lane] = {}
        self._counts = dict.fromkeys(
            ("batches", "jobs", "pieces", "kernel_launches", "dma_copies", "table_uploads"), 0
        )
        self._issue_cpu_s = 0.0
        self._issuer: threading.Thread | None = None
        self._handed: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._last_handed: _Handed | None = None
        self._retire: weakref.finalize[Any, Any] | None = None
        self._closed = False

    def job_bytes(self, job: CopyJob) -> int:
        return job_bytes(self.layout, job)

    def capture_compute(self) -> ComputeMark:
        """Record where the calling thread's compute stream stands (call it on the
        engine's thread, inside the engine's call)."""
        stream = self.ops.current_stream()
        event = self.ops.new_event(blocking=False)  # only streams wait on it
        event.record(stream)
        return ComputeMark(stream, event)

    def statistics(self) -> CudaEngineStatistics:
        return CudaEngineStatistics(**self._counts, issue_cpu_s=self._issue_cpu_s)

    def _lane(self, direction: Direction) -> _Lane:
        lane = self._lanes.get(direction)
        if lane is None:
            ops = self.ops
            rows = self.slot_rows * self.ring_slots
            ring = (  # the direct path needs no staging memory
                torch.empty((rows, self.pool.row_bytes), dtype=torch.uint8, device=ops.device)
                if self.path == "staged"
                else None
            )
            kernel = ops.new_stream(direction)
            pinned = ops.pinned(self._templates.table.size)
            pinned.numpy()[:] = self._templates.table.ravel()
            with self._on(kernel):  # each lane's kernels read their own copy
                templates = ops.upload(pinned)
            lane = _Lane(
                kernel=kernel,
                dma=ops.new_stream(direction) if ring is not None else kernel,
                slots=[]
                if ring is None
                else [ring[i : i + self.slot_rows] for i in range(0, rows, self.slot_rows)],
                free=[None] * self.ring_slots,
                handed=[ops.new_event(blocking=False) for _ in range(self.ring_slots)]
                if ring is not None
                else [],
                templates=templates,
            )
            lane.bases = np.array([slot.data_ptr() for slot in lane.slots], dtype=np.int64)
            self._lanes[direction] = lane
        return lane

    def submit(self, job: CopyJob, compute: ComputeMark | None = None) -> Completion:
        """Enqueue one job; raises (enqueuing nothing) if it names blocks or rows that
        do not exist."""
        [error] = check_batch(self.layout, [job], self.pool.rows.shape[0], self.pool.row_bytes)
        if error is not None:
            raise error
        [completion] = self._submit([job], compute, checked=True)
        return completion

    def submit_batch(
        self, jobs: Sequence[CopyJob], compute: ComputeMark | None = None
    ) -> list[Completion]:
        """Enqueue ``jobs`` as one batch per direction; a completion per job, in order.

        A job that names blocks or rows that do not exist gets a completion that ends
        with that error (checked by the thread that enqueues the batch); the others go
        on. ``compute`` orders the batch after the engine's compute (default: the
        calling thread's current stream now).
        """
        return self._submit(jobs, compute, checked=False)

    def _submit(
        self, jobs: Sequence[CopyJob], compute: ComputeMark | None, *, checked: bool
    ) -> list[Completion]:
        if self._closed:
            raise RuntimeError("the CUDA copy engine is closed: it takes no more jobs")
        if not jobs:
            return []
        mark = compute if compute is not None else self.capture_compute()
        if self.issue == "inline":
            done = self._check_and_enqueue(jobs, mark, checked)
            return [done[i] for i in range(len(jobs))]
        handed = _Handed(jobs, mark, checked)
        completions: list[Completion] = [IssuedCompletion(handed, i) for i in range(len(jobs))]
        self._hand_over(handed)
        return completions

    def _check_and_enqueue(
        self, jobs: Sequence[CopyJob], mark: ComputeMark, checked: bool
    ) -> dict[int, Completion]:
        """Check a batch's jobs (unless ``checked``), then enqueue the good ones; a
        completion per job index (a bad job's has ended with its error)."""
        errors: Sequence[Exception | None] = (
            [None] * len(jobs)
            if checked
            else check_batch(self.layout, jobs, self.pool.rows.shape[0], self.pool.row_bytes)
        )
        done: dict[int, Completion] = {}
        by_direction: dict[Direction, list[int]] = {}
        for i, (job, error) in enumerate(zip(jobs, errors, strict=True)):
            if error is not None:
                done[i] = EndedCompletion(error)
            else:
                by_direction.setdefault(job.direction, []).append(i)
        if by_direction:
            done.update(self._enqueue(jobs, by_direction, mark))
        return done

    def _hand_over(self, handed: _Handed) -> None:
        """Queue a batch for the issue thread (started with the first): batches are
        enqueued in the order handed."""
        if self._issuer is None:
            # The thread holds the engine only through the batches it has yet to
            # enqueue: an engine collected without close() hands it its lanes, and it
            # ends once their streams' work has (their staging memory goes only then).
            self._issuer = threading.Thread(
                target=_issue_loop,
                args=(self.ops, self._handed),
                name="kvferry-cuda-issue",
                daemon=True,
            )
            self._issuer.start()
            _open_engines.add(self)
            _issue_threads.add(self._issuer)
            self._retire = weakref.finalize(self, self._handed.put, _Retire(self._lanes))
            self._retire.atexit = False
        # with the engine: one dropped right after a submit still enqueues the batch
        self._handed.put((self, handed))
        self._last_handed = handed

    def _issue(self, handed: _Handed, bound: BaseException | None) -> None:
        """On the issue thread: one handed batch checked and enqueued (device-side waits
        only: this thread never waits on the device either), then its completions'
        wait ended."""
        t0 = time.thread_time()
        try:
            if bound is not None:
                raise bound
            done = self._check_and_enqueue(handed.jobs, handed.mark, handed.checked)
        except BaseException as exc:  # a defect: no job may be left waiting
            get_logger("kvferry.transfer").error(
                "batch_issue_failed", jobs=len(handed.jobs), exc_info=exc
            )
            done = dict.fromkeys(range(len(handed.jobs)), self._after_everything(exc, handed.mark))
        self._issue_cpu_s += time.thread_time() - t0
        handed.done = done
        handed.issued.set()

    def _after_everything(self, error: BaseException, mark: ComputeMark) -> Completion:
        """A failed completion that ends only after everything enqueued so far on every
        lane (streams chained by events; an ended one if even that fails)."""
        last: Any = None
        try:
            for lane in self._lanes.values():
                for stream in (lane.dma, lane.kernel):
                    if last is not None:
                        stream.wait_event(last)
                    last = self.ops.new_event()
                    last.record(stream)
        except Exception:
            return EndedCompletion(error)
        return EndedCompletion(error) if last is None else EventCompletion(last, mark.stream, error)

    def _on(self, stream: Any) -> AbstractContextManager[Any]:
        """``stream`` current for what follows. On the issue thread it is simply made
        current (the thread is the engine's own: nothing to restore, and none of a
        context manager's cost per launch); on a caller's thread (``issue="inline"``)
        for the block alone."""
        if self.issue == "thread":
            self.ops.set_stream(stream)
            return nullcontext()
        return self.ops.use_stream(stream)

    def wait_enqueued(self) -> None:
        """Return once every batch handed over so far has been enqueued on the device: a
        wait on the issue thread's CPU work, never on the device (tests use it to look
        at what was enqueued)."""
        if self._last_handed is not None:
            self._last_handed.issued.wait()

    def _enqueue(
        self,
        jobs: Sequence[CopyJob],
        by_direction: dict[Direction, list[int]],
        mark: ComputeMark,
    ) -> dict[int, Completion]:
        """Enqueue a batch's directions (on the issue thread, or the calling thread
        with ``issue="inline"``); a completion per job index."""
        out: dict[int, Completion] = {}
        # Each direction's batch is enqueued a piece at a time, the two directions in
        # turn (loads first: a request waits on them), so both lanes have work on the
        # device early and the link carries both ways at once.
        running = [
            (by_direction[d], self._batch(d, [jobs[i] for i in by_direction[d]], mark))
            for d in ("load", "store")
            if d in by_direction
        ]
        while running:
            for entry in list(running):
                index, steps = entry
                try:
                    next(steps)
                except StopIteration as stop:
                    running.remove(entry)
                    for i, completion in zip(index, stop.value, strict=True):
                        out[i] = completion
                except Exception as exc:
                    # Raised before this direction enqueued anything (its lane's
                    # staging memory, say; a failure once enqueuing began ends its
                    # jobs after what was enqueued, inside the batch). The other
                    # direction goes on: it may have enqueued already.
                    running.remove(entry)
                    get_logger("kvferry.transfer").error(
                        "batch_submit_failed", jobs=len(index), exc_info=exc
                    )
                    for i in index:
                        out[i] = EndedCompletion(exc)
        return out

    def _direct(
        self, direction: Direction, jobs: list[CopyJob], mark: ComputeMark
    ) -> list[Completion]:
        """The direct path: one upload and one launch for the whole batch, on the lane's
        stream after the mark; the kernel reads and writes the host rows themselves."""
        ops = self.ops
        plan = plan_rows(jobs)
        self._counts["batches"] += 1
        self._counts["jobs"] += len(jobs)
        if plan.num_rows == 0:
            return [EndedCompletion(None) for _ in jobs]
        lane = self._lane(direction)
        stream = lane.kernel
        error: BaseException | None = None
        try:
            pinned = ops.pinned(4 * plan.num_rows)
            row_table(
                plan,
                self._templates,
                None,
                self.pool.row_bytes,
                pinned.numpy(),
                host_base=self.pool.rows.data_ptr(),
            )
            stream.wait_event(mark.event)
            with self._on(stream):
                table = ops.upload(pinned)
                self._counts["table_uploads"] += 1
                self._launch(lane, table, plan, 0, direction == "load")
                ended = ops.new_event()
                ended.record(stream)
            self._counts["pieces"] += 1
        except Exception as exc:  # part may be enqueued: the jobs end only after it
            error = exc
            get_logger("kvferry.transfer").error(
                "batch_submit_failed", direction=direction, jobs=len(jobs), exc_info=exc
            )
            ended = ops.new_event()
            ended.record(stream)
        return [
            EndedCompletion(None) if j < 0 else EventCompletion(ended, mark.stream, error)
            for j in plan.job_piece.tolist()
        ]

    def _batch(
        self, direction: Direction, jobs: list[CopyJob], mark: ComputeMark
    ) -> Generator[None, None, list[Completion]]:
        """Enqueue one direction's batch; yields after each piece (the caller interleaves
        the directions), returns a completion per job."""
        if self.path == "direct":
            return self._direct(direction, jobs, mark)
        ops = self.ops
        plan = plan_batch(jobs, self.slot_rows)
        self._counts["batches"] += 1
        self._counts["jobs"] += len(jobs)
        if plan.num_rows == 0:
            return [EndedCompletion(None) for _ in jobs]
        load = direction == "load"
        lane = self._lane(direction)
        slot_ids = (lane.next + np.arange(plan.num_pieces)) % self.ring_slots
        lane.next = int(slot_ids[-1] + 1) % self.ring_slots
        bases = lane.bases[slot_ids]
        host = self.pool.rows
        first, second = (lane.dma, lane.kernel) if load else (lane.kernel, lane.dma)
        piece_events: list[Any] = []
        error: BaseException | None = None
        try:
            pinned = ops.pinned(4 * plan.num_rows)
            row_table(plan, self._templates, bases, self.pool.row_bytes, pinned.numpy())
            runs = self._runs(plan, bases, to_slot=load)
            # The copy that writes the engine's blocks (load: the scatter) or reads them
            # (store: the gather) is the one ordered after the compute.
            lane.kernel.wait_event(mark.event)
            with self._on(lane.kernel):
                rows_table = ops.upload(pinned)
            self._counts["table_uploads"] += 1
            for k in range(plan.num_pieces):
                s = int(slot_ids[k])
                slot = lane.slots[s]
                if lane.free[s] is not None:
                    first.wait_event(lane.free[s])
                if load:
                    self._dma(plan, k, runs, slot, host, first, to_slot=True)
                else:
                    self._launch(lane, rows_table, plan, k, load)
                # one event per slot, recorded again each use: a stream's wait takes
                # the event's last record when the wait is enqueued
                handed = lane.handed[s]
                handed.record(first)
                second.wait_event(handed)
                if load:
                    self._launch(lane, rows_table, plan, k, load)
                else:
                    self._dma(plan, k, runs, slot, host, second, to_slot=False)
                ended = ops.new_event()
                ended.record(second)
                lane.free[s] = ended
                piece_events.append(ended)
                self._counts["pieces"] += 1
                # the other direction's next piece goes out here: no stream context is
                # held across this point (its current stream would be the other's)
                yield
        except Exception as exc:  # part may be enqueued: those jobs end only after it
            error = exc
            get_logger("kvferry.transfer").error(
                "batch_submit_failed", direction=direction, jobs=len(jobs), exc_info=exc
            )
            at_dma = ops.new_event()
            at_dma.record(lane.dma)
            lane.kernel.wait_event(at_dma)
            last = ops.new_event()
            last.record(lane.kernel)
            # a slot's next user must wait for whatever this batch enqueued
            lane.free = [last] * self.ring_slots
        completions: list[Completion] = []
        for j in plan.job_piece.tolist():
            if j < 0:
                completions.append(EndedCompletion(None))
            elif j < len(piece_events):
                completions.append(EventCompletion(piece_events[j], mark.stream))
            else:
                completions.append(EventCompletion(last, mark.stream, error))
        return completions

    def _launch(
        self, lane: _Lane, rows: torch.Tensor, plan: BatchPlan, k: int, to_device: bool
    ) -> None:
        """One launch over piece ``k``'s rows on the lane's kernel stream, in a stream
        context of its own (none is held from one piece to the next)."""
        lo = k * plan.slot_rows
        hi = min(lo + plan.slot_rows, plan.num_rows)
        with self._on(lane.kernel):
            self.ops.copy_rows(
                rows,
                lo,
                hi,
                plan.num_rows,
                lane.templates,
                self._templates.max_pages,
                self._elem,
                to_device,
                self.row_programs,
            )
        self._counts["kernel_launches"] += 1

    def _runs(self, plan: BatchPlan, bases: I64, *, to_slot: bool) -> tuple[I64, I64, I64]:
        """Every run of the batch as a copy (destinations, sources, sizes), computed once
        per batch: a piece's runs are then a slice of each."""
        row = self.pool.row_bytes
        piece = np.repeat(np.arange(plan.num_pieces, dtype=np.int64), np.diff(plan.run_bounds))
        host_at = self.pool.rows.data_ptr() + plan.runs_host * row
        slot_at = bases[piece] + (plan.runs_pos - piece * plan.slot_rows) * row
        sizes = plan.runs_len * row
        return (slot_at, host_at, sizes) if to_slot else (host_at, slot_at, sizes)

    def _dma(
        self,
        plan: BatchPlan,
        k: int,
        runs: tuple[I64, I64, I64],
        slot: torch.Tensor,
        host: torch.Tensor,
        stream: Any,
        *,
        to_slot: bool,
    ) -> None:
        a, b = int(plan.run_bounds[k]), int(plan.run_bounds[k + 1])
        base = k * plan.slot_rows
        dsts, srcs, sizes = runs
        if self.ops.memcpy_batch(dsts[a:b], srcs[a:b], sizes[a:b], stream):  # one call
            self._counts["dma_copies"] += b - a
            return
        each = zip(
            plan.runs_host[a:b].tolist(),
            plan.runs_pos[a:b].tolist(),
            plan.runs_len[a:b].tolist(),
            strict=True,
        )
        with self._on(stream):  # run by run, on the current stream
            for h0, p0, n in each:
                i0 = p0 - base
                if to_slot:
                    self.ops.memcpy(slot[i0 : i0 + n], host[h0 : h0 + n])
                else:
                    self.ops.memcpy(host[h0 : h0 + n], slot[i0 : i0 + n])
        self._counts["dma_copies"] += b - a

    def _stop_issuer(self) -> None:
        """Hand the issue thread its end and wait until it has enqueued what it holds."""
        if self._issuer is not None:
            self._handed.put(None)
            self._issuer.join()
            self._issuer = None
            _open_engines.discard(self)

    def close(self) -> None:
        """Take no more jobs; return once what was handed over is enqueued and every
        copy enqueued has ended."""
        self._closed = True
        self._stop_issuer()
        if self._retire is not None:
            self._retire.detach()
        _synchronize(self._lanes)


class _BatchCopy:
    """The driver's batched copy (``cuMemcpyBatchAsync``, CUDA 12.8 and newer) called
    through ctypes with numpy arrays: one call for all of a piece's runs, whatever their
    number, where a ``copy_`` per run costs several microseconds each."""

    class _Attributes(ctypes.Structure):
        # CUmemcpyAttributes: srcAccessOrder, srcLocHint {type, id}, dstLocHint, flags
        _fields_ = [
            ("src_access_order", ctypes.c_int),
            ("src_type", ctypes.c_int),
            ("src_id", ctypes.c_int),
            ("dst_type", ctypes.c_int),
            ("dst_id", ctypes.c_int),
            ("flags", ctypes.c_uint),
        ]

    _ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM

    def __init__(self, lib: Any) -> None:
        fn = getattr(lib, "cuMemcpyBatchAsync_v2", None)  # CUDA 13: no failIdx
        self._fail_index = fn is None
        if fn is None:
            fn = lib.cuMemcpyBatchAsync  # CUDA 12.8-12.9: a failIdx before the stream
        fn.restype = ctypes.c_int
        self._fn = fn
        self._attrs = self._Attributes(src_access_order=self._ORDER_STREAM)
        self._attr_index = (ctypes.c_size_t * 1)(0)
        self._failed_at = ctypes.c_size_t(0)

    def copy(self, dsts: I64, srcs: I64, sizes: I64, stream: int) -> None:
        """``dsts``, ``srcs``, ``sizes``: 8-byte integers (int64 addresses are read as the
        unsigned words they are)."""
        d, s, n = (_words(a) for a in (dsts, srcs, sizes))
        args: list[Any] = [
            ctypes.c_void_p(d.ctypes.data),
            ctypes.c_void_p(s.ctypes.data),
            ctypes.c_void_p(n.ctypes.data),
            ctypes.c_size_t(len(sizes)),
            ctypes.byref(self._attrs),
            self._attr_index,
            ctypes.c_size_t(1),
        ]
        if self._fail_index:
            args.append(ctypes.byref(self._failed_at))
        err = self._fn(*args, ctypes.c_void_p(stream))
        if err != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync failed with CUDA error {err}")


def _words(a: I64) -> I64:
    """``a`` as contiguous 8-byte integers, copied only where it is not already."""
    if a.dtype.itemsize == 8 and a.dtype.kind in "iu" and a.flags.c_contiguous:
        return a
    return np.ascontiguousarray(a, dtype=np.int64)


_batch_copy_state: list[_BatchCopy | None] = []


def _batch_copy() -> _BatchCopy | None:
    """The driver's batched copy, once it copied a probe right (device memory to pinned
    host memory, checked after a synchronize at first use); None where the driver has no
    such call or it failed the probe."""
    if not _batch_copy_state:
        batch: _BatchCopy | None = None
        try:
            batch = _BatchCopy(ctypes.CDLL("libcuda.so.1"))
            stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            src = torch.arange(1 << 12, dtype=torch.int32, device="cuda")
            dst = torch.zeros(1 << 12, dtype=torch.int32, pin_memory=True)
            half = src.numel() * 2
            address = np.array([dst.data_ptr() + half, dst.data_ptr()], dtype=np.int64)
            source = np.array([src.data_ptr(), src.data_ptr() + half], dtype=np.int64)
            stream.wait_stream(torch.cuda.current_stream())
            batch.copy(address, source, np.array([half, half], dtype=np.int64), stream.cuda_stream)
            stream.synchronize()
            want = torch.cat((src[src.numel() // 2 :], src[: src.numel() // 2])).cpu()
            if not torch.equal(dst, want):
                raise RuntimeError("the batched copy moved the wrong bytes")
        except Exception as exc:  # no such call, or not working here: copy run by run
            get_logger("kvferry.transfer").warning("batched_copy_unavailable", error=repr(exc))
            batch = None
        _batch_copy_state.append(batch)
    return _batch_copy_state[0]


def register_host_memory(address: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` at ``address`` for the CUDA device (``cudaHostRegister``): the
    host pool maps and populates its memory itself, then pins the range once.

    Raises :class:`~kvferry.HostMemoryError` when there is no CUDA device or the driver
    refuses (the page-locked limit, ``ulimit -l``, or too little memory).
    """
    import torch.cuda

    if not torch.cuda.is_available():
        raise HostMemoryError("a pinned host pool needs a CUDA device, and there is none")
    cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    # portable (every context) and mapped (kernels reach it: the direct copy path)
    err = cudart.cudaHostRegister(address, nbytes, 3)
    if int(err) != 0:
        raise HostMemoryError(
            f"could not pin a host pool of {nbytes} bytes (cudaHostRegister: "
            f"{cudart.cudaGetErrorString(err)}); is the page-locked memory limit "
            f"(ulimit -l) too low?"
        )


def unregister_host_memory(address: int) -> None:
    """Undo :func:`register_host_memory`; must run before the memory is unmapped."""
    import torch.cuda

    cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    cudart.cudaHostUnregister(address)


def _host_pointer_usable(device: torch.device) -> bool:
    """Whether ``device`` reaches registered host memory at its host address
    (``cudaDevAttrCanUseHostPointerForRegisteredMem``), asked through ``cuda.bindings``
    where it is installed (vLLM's CUDA build brings it); without it, assumed, as on every
    64-bit Linux system with unified addressing."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        return True
    index = device.index if device.index is not None else torch.cuda.current_device()
    attr = runtime.cudaDeviceAttr.cudaDevAttrCanUseHostPointerForRegisteredMem
    try:
        err, value = runtime.cudaDeviceGetAttribute(attr, index)
    except Exception:  # an older or newer binding's signature: the safe path
        return False
    return int(err) == 0 and bool(value)


@attrs.frozen
class _Retire:
    """An issue thread's last item when its engine was collected without close(): the
    engine's lanes, kept until their streams' work has ended."""

    lanes: dict[Direction, _Lane]


_Item = tuple[CudaCopyEngine, _Handed] | _Retire | None
"""What an issue thread is handed: a batch with its engine, its engine's lanes (the
engine was collected), or None (closed)."""


def _synchronize(lanes: dict[Direction, _Lane]) -> None:
    for lane in lanes.values():
        lane.kernel.synchronize()
        lane.dma.synchronize()


def _issue_loop(ops: DeviceOps, handed: queue.SimpleQueue[_Item]) -> None:
    """An engine's issue thread: each batch handed over enqueued in turn, until close()
    hands it None, or the engine, collected, its lanes. It holds the engine only through
    a batch not yet enqueued, so that an engine nobody holds is collected."""
    try:
        ops.bind_thread()
    except Exception as exc:  # every batch then fails, none waits forever
        get_logger("kvferry.transfer").error("issue_thread_failed", exc_info=exc)
        bound: BaseException | None = exc
    else:
        bound = None
    while (item := handed.get()) is not None:
        if isinstance(item, _Retire):
            _synchronize(item.lanes)
            return
        engine, batch = item
        del item
        engine._issue(batch, bound)
        del engine, batch


_open_engines: weakref.WeakSet[CudaCopyEngine] = weakref.WeakSet()
"""Engines whose issue thread runs: an interpreter that exits with one open lets it
enqueue what it holds and end (atexit runs before daemon threads are stopped, which
would otherwise stop it inside a device call)."""

_issue_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
"""Every issue thread started: those of engines collected before exit end on their own
(their lanes' work first), and exit waits for them too."""


@atexit.register
def _stop_issue_threads() -> None:
    for engine in list(_open_engines):
        engine._stop_issuer()
    for thread in list(_issue_threads):
        thread.join()
