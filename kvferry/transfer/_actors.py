"""StoreActor (device → host) and LoadActor (host → device).

Who sends what: the worker-side facade tells one ``SubmitJobs`` per engine step and
direction (the step's jobs as one batch, with the engine's :class:`ComputeMark` captured
on the engine's thread) and asks ``PollFinished`` once per step; ``FlushJobs`` fences
given jobs before the engine reuses blocks a store still reads. An embedding caller
(:class:`~kvferry.Ferry`) tells ``SubmitJob`` with a ``notify`` reply instead of polling:
a watcher actor waits for the job's completion in a worker thread
(``Completion.synchronize``), and the job's result answers ``notify`` as soon as that
thread returns — the caller's loop is woken, never polled.

The owner and its watcher tell each other (``_Watch`` one way, ``_Swept`` back), so one
of the two must never wait for room: the owner hands completions over with
``tell_nowait`` and keeps what does not fit, handing it over as ``_Swept`` messages come
back (each ``_Watch`` the watcher handles brings one). The watcher, spawned on first use
and so stopped before its owner, may be gone while the owner drains: the owner's
``on_stop`` then waits for those jobs' copies itself (each until its deadline, then
cancelled), and answers their ``notify``; only a job that outlives the system's stop
deadline is never answered by the actor (the :class:`~kvferry.Ferry` fails its wait with
:class:`~kvferry.ActorStopped` once its copy engine closed).

Each actor owns its direction's in-flight jobs and their completions; nothing else
touches them. Both actors may share one copy engine, which serves loads before stores
and runs several jobs of each direction at once (see the engines).

How ``FlushJobs`` fences a job still in flight depends on its completion: one that is
:class:`~kvferry.transfer.DeviceFenced` (a CUDA event) gets a stream dependency — the
compute stream (the mark's, captured on the engine's thread, whichever thread runs the
actors) waits on the job's event, so the forward's writes are ordered after the
store's reads on the device, and the ask returns at once; any other (the copy threads)
is waited for on the CPU until it ends, within ``timeout_s``. A job that already ended
needs nothing. The reply, :class:`Flushed`, says which way each job went. Either way the
job stays in flight until it really ends, and ``PollFinished`` reports it.

Every job ends, and is reported once by ``PollFinished``: a :class:`JobResult` with
``ok=True``, or a :class:`JobFailed` naming the engine blocks it leaves invalid — for a
rejected job (wrong direction, a job id already in flight), a failed submission, a copy
error, a missed deadline, or an engine that raised while the job was collected
(``reason="engine"``). Nothing is asserted.

Deadlines, honestly: a job whose copy can still write is never reported, neither done
nor failed (a failed load's blocks are recomputed at once; a failed store's slot is
reused at once). When a job's deadline passes (checked on every poll, and for a job with
a ``notify``, which no poll reports, by a timer of the system at its deadline), the actor cancels
what the engine has not started — on the copy threads, the pieces no thread has taken —
and reports the job failed once what had started has finished, a few milliseconds
later. A job already fully enqueued on a CUDA stream cannot be cancelled: it is counted
``overdue`` (and logged) and reported when its event completes, done if its copies
succeeded. A device that never completes an event therefore leaves its job in flight,
visible in :class:`TransferStatistics`, rather than reported failed while it might
still write.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeAlias, assert_never

import anyio
import anyio.to_thread
import attrs

from .._errors import ActorStopped
from .._logging import get_logger
from ..actors import Actor, ActorRef, Reply, Timer
from ._completion import CompletionBridge
from ._copy import (
    Cancellable,
    Completion,
    CopyEngine,
    CopyJob,
    DeviceFenced,
    Direction,
    EndedCompletion,
    submit_batch,
)


@attrs.frozen(kw_only=True)
class JobResult:
    """A job that ended: ``ok`` with the bytes it moved, or (as :class:`JobFailed`) not."""

    job_id: int
    direction: Direction
    ok: bool
    error: str | None = None
    nbytes: int = 0
    seconds: float = 0.0
    num_blocks: int = 0


@attrs.frozen(kw_only=True)
class JobFailed(JobResult):
    """A job that failed: its engine blocks ``block_ids`` hold nothing valid (a load)
    or were not saved (a store). ``reason`` is one of ``rejected``, ``submit``,
    ``copy``, ``deadline``."""

    ok: bool = attrs.field(default=False, init=False)
    error: str
    block_ids: tuple[int, ...] = ()
    reason: str = "copy"


@attrs.frozen(kw_only=True)
class TransferStatistics:
    """A snapshot of one transfer actor's counters."""

    direction: Direction
    in_flight: int
    overdue: int
    """In flight past their deadline (cancelled where the engine can cancel)."""
    done: int
    failed: int
    bytes_moved: int


@attrs.frozen(kw_only=True)
class SubmitJob:
    """Start ``job``. ``compute``: the engine's mark (see ``capture_compute``), captured
    on the engine's thread. With ``notify``, the job's result answers it when the job
    ends (and no poll reports it)."""

    job: CopyJob
    compute: object | None = attrs.field(default=None, eq=False)
    notify: Reply[JobResult] | None = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen(kw_only=True)
class SubmitJobs:
    """Start ``jobs`` as one batch (one engine step, one direction); see :class:`SubmitJob`."""

    jobs: tuple[CopyJob, ...]
    compute: object | None = attrs.field(default=None, eq=False)


@attrs.frozen(kw_only=True)
class PollFinished:
    """Answer every job that ended since the last poll (and check deadlines)."""

    reply: Reply[list[JobResult]] = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class Flushed:
    """How :class:`FlushJobs` fenced each of its jobs (each job id is in one field)."""

    device_fenced: tuple[int, ...] = ()
    """Still in flight: the compute stream now waits on their events (no CPU wait)."""
    cpu_waited: tuple[int, ...] = ()
    """Waited for on the CPU until they ended (completions without a device fence)."""
    already_ended: tuple[int, ...] = ()
    """Ended before the flush, or not in flight in this actor: nothing to do."""
    cancelled: tuple[int, ...] = ()
    """Did not end within the flush's ``timeout_s``: what they had not started was
    dropped, and the flush waited for the rest (they end failed, reported by a poll)."""


@attrs.frozen(kw_only=True)
class FlushJobs:
    """Order the engine's next device work after ``job_ids`` (see the module docstring):
    a device fence where the completion has one, else a CPU wait until the job ended.
    The jobs are still reported by a later poll.

    A job the CPU waited for ``timeout_s`` without its end is cancelled (what it has not
    started is dropped; it ends failed, so a store is never visible) and waited for once
    more; fails with :class:`TimeoutError` only when even that does not end within
    ``timeout_s`` (device fences never wait).
    """

    job_ids: tuple[int, ...]
    timeout_s: float
    reply: Reply[Flushed] = attrs.field(eq=False, repr=False)
    compute: object | None = attrs.field(default=None, eq=False)
    """The engine's mark, captured on the engine's thread: its compute stream is the one
    fenced (default: the stream each job was ordered after)."""


@attrs.frozen(kw_only=True)
class GetStatistics:
    reply: Reply[TransferStatistics] = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class _Swept:
    """From the watcher: a completion it waited for has ended; collect what ended."""


@attrs.frozen(kw_only=True)
class _DeadlineDue:
    """From the system's timer: the earliest deadline of a job with a ``notify`` is due."""


@attrs.frozen(kw_only=True)
class _Watch:
    completion: Completion = attrs.field(eq=False)


TransferMsg: TypeAlias = (
    SubmitJob | SubmitJobs | PollFinished | FlushJobs | GetStatistics | _Swept | _DeadlineDue
)


class _Watcher(Actor[_Watch]):
    """Waits, in a worker thread, for each completion it is given (in order), and tells
    its owner when one ended. The owner's loop is woken by the thread's return."""

    def __init__(self, owner: ActorRef[TransferMsg]) -> None:
        self.owner = owner

    async def handle(self, msg: _Watch) -> None:
        if not _has_ended(msg.completion):
            await anyio.to_thread.run_sync(msg.completion.synchronize, abandon_on_cancel=True)
        try:
            # May wait for room: the owner never waits on this actor (see the module).
            await self.owner.tell(_Swept())
        except ActorStopped:
            pass  # the owner is gone, and its jobs with it: nobody left to wake


@attrs.define(eq=False)
class _InFlight:
    job: CopyJob
    started: float
    deadline: float
    overdue: bool = False


class TransferActor(Actor[TransferMsg]):
    """Submits one direction's jobs to a copy engine and reports them as they end.

    ``job_timeout_s`` is the default deadline of a job (``CopyJob.timeout_s``
    overrides it; None: no deadline). ``clock`` is injectable for tests.
    """

    mailbox_size = 1024
    direction: Direction

    def __init__(
        self,
        engine: CopyEngine,
        *,
        job_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.job_timeout_s = job_timeout_s
        self.bridge: CompletionBridge[int] = CompletionBridge()
        self._clock = clock
        self._jobs: dict[int, _InFlight] = {}
        self._ended: list[JobResult] = []
        self._notify: dict[int, Reply[JobResult]] = {}
        self._watcher: ActorRef[_Watch] | None = None
        self._to_watch: deque[Completion] = deque()
        """Completions the watcher had no room for yet, in order."""
        self._deadlines: list[tuple[float, int]] = []
        """(deadline, job id) of the jobs with a ``notify``: a heap, stale entries included."""
        self._deadline_timer: Timer | None = None
        self._deadline_armed = float("inf")
        self._done = 0
        self._failed = 0
        self._bytes = 0
        self._log = get_logger("kvferry.transfer", actor=type(self).__name__)

    async def handle(self, msg: TransferMsg) -> None:
        match msg:
            case SubmitJob(job=job, compute=compute, notify=notify):
                if notify is not None:
                    self._notify[job.job_id] = notify
                self._submit((job,), compute)
                flight = self._jobs.get(job.job_id)
                if notify is not None and flight is not None:
                    await self._watch(job.job_id)
                    if flight.deadline != float("inf"):
                        heapq.heappush(self._deadlines, (flight.deadline, job.job_id))
                        self._arm_deadline()
                self._answer_notified()
            case SubmitJobs(jobs=jobs, compute=compute):
                self._submit(jobs, compute)
            case _Swept():
                self._collect()
                self._hand_over()
                self._answer_notified()
                self._arm_deadline()
            case _DeadlineDue():
                self._deadline_armed = float("inf")
                self._collect()
                self._answer_notified()
                self._arm_deadline()
            case PollFinished(reply=reply):
                self._collect()
                self._answer_notified()
                ended, self._ended = self._ended, []
                reply.set(ended)
            case FlushJobs(job_ids=job_ids, timeout_s=timeout_s, reply=reply, compute=compute):
                reply.set(await self._flush(job_ids, timeout_s, compute))
            case GetStatistics(reply=reply):
                reply.set(self.statistics())
            case _:
                assert_never(msg)

    async def on_stop(self) -> None:
        await self._end_notified()
        for job_id, notify in self._notify.items():
            notify.fail(ActorStopped(f"{type(self).__name__} stopped before job {job_id} ended"))
        self._notify.clear()
        self._to_watch.clear()
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        if self._watcher is not None:
            # Nothing it waits for will be answered any more (stopped alone, not by the
            # system, its owner's end must not leave it waiting on completions).
            await self._watcher.stop(drain=False)

    async def _end_notified(self) -> None:
        """A graceful stop: the jobs someone waits on (a Ferry's store or load) end with
        their copies, not before. Failed while its copy still ran, a load would return to
        a caller whose blocks are still being written. Each is waited for until its
        deadline, then cancelled as a poll would, and what had started is waited for;
        the system's stop deadline bounds it all (the actor is then cancelled, and the
        Ferry fails those waits once its copy engine closed)."""
        for job_id in list(self._notify):
            flight = self._jobs.get(job_id)
            if flight is None:
                continue
            with anyio.move_on_after(max(0.0, flight.deadline - self._clock())):
                await self.bridge.wait(job_id)
            self._collect()  # cancels it if past its deadline
            if job_id in self._jobs:
                await self.bridge.wait(job_id)
                self._collect()
        self._answer_notified()

    def _submit(self, jobs: Sequence[CopyJob], compute: object | None) -> None:
        accepted: list[CopyJob] = []
        ids: set[int] = set()
        for job in jobs:
            if job.direction != self.direction:
                error = f"a {job.direction} job sent to the {self.direction} actor"
                self._fail(job, 0.0, error, "rejected")
            elif job.job_id in self._jobs or job.job_id in ids:
                self._fail(job, 0.0, f"job id {job.job_id} is already in flight", "rejected")
            else:
                accepted.append(job)
                ids.add(job.job_id)
        if not accepted:
            return
        try:
            completions = submit_batch(self.engine, accepted, compute)
        except Exception as exc:  # nothing was enqueued
            self._log.error("job_submit_failed", job_ids=sorted(ids), exc_info=exc)
            for job in accepted:
                self._fail(job, 0.0, repr(exc), "submit")
            return
        now = self._clock()
        for job, completion in zip(accepted, completions, strict=True):
            refused = completion.exception() if isinstance(completion, EndedCompletion) else None
            if refused is not None:
                self._log.error("job_submit_failed", job_id=job.job_id, error=repr(refused))
                self._fail(job, 0.0, repr(refused), "submit")
                continue
            timeout = job.timeout_s if job.timeout_s is not None else self.job_timeout_s
            deadline = now + timeout if timeout is not None else float("inf")
            self._jobs[job.job_id] = _InFlight(job=job, started=now, deadline=deadline)
            self.bridge.add(job.job_id, completion)

    async def _watch(self, job_id: int) -> None:
        completion = self.bridge.get(job_id)
        if completion is None:
            return
        if self._watcher is None:
            if not self.system.running:
                return  # stopping: the job ends with this actor (see on_stop)
            # A name of its own per instance: a factory-made actor restarted by its
            # supervisor starts a new watcher, and the old one's name stays taken.
            owner = self.ref
            restarts = owner.statistics().restarts
            name = f"{owner.name}.watcher" + (f".{restarts}" if restarts else "")
            self._watcher = await self.system.spawn(_Watcher(owner), name=name)
        self._to_watch.append(completion)
        self._hand_over()

    def _hand_over(self) -> None:
        """Give the watcher the completions it has room for, never waiting for room: it
        may be waiting for room in this actor's mailbox (a deadlock). What is kept goes
        over as its ``_Swept`` messages come back: kept ones mean a full watcher mailbox,
        and each ``_Watch`` queued there brings a ``_Swept``."""
        watcher = self._watcher
        queue = self._to_watch
        while queue and watcher is not None:
            try:
                watcher.tell_nowait(_Watch(completion=queue[0]))
            except anyio.WouldBlock:
                return
            except ActorStopped:
                # Stopped before this actor (the system stops the last spawned first):
                # these jobs end with this actor, failed by on_stop.
                queue.clear()
                return
            queue.popleft()

    def _arm_deadline(self) -> None:
        """Keep one timer of the system armed at the earliest deadline of a job with a
        ``notify`` (no poll checks those): it sends :class:`_DeadlineDue`."""
        heap = self._deadlines
        while heap:
            deadline, job_id = heap[0]
            flight = self._jobs.get(job_id)
            if flight is not None and not flight.overdue and flight.deadline == deadline:
                break
            heapq.heappop(heap)  # ended, or already past its deadline
        if not heap:
            return
        deadline = heap[0][0]
        timer = self._deadline_timer
        if timer is not None and timer.active and self._deadline_armed <= deadline:
            return
        if not self.system.running:
            return  # stopping: the system cancels timers, and the job ends with this actor
        if timer is not None:
            timer.cancel()
        self._deadline_armed = deadline
        delay = max(0.0, deadline - self._clock())
        self._deadline_timer = self.system.send_after(delay, self.ref, _DeadlineDue())

    def _answer_notified(self) -> None:
        """Hand ended jobs that someone is waiting for to their ``notify`` replies."""
        if not self._notify or not self._ended:
            return
        kept: list[JobResult] = []
        for result in self._ended:
            notify = self._notify.pop(result.job_id, None)
            if notify is None:
                kept.append(result)
            else:
                notify.set(result)
        self._ended = kept

    async def _flush(
        self, job_ids: tuple[int, ...], timeout_s: float, compute: object | None
    ) -> Flushed:
        fenced: list[int] = []
        waited: list[int] = []
        ended: list[int] = []
        for job_id in dict.fromkeys(job_ids):
            completion = self.bridge.get(job_id)
            if completion is None or _has_ended(completion):
                ended.append(job_id)
                continue
            if isinstance(completion, DeviceFenced):
                try:
                    completion.order_before_compute(compute)
                except Exception as exc:  # e.g. a sticky CUDA error: wait instead
                    self._log.warning("device_fence_failed", job_id=job_id, exc_info=exc)
                else:
                    fenced.append(job_id)
                    continue
            waited.append(job_id)
        cancelled: list[int] = []
        if waited:
            # A real wait (a thread in synchronize), so wall time, not self._clock.
            with anyio.move_on_after(timeout_s):
                for job_id in waited:
                    await self.bridge.wait(job_id)
            # Still running: the engine must not wait on it forever, nor write blocks it
            # still reads. Drop what it has not started (it ends failed: a store that is
            # never visible), and wait once more for what had started.
            for job_id in waited:
                completion = self.bridge.get(job_id)
                if completion is None or _has_ended(completion):
                    continue
                self._jobs[job_id].overdue = True
                if isinstance(completion, Cancellable):
                    completion.cancel()
                cancelled.append(job_id)
                self._log.warning("flush_cancelled_job", job_id=job_id, timeout_s=timeout_s)
            if cancelled:
                with anyio.fail_after(timeout_s):
                    for job_id in cancelled:
                        await self.bridge.wait(job_id)
        return Flushed(
            device_fenced=tuple(fenced),
            cpu_waited=tuple(j for j in waited if j not in cancelled),
            already_ended=tuple(ended),
            cancelled=tuple(cancelled),
        )

    def _collect(self) -> None:
        self._check_deadlines()
        now = self._clock()
        for job_id, error in self.bridge.poll():
            flight = self._jobs.pop(job_id)
            seconds = now - flight.started
            if error is None:
                if flight.overdue:
                    self._log.warning("job_completed_late", job_id=job_id, seconds=seconds)
                try:
                    nbytes = self.engine.job_bytes(flight.job)
                except Exception as exc:
                    # The copy ended but the engine (a user's, through the copy_engine
                    # hook) cannot account for it: trust none of the job's bytes. It fails
                    # (a load's blocks are recomputed, a store's slot freed) and the poll
                    # goes on, so no other ended job is lost and the engine keeps running.
                    self._log.error("job_accounting_failed", job_id=job_id, exc_info=exc)
                    self._fail(flight.job, seconds, repr(exc), "engine")
                    continue
                self._done += 1
                self._bytes += nbytes
                self._ended.append(
                    JobResult(
                        job_id=job_id,
                        direction=flight.job.direction,
                        ok=True,
                        nbytes=nbytes,
                        seconds=seconds,
                        num_blocks=flight.job.num_blocks,
                    )
                )
                continue
            reason = "deadline" if flight.overdue else "copy"
            self._log.error("job_failed", job_id=job_id, reason=reason, error=repr(error))
            text = repr(error)
            if flight.overdue and now >= flight.deadline:
                timeout = flight.deadline - flight.started
                text = f"cancelled past its deadline ({timeout:g} s): {text}"
            self._fail(flight.job, seconds, text, reason)

    def _check_deadlines(self) -> None:
        now = self._clock()
        for job_id, flight in self._jobs.items():
            if flight.overdue or now < flight.deadline:
                continue
            flight.overdue = True
            completion = self.bridge.get(job_id)
            cancellable = isinstance(completion, Cancellable)
            self._log.warning(
                "job_deadline_exceeded",
                job_id=job_id,
                seconds=now - flight.started,
                cancelled=cancellable,
            )
            if isinstance(completion, Cancellable):
                completion.cancel()

    def _fail(self, job: CopyJob, seconds: float, error: str, reason: str) -> None:
        self._failed += 1
        self._ended.append(
            JobFailed(
                job_id=job.job_id,
                direction=job.direction,
                error=error,
                seconds=seconds,
                num_blocks=job.num_blocks,
                block_ids=job.block_ids,
                reason=reason,
            )
        )

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def statistics(self) -> TransferStatistics:
        return TransferStatistics(
            direction=self.direction,
            in_flight=len(self._jobs),
            overdue=sum(f.overdue for f in self._jobs.values()),
            done=self._done,
            failed=self._failed,
            bytes_moved=self._bytes,
        )


def _has_ended(completion: Completion) -> bool:
    try:
        return completion.query()
    except Exception:  # a query that raises has ended (with that error), as in the bridge
        return True


class StoreActor(TransferActor):
    """Device → host."""

    direction = "store"


class LoadActor(TransferActor):
    """Host → device."""

    direction = "load"
