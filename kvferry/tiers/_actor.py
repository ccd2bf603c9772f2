"""DiskIOActor: the worker side's disk I/O, reads before writes.

Who sends what: the worker-side facade tells ``ReadChunks`` (disk -> host slots, for a
load from the disk tier) and ``WriteChunks`` (host slots -> disk, for a store), one
message per engine step and direction, each a batch: keys as one ``(n, key_bytes)``
uint8 array and host slots as one int64 array; ``DeleteChunks`` when the disk tier
evicts. It asks ``PollDiskJobs`` once per step
(or gives a job a ``notify`` reply, answered when the job ends). Every job ends, and is
reported once, with one :class:`~kvferry.tiers.Outcome` per chunk. A job may also carry
a ``then`` step, run in this actor's task once it ended (a load's copy, chained after its
reads: the worker-side facade passes the load actor's ``tell``).

Who owns what: the actor owns its two queues (reads, writes: chunks not yet started) and
its jobs in flight. The blocking file I/O runs in worker threads on ``io_depth`` runner actors
(each waits for its thread with ``anyio.to_thread``), a batch of chunks of one kind per
thread hop (up to ``batch_bytes``: a hop per chunk costs a loaded machine as much as the
I/O); the actor hands a batch to a runner only when the runner is idle, and always takes
reads before writes. A write batch stops before its next chunk as soon as a read is
queued (a ``threading.Event`` the runners' threads check), and hands the rest back. A
read therefore waits behind at most the ``io_depth`` chunks already started, never
behind queued writes. The host slots a job names must not
be reused by anyone until its result is reported (the scheduler side pins them).

Bounds: the write queue holds at most ``max_queued_writes`` chunks; the chunks of a
``WriteChunks`` that do not fit are dropped at once (``Outcome.DROPPED``, counted,
logged once): a skipped store is only a future miss. Reads are never dropped; they are
bounded by the host slots the scheduler reserved for them, and by the mailbox.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal, TypeAlias, assert_never

import anyio
import anyio.to_thread
import attrs
import numpy as np
import numpy.typing as npt

from .._errors import ActorStopped
from .._logging import get_logger
from ..actors import Actor, ActorRef, Reply
from ._disk import DiskStatistics, DiskStore, Outcome, ScanReport

Kind = Literal["read", "write"]


def _readonly_keys(a: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    view = np.asarray(a, dtype=np.uint8).view()
    if view.ndim != 2 or view.shape[1] == 0:
        raise ValueError(f"keys are an (n, key_bytes) uint8 array, got shape {view.shape}")
    view.flags.writeable = False
    return view


def _readonly_i64(a: npt.ArrayLike) -> npt.NDArray[np.int64]:
    view = np.asarray(a, dtype=np.int64).reshape(-1).view()
    view.flags.writeable = False
    return view


def keys_array(keys: Sequence[bytes]) -> npt.NDArray[np.uint8]:
    """``keys`` (all of one length) as the ``(n, key_bytes)`` array messages carry."""
    if not keys:
        return np.zeros((0, 1), dtype=np.uint8)
    return np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), -1)


@attrs.frozen(kw_only=True)
class _Chunks:
    job_id: int
    keys: npt.NDArray[np.uint8] = attrs.field(converter=_readonly_keys, eq=False)
    slots: npt.NDArray[np.int64] = attrs.field(converter=_readonly_i64, eq=False)
    notify: Reply[DiskJobResult] | None = attrs.field(default=None, eq=False, repr=False)
    then: Callable[[DiskJobResult], Awaitable[object]] | None = attrs.field(
        default=None, eq=False, repr=False
    )
    """Awaited in the actor's task with the job's result once the job ended, after the
    result was queued for ``PollDiskJobs`` (or answered ``notify``), so a poll that sees
    what ``then`` started also sees the job's result. The next step of a chain, e.g. a
    load's copy once its chunks are read: it must not wait on this actor (an
    :class:`~kvferry.ActorStopped` it raises is logged, not raised)."""

    def __attrs_post_init__(self) -> None:
        if len(self.keys) != len(self.slots):
            raise ValueError(f"{len(self.keys)} keys for {len(self.slots)} slots")


@attrs.frozen(kw_only=True)
class ReadChunks(_Chunks):
    """Load the chunk of ``keys[i]`` into host slot ``slots[i]``, for each i."""


@attrs.frozen(kw_only=True)
class WriteChunks(_Chunks):
    """Store host slot ``slots[i]`` as the chunk of ``keys[i]``, for each i."""


@attrs.frozen(kw_only=True)
class DeleteChunks:
    """Remove the chunks of ``keys`` (the disk tier's eviction). Deleted in a worker
    thread before the actor handles its next message; ``reply`` (optional) gets how many
    were on disk. Send it only for keys whose writes ended (a queued write of the same
    key would land afterwards)."""

    keys: npt.NDArray[np.uint8] = attrs.field(converter=_readonly_keys, eq=False)
    reply: Reply[int] | None = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen(kw_only=True)
class DiskJobResult:
    """A job that ended: ``outcomes[i]`` is chunk i's :class:`Outcome` (int8)."""

    job_id: int
    kind: Kind
    outcomes: npt.NDArray[np.int8] = attrs.field(eq=False)
    nbytes: int
    seconds: float

    @property
    def ok(self) -> bool:
        return bool((self.outcomes == Outcome.OK).all())


@attrs.frozen(kw_only=True)
class PollDiskJobs:
    """Answer every job that ended since the last poll (jobs with a ``notify`` excepted)."""

    reply: Reply[list[DiskJobResult]] = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class ScanDisk:
    """Rebuild the store's index from its files (:meth:`DiskStore.scan`), in a worker
    thread; send it first, at start. Jobs sent meanwhile wait in the mailbox."""

    reply: Reply[ScanReport] = attrs.field(eq=False, repr=False)
    budget_s: float = 60.0


@attrs.frozen(kw_only=True)
class DiskIOStatistics:
    """A snapshot of the disk actor's counters, and its store's."""

    reads_queued: int
    """Chunks queued, not yet handed to a runner (likewise ``writes_queued``)."""
    writes_queued: int
    in_flight: int
    """Runners busy with a batch."""
    jobs_ended: int
    writes_dropped: int
    """Chunks dropped because the write queue was full."""
    store: DiskStatistics


@attrs.frozen(kw_only=True)
class GetDiskStatistics:
    reply: Reply[DiskIOStatistics] = attrs.field(eq=False, repr=False)


Item: TypeAlias = tuple[int, int, bytes, int]
"""One chunk handed to a runner: (job id, index in the job, key, host slot)."""


@attrs.frozen(kw_only=True)
class _Ran:
    """From a runner: ``done`` chunks ended, as (job id, index, outcome, bytes);
    ``undone`` were not started (a write batch that yielded to queued reads)."""

    done: tuple[tuple[int, int, Outcome, int], ...]
    undone: tuple[Item, ...]
    runner: ActorRef[_Run] = attrs.field(eq=False)


DiskIOMsg: TypeAlias = (
    ReadChunks | WriteChunks | DeleteChunks | PollDiskJobs | ScanDisk | GetDiskStatistics | _Ran
)


@attrs.frozen(kw_only=True)
class _Run:
    kind: Kind
    items: tuple[Item, ...]


class _Runner(Actor[_Run]):
    """Runs a batch of chunks of one kind in one worker thread (one thread hop per
    batch, not per chunk) and tells its owner the outcomes.

    A write batch stops before its next chunk once ``reads_waiting`` is set, so a read
    waits for at most the chunk in progress.
    """

    mailbox_size = 1

    def __init__(
        self,
        owner: ActorRef[DiskIOMsg],
        store: DiskStore,
        slots: npt.NDArray[np.uint8],
        reads_waiting: threading.Event,
    ) -> None:
        self.owner = owner
        self.store = store
        self.slots = slots
        self.reads_waiting = reads_waiting
        self._log = get_logger("kvferry.tiers", actor="DiskIORunner")

    def _run(
        self, kind: Kind, items: tuple[Item, ...]
    ) -> tuple[list[tuple[int, int, Outcome, int]], tuple[Item, ...]]:
        op = self.store.read if kind == "read" else self.store.write
        done: list[tuple[int, int, Outcome, int]] = []
        for n, (job_id, index, key, slot) in enumerate(items):
            if kind == "write" and n and self.reads_waiting.is_set():
                return done, items[n:]
            view = self.slots[slot]
            try:
                outcome = op(key, view)
            except Exception as exc:  # a bug, not a file-system failure: the chunk fails
                self._log.error("disk_io_failed", kind=kind, job_id=job_id, exc_info=exc)
                outcome = Outcome.IO_ERROR
            done.append((job_id, index, outcome, view.nbytes if outcome == Outcome.OK else 0))
        return done, ()

    async def handle(self, msg: _Run) -> None:
        done, undone = await anyio.to_thread.run_sync(self._run, msg.kind, msg.items)
        await self.owner.tell(_Ran(done=tuple(done), undone=undone, runner=self.ref))


@attrs.define(eq=False)
class _Job:
    msg: ReadChunks | WriteChunks
    kind: Kind
    outcomes: npt.NDArray[np.int8]
    pending: int
    started: float
    nbytes: int = 0


class DiskIOActor(Actor[DiskIOMsg]):
    """Reads and writes chunks between host slots and a :class:`DiskStore`.

    ``slots``: the host pool as a ``(num_slots, slot_bytes)`` uint8 array (a slot is
    one chunk). ``io_depth``: runners (worker threads) at once. ``batch_bytes``: a
    runner takes up to this many bytes of chunks of one kind per thread hop.
    """

    mailbox_size = 1024

    def __init__(
        self,
        store: DiskStore,
        slots: npt.NDArray[np.uint8],
        *,
        io_depth: int = 2,
        max_queued_writes: int = 256,
        batch_bytes: int = 16 << 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if slots.ndim != 2 or slots.dtype != np.uint8:
            raise ValueError("slots is a (num_slots, slot_bytes) uint8 array")
        if io_depth < 1 or max_queued_writes < 0:
            raise ValueError("io_depth must be >= 1 and max_queued_writes >= 0")
        self.store = store
        self.slots = slots
        self.io_depth = io_depth
        self.max_queued_writes = max_queued_writes
        self._clock = clock
        self._reads: deque[tuple[_Job, int]] = deque()
        self._writes: deque[tuple[_Job, int]] = deque()
        self._jobs: dict[int, _Job] = {}
        self._idle: list[ActorRef[_Run]] = []
        self._spawned = False
        self._ended: list[DiskJobResult] = []
        self._jobs_ended = 0
        self._dropped = 0
        self._log = get_logger("kvferry.tiers", actor="DiskIOActor")
        self._dropped_logged = False
        self._reads_waiting = threading.Event()
        self._then: list[tuple[Callable[[DiskJobResult], Awaitable[object]], DiskJobResult]] = []
        self._batch_chunks = max(1, batch_bytes // max(1, slots.shape[1]))

    async def handle(self, msg: DiskIOMsg) -> None:
        match msg:
            case ReadChunks():
                await self._accept(msg, "read")
            case WriteChunks():
                await self._accept(msg, "write")
            case DeleteChunks(keys=keys, reply=reply):
                store = self.store
                deleted = await anyio.to_thread.run_sync(
                    lambda: sum(store.delete(bytes(k)) for k in keys)
                )
                if reply is not None:
                    reply.set(deleted)
            case _Ran():
                self._ran(msg)
            case PollDiskJobs(reply=reply):
                ended, self._ended = self._ended, []
                reply.set(ended)
            case ScanDisk(reply=reply, budget_s=budget_s):
                report = await anyio.to_thread.run_sync(lambda: self.store.scan(budget_s=budget_s))
                reply.set(report)
            case GetDiskStatistics(reply=reply):
                reply.set(self.statistics())
            case _:
                assert_never(msg)
        if self._then:
            await self._run_then()

    async def _run_then(self) -> None:
        chained, self._then = self._then, []
        for then, result in chained:
            try:
                await then(result)
            except ActorStopped as exc:  # stopping: what it would start is not needed
                self._log.info("disk_job_then_dropped", job_id=result.job_id, error=str(exc))

    async def _accept(self, msg: ReadChunks | WriteChunks, kind: Kind) -> None:
        n = len(msg.slots)
        job = _Job(
            msg=msg,
            kind=kind,
            outcomes=np.full(n, -1, dtype=np.int8),
            pending=n,
            started=self._clock(),
        )
        if msg.job_id in self._jobs:
            raise ValueError(f"disk job {msg.job_id} is already in flight")
        bad = (msg.slots < 0) | (msg.slots >= len(self.slots))
        if bad.any():
            self._log.error("disk_job_rejected", job_id=msg.job_id, reason="slot out of range")
            job.outcomes[:] = Outcome.ABORTED
            job.pending = 0
            self._end(job)
            return
        if self.slots.shape[1] == 0:
            raise ValueError("slots of zero bytes")
        self._jobs[msg.job_id] = job
        if kind == "read":
            self._reads.extend((job, i) for i in range(n))
            if n:
                self._reads_waiting.set()  # running write batches stop at their next chunk
        else:
            room = max(0, self.max_queued_writes - len(self._writes))
            self._writes.extend((job, i) for i in range(min(n, room)))
            if n > room:
                job.outcomes[room:] = Outcome.DROPPED
                job.pending -= n - room
                self._dropped += n - room
                if not self._dropped_logged:
                    self._dropped_logged = True
                    self._log.warning(
                        "disk_writes_dropped",
                        job_id=msg.job_id,
                        dropped=n - room,
                        note="write queue full; logged once, later ones are counted",
                    )
        if not self._spawned:
            self._spawned = True
            await self._spawn_runners()
        if job.pending == 0:
            self._finish(job)
        self._dispatch()

    async def _spawn_runners(self) -> None:
        """The runners, at the first job. None once the system is stopping (the job's
        chunks then wait, and end aborted when this actor stops): a runner whose start
        overlapped the start of the system's shutdown is stopped here, as the shutdown
        may have passed it by."""
        system = self.system
        for i in range(self.io_depth):
            if not system.running:
                return
            runner = _Runner(self.ref, self.store, self.slots, self._reads_waiting)
            ref = await system.spawn(runner, name=f"{self.ref.name}.io{i}")
            if not system.running:
                await ref.stop()
                return
            self._idle.append(ref)

    def _dispatch(self) -> None:
        while self._idle and (self._reads or self._writes):
            kind: Kind = "read" if self._reads else "write"
            queue = self._reads if self._reads else self._writes
            batch: list[Item] = []
            while queue and len(batch) < self._batch_chunks:
                job, i = queue.popleft()
                batch.append((job.msg.job_id, i, bytes(job.msg.keys[i]), int(job.msg.slots[i])))
            runner = self._idle.pop()
            try:
                runner.tell_nowait(_Run(kind=kind, items=tuple(batch)))
            except (ActorStopped, anyio.WouldBlock):  # stopping: on_stop aborts the rest
                self._requeue(kind, batch)
                break
        if not self._reads:
            self._reads_waiting.clear()

    def _requeue(self, kind: Kind, items: Sequence[Item]) -> None:
        queue = self._reads if kind == "read" else self._writes
        queue.extendleft((self._jobs[job_id], i) for job_id, i, _, _ in reversed(items))

    def _ran(self, msg: _Ran) -> None:
        self._idle.append(msg.runner)
        self._requeue("write", msg.undone)
        for job_id, index, outcome, nbytes in msg.done:
            job = self._jobs.get(job_id)
            if job is None:
                continue
            job.outcomes[index] = outcome
            job.nbytes += nbytes
            job.pending -= 1
            if job.pending == 0:
                self._finish(job)
        self._dispatch()

    def _finish(self, job: _Job) -> None:
        del self._jobs[job.msg.job_id]
        self._end(job)

    def _end(self, job: _Job) -> None:
        self._jobs_ended += 1
        result = DiskJobResult(
            job_id=job.msg.job_id,
            kind=job.kind,
            outcomes=job.outcomes,
            nbytes=job.nbytes,
            seconds=self._clock() - job.started,
        )
        if job.msg.notify is not None:
            job.msg.notify.set(result)
        else:
            self._ended.append(result)
        if job.msg.then is not None:
            self._then.append((job.msg.then, result))

    async def on_stop(self) -> None:
        for job in self._jobs.values():
            job.outcomes[job.outcomes < 0] = Outcome.ABORTED
            if job.msg.notify is not None:
                job.msg.notify.fail(
                    ActorStopped(f"DiskIOActor stopped before disk job {job.msg.job_id} ended")
                )
        self._jobs.clear()
        self._reads.clear()
        self._writes.clear()

    def statistics(self) -> DiskIOStatistics:
        return DiskIOStatistics(
            reads_queued=len(self._reads),
            writes_queued=len(self._writes),
            in_flight=self.io_depth - len(self._idle) if self._spawned else 0,
            jobs_ended=self._jobs_ended,
            writes_dropped=self._dropped,
            store=self.store.statistics(),
        )
