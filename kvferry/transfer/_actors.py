"""StoreActor (device → host) and LoadActor (host → device).

Who sends what: the worker-side facade tells ``SubmitJob`` for each job of an engine
step and asks ``PollFinished`` once per step; ``FlushJobs`` waits until given jobs have
ended (before the engine reuses blocks a store still reads). Each actor owns its copy
engine's completions for its direction; nothing else touches them.

A job always ends: done, or failed with its error (a failed submission, a copy error) —
reported as a :class:`JobResult`, never asserted.
"""

from __future__ import annotations

import time
from typing import TypeAlias, assert_never

import attrs

from ..actors import Actor, Reply
from .._logging import get_logger
from ._completion import CompletionBridge
from ._copy import CopyEngine, CopyJob, Direction


@attrs.frozen(kw_only=True)
class JobResult:
    job_id: int
    direction: Direction
    ok: bool
    error: str | None = None
    nbytes: int = 0
    seconds: float = 0.0
    num_blocks: int = 0


@attrs.frozen(kw_only=True)
class SubmitJob:
    job: CopyJob


@attrs.frozen(kw_only=True)
class PollFinished:
    """Answer every job that ended since the last poll."""

    reply: Reply[list[JobResult]] = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class FlushJobs:
    """Wait until ``job_ids`` have ended (they are reported by the next poll)."""

    job_ids: tuple[int, ...]
    timeout_s: float
    reply: Reply[None] = attrs.field(eq=False, repr=False)


TransferMsg: TypeAlias = SubmitJob | PollFinished | FlushJobs


class TransferActor(Actor[TransferMsg]):
    """Submits one direction's jobs to a copy engine and reports them as they end."""

    mailbox_size = 1024
    direction: Direction

    def __init__(self, engine: CopyEngine) -> None:
        self.engine = engine
        self.bridge: CompletionBridge[int] = CompletionBridge()
        self._jobs: dict[int, tuple[CopyJob, float]] = {}
        self._ended: list[JobResult] = []
        self._log = get_logger("kvferry.transfer", actor=type(self).__name__)

    async def handle(self, msg: TransferMsg) -> None:
        match msg:
            case SubmitJob(job=job):
                self._submit(job)
            case PollFinished(reply=reply):
                self._collect()
                ended, self._ended = self._ended, []
                reply.set(ended)
            case FlushJobs(job_ids=job_ids, timeout_s=timeout_s, reply=reply):
                with_deadline = time.perf_counter() + timeout_s
                for job_id in job_ids:
                    left = max(0.0, with_deadline - time.perf_counter())
                    await self.bridge.wait(job_id, timeout=left)
                reply.set(None)
            case _:
                assert_never(msg)

    def _submit(self, job: CopyJob) -> None:
        assert job.direction == self.direction, (job.direction, self.direction)
        try:
            completion = self.engine.submit(job)
        except Exception as exc:
            self._log.error("job_submit_failed", job_id=job.job_id, exc_info=exc)
            self._ended.append(self._result(job, 0.0, exc))
            return
        self._jobs[job.job_id] = (job, time.perf_counter())
        self.bridge.add(job.job_id, completion)

    def _collect(self) -> None:
        now = time.perf_counter()
        for job_id, error in self.bridge.poll():
            job, t0 = self._jobs.pop(job_id)
            if error is not None:
                self._log.error("job_failed", job_id=job_id, error=repr(error))
            self._ended.append(self._result(job, now - t0, error))

    def _result(self, job: CopyJob, seconds: float, error: BaseException | None) -> JobResult:
        return JobResult(
            job_id=job.job_id,
            direction=job.direction,
            ok=error is None,
            error=None if error is None else repr(error),
            nbytes=0 if error is not None else self.engine.job_bytes(job),
            seconds=seconds,
            num_blocks=job.num_blocks,
        )

    @property
    def in_flight(self) -> int:
        return len(self._jobs)


class StoreActor(TransferActor):
    """Device → host."""

    direction = "store"


class LoadActor(TransferActor):
    """Host → device."""

    direction = "load"
