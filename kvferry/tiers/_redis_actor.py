"""RedisIOActor: the worker side's Redis I/O, reads before writes, every job within its
deadline.

It takes the disk actor's messages, so the worker-side facade drives either tier the
same way: ``ReadChunks`` (Redis -> host slots, for a load; ``then`` chains the load's
copy), ``WriteChunks`` (host slots -> Redis, for a store), ``DeleteChunks``, and
``PollDiskJobs`` once per step (or a job's ``notify``). Every job ends, and is reported
once, as a :class:`~kvferry.tiers.DiskJobResult` (``kind`` ``"read"`` / ``"write"``) with
one :class:`~kvferry.tiers.Outcome` per chunk.

Who owns what: the actor owns its queues (chunks not yet sent) and its jobs. The network
I/O runs on ``io_depth`` runner actors on the same event loop (no threads: the ``redis``
client is asynchronous), one batch per runner at a time, each batch one pipeline of up to
``batch_bytes``. Reads are dispatched first, and writes never take the last idle runner
(with ``io_depth`` > 1), so a read never waits behind queued or running writes. The host
slots a job names must not be reused until its result is reported (the scheduler side
pins them): a runner copies into a slot only while the job is alive (below).

Deadlines: a job ends within ``job_timeout_s`` of its arrival. A batch's pipeline gets
the time its earliest job has left (never more than the store's ``op_timeout_s``), and a
timer ends the job's chunks still queued at its deadline (``Outcome.TIMEOUT``). A chunk
in flight therefore ends by its batch's timeout, at the job's deadline at the latest.

Bounds: at most ``max_queued_writes`` chunks wait to be written; the chunks of a
``WriteChunks`` that do not fit are dropped at once (``Outcome.DROPPED``, counted,
logged once). A store refused because the breaker is open is ``UNAVAILABLE`` at once.
Reads are never dropped; they are bounded by the host slots reserved for them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeAlias, assert_never

import anyio
import attrs
import numpy as np
import numpy.typing as npt

from .._errors import ActorStopped
from .._logging import get_logger
from ..actors import Actor, ActorRef, Reply, Timer
from ._actor import DeleteChunks, DiskJobResult, Kind, PollDiskJobs, ReadChunks, WriteChunks
from ._disk import Outcome
from ._redis import RedisStatistics, RedisStore


@attrs.frozen(kw_only=True)
class RedisIOStatistics:
    """A snapshot of the Redis actor's counters, and its store's."""

    reads_queued: int
    """Chunks queued, not yet sent (likewise ``writes_queued``)."""
    writes_queued: int
    in_flight: int
    """Runners busy with a batch."""
    jobs_ended: int
    jobs_timed_out: int
    """Jobs that reached their deadline with chunks still queued."""
    writes_dropped: int
    """Chunks dropped because the write queue was full."""
    store: RedisStatistics


@attrs.frozen(kw_only=True)
class GetRedisStatistics:
    reply: Reply[RedisIOStatistics] = attrs.field(eq=False, repr=False)


Item: TypeAlias = tuple[int, int, bytes, int]
"""One chunk handed to a runner: (job id, index in the job, key, host slot)."""


@attrs.frozen(kw_only=True)
class _Ran:
    """From a runner: (job id, index, outcome, bytes) of each chunk of its batch."""

    done: tuple[tuple[int, int, Outcome, int], ...]
    runner: ActorRef[_Run] = attrs.field(eq=False)


@attrs.frozen(kw_only=True)
class _Expire:
    job_id: int


RedisIOMsg: TypeAlias = (
    ReadChunks | WriteChunks | DeleteChunks | PollDiskJobs | GetRedisStatistics | _Ran | _Expire
)


@attrs.frozen(kw_only=True)
class _Run:
    kind: Kind
    items: tuple[Item, ...]
    timeout_s: float


class _Runner(Actor[_Run]):
    """Sends one batch as one pipeline and tells its owner the outcomes."""

    mailbox_size = 1

    def __init__(
        self, owner: ActorRef[RedisIOMsg], store: RedisStore, slots: npt.NDArray[np.uint8]
    ) -> None:
        self.owner = owner
        self.store = store
        self.slots = slots
        self._log = get_logger("kvferry.tiers", actor="RedisIORunner")

    async def handle(self, msg: _Run) -> None:
        keys = [key for _, _, key, _ in msg.items]
        views = [self.slots[slot] for _, _, _, slot in msg.items]
        try:
            if msg.kind == "read":
                outcomes = await self.store.read(keys, views, timeout_s=msg.timeout_s)
            else:
                outcomes = await self.store.write(keys, views, timeout_s=msg.timeout_s)
        except Exception as exc:  # a bug, not a Redis failure: the batch fails
            self._log.error("redis_io_failed", kind=msg.kind, exc_info=exc)
            outcomes = np.full(len(keys), Outcome.IO_ERROR, dtype=np.int8)
        done = tuple(
            (job_id, index, Outcome(int(o)), views[n].nbytes if o == Outcome.OK else 0)
            for n, ((job_id, index, _, _), o) in enumerate(zip(msg.items, outcomes, strict=True))
        )
        await self.owner.tell(_Ran(done=done, runner=self.ref))


@attrs.define(eq=False)
class _Job:
    msg: ReadChunks | WriteChunks
    kind: Kind
    outcomes: npt.NDArray[np.int8]
    pending: int
    started: float
    deadline: float
    nbytes: int = 0
    timer: Timer | None = None


class RedisIOActor(Actor[RedisIOMsg]):
    """Reads and writes chunks between host slots and a :class:`RedisStore`.

    ``slots``: the host pool as a ``(num_slots, slot_bytes)`` uint8 array (a slot is one
    chunk). ``io_depth``: batches in flight at once. ``batch_bytes``: a batch carries up
    to this many bytes of chunks of one kind. ``job_timeout_s``: every job ends within
    this long of its arrival. ``clock``: the anyio clock by default (deadlines and
    timers share it).
    """

    mailbox_size = 1024

    def __init__(
        self,
        store: RedisStore,
        slots: npt.NDArray[np.uint8],
        *,
        io_depth: int = 4,
        max_queued_writes: int = 256,
        batch_bytes: int = 8 << 20,
        job_timeout_s: float = 5.0,
        clock: Callable[[], float] = anyio.current_time,
    ) -> None:
        if slots.ndim != 2 or slots.dtype != np.uint8 or slots.shape[1] == 0:
            raise ValueError("slots is a (num_slots, slot_bytes) uint8 array")
        if io_depth < 1 or max_queued_writes < 0 or not job_timeout_s > 0:
            raise ValueError("io_depth >= 1, max_queued_writes >= 0 and job_timeout_s > 0")
        self.store = store
        self.slots = slots
        self.io_depth = io_depth
        self.max_queued_writes = max_queued_writes
        self.job_timeout_s = job_timeout_s
        self._clock = clock
        self._reads: deque[tuple[_Job, int]] = deque()
        self._writes: deque[tuple[_Job, int]] = deque()
        self._jobs: dict[int, _Job] = {}
        self._idle: list[ActorRef[_Run]] = []
        self._spawned = False
        self._ended: list[DiskJobResult] = []
        self._jobs_ended = 0
        self._timed_out = 0
        self._dropped = 0
        self._dropped_logged = False
        self._log = get_logger("kvferry.tiers", actor="RedisIOActor")
        self._then: list[tuple[Callable[[DiskJobResult], Awaitable[object]], DiskJobResult]] = []
        self._batch_chunks = max(1, batch_bytes // slots.shape[1])

    async def handle(self, msg: RedisIOMsg) -> None:
        match msg:
            case ReadChunks():
                await self._accept(msg, "read")
            case WriteChunks():
                await self._accept(msg, "write")
            case DeleteChunks(keys=keys, reply=reply):
                # Bounded by the store's op timeout; immediate while the breaker is open.
                deleted = await self.store.delete([bytes(k) for k in keys])
                if reply is not None:
                    reply.set(deleted)
            case _Ran():
                self._ran(msg)
            case _Expire(job_id=job_id):
                self._expire(job_id)
            case PollDiskJobs(reply=reply):
                ended, self._ended = self._ended, []
                reply.set(ended)
            case GetRedisStatistics(reply=reply):
                reply.set(self.statistics())
            case _:
                assert_never(msg)
        if self._then:
            chained, self._then = self._then, []
            for then, result in chained:
                try:
                    await then(result)
                except ActorStopped as exc:  # stopping: what it would start is not needed
                    self._log.info("redis_job_then_dropped", job_id=result.job_id, error=str(exc))

    async def _accept(self, msg: ReadChunks | WriteChunks, kind: Kind) -> None:
        if msg.job_id in self._jobs:
            raise ValueError(f"redis job {msg.job_id} is already in flight")
        n = len(msg.slots)
        now = self._clock()
        job = _Job(
            msg=msg,
            kind=kind,
            outcomes=np.full(n, -1, dtype=np.int8),
            pending=n,
            started=now,
            deadline=now + self.job_timeout_s,
        )
        if ((msg.slots < 0) | (msg.slots >= len(self.slots))).any():
            self._log.error("redis_job_rejected", job_id=msg.job_id, reason="slot out of range")
            job.outcomes[:] = Outcome.ABORTED
            job.pending = 0
            self._end(job)
            return
        if kind == "read":
            self._reads.extend((job, i) for i in range(n))
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
                        "redis_writes_dropped",
                        job_id=msg.job_id,
                        dropped=n - room,
                        note="write queue full; logged once, later ones are counted",
                    )
        if job.pending == 0:
            self._end(job)
            return
        self._jobs[msg.job_id] = job
        job.timer = self.system.send_after(self.job_timeout_s, self.ref, _Expire(job_id=msg.job_id))
        if not self._spawned:
            self._spawned = True
            await self._spawn_runners()
        self._dispatch()

    async def _spawn_runners(self) -> None:
        """The runners, at the first job (none once the system is stopping: the queued
        chunks then end aborted when this actor stops)."""
        system = self.system
        for i in range(self.io_depth):
            if not system.running:
                return
            ref = await system.spawn(
                _Runner(self.ref, self.store, self.slots), name=f"{self.ref.name}.io{i}"
            )
            if not system.running:
                await ref.stop()
                return
            self._idle.append(ref)

    def _dispatch(self) -> None:
        while self._idle and (self._reads or self._writes):
            kind: Kind = "read" if self._reads else "write"
            if kind == "write" and len(self._idle) == 1 and self.io_depth > 1:
                return  # the last idle runner is kept for reads
            queue = self._reads if kind == "read" else self._writes
            batch: list[Item] = []
            deadline = float("inf")
            while queue and len(batch) < self._batch_chunks:
                job, i = queue.popleft()
                deadline = min(deadline, job.deadline)
                batch.append((job.msg.job_id, i, bytes(job.msg.keys[i]), int(job.msg.slots[i])))
            timeout = max(deadline - self._clock(), 1e-3)
            runner = self._idle.pop()
            try:
                runner.tell_nowait(_Run(kind=kind, items=tuple(batch), timeout_s=timeout))
            except (ActorStopped, anyio.WouldBlock):  # stopping: on_stop aborts the rest
                queue.extendleft((self._jobs[j], i) for j, i, _, _ in reversed(batch))
                return

    def _ran(self, msg: _Ran) -> None:
        self._idle.append(msg.runner)
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

    def _expire(self, job_id: int) -> None:
        """The job's deadline: its chunks still queued end ``TIMEOUT`` (those in flight
        end by their batch's timeout, which is this deadline at the latest)."""
        job = self._jobs.get(job_id)
        if job is None:
            return
        queue = self._reads if job.kind == "read" else self._writes
        kept = [(j, i) for j, i in queue if j is not job]
        expired = len(queue) - len(kept)
        if not expired:
            return
        queue.clear()
        queue.extend(kept)
        job.outcomes[job.outcomes < 0] = Outcome.TIMEOUT  # in-flight ones are overwritten
        job.pending -= expired
        self._timed_out += 1
        self._log.warning("redis_job_timed_out", job_id=job_id, kind=job.kind, queued=expired)
        if job.pending == 0:
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        del self._jobs[job.msg.job_id]
        if job.timer is not None:
            job.timer.cancel()
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
            if job.timer is not None:
                job.timer.cancel()
            if job.msg.notify is not None:
                job.msg.notify.fail(
                    ActorStopped(f"RedisIOActor stopped before redis job {job.msg.job_id} ended")
                )
        self._jobs.clear()
        self._reads.clear()
        self._writes.clear()

    def statistics(self) -> RedisIOStatistics:
        return RedisIOStatistics(
            reads_queued=len(self._reads),
            writes_queued=len(self._writes),
            in_flight=self.io_depth - len(self._idle) if self._spawned else 0,
            jobs_ended=self._jobs_ended,
            jobs_timed_out=self._timed_out,
            writes_dropped=self._dropped,
            store=self.store.statistics(),
        )
