"""Copy jobs and the interface of the copy engines that run them.

A :class:`CopyJob` moves engine blocks between the engine's KV tensors (described by a
:class:`~kvferry.transfer.KVLayout`) and host rows of the
:class:`~kvferry.transfer.HostPool`. A copy engine's ``submit`` starts a job and returns
a :class:`Completion`, which the completion bridge turns into an awaitable. Engines:

- :class:`~kvferry.transfer.ThreadCopyEngine` (``_threads.py``): the CPU path, a pool of
  copy threads running batched copy plans, loads before stores;
- :class:`~kvferry.transfer.CudaCopyEngine` (``_cuda.py``): a side stream per direction,
  pinned host memory, an event per job; its completions are :class:`DeviceFenced` (the
  compute stream can be made to wait on a job's event instead of the CPU).

The contract every engine keeps: a job's completion ends only when nothing of that job
can still write (a failed or cancelled load may be recomputed into the same blocks as
soon as it is reported; a failed store's host slot is reused as soon as it is reported).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

import attrs
import numpy as np
import numpy.typing as npt

from .._errors import TransferError
from ._kernel import batch_kernel
from ._layout import KVLayout
from ._plan import check_job, plan_job
from ._pool import HostPool

Direction = Literal["store", "load"]


class JobCancelled(TransferError):
    """A job was stopped before all of it was copied (its deadline passed, or the
    engine closed); what it wrote is incomplete."""


def _i64(a: npt.ArrayLike) -> npt.NDArray[np.int64]:
    view = np.ascontiguousarray(a, dtype=np.int64).reshape(-1).view()
    view.flags.writeable = False
    return view


@attrs.frozen(kw_only=True)
class GroupBlocks:
    """Engine blocks of one KV-cache group and the host rows they pair with."""

    group: int
    device_blocks: npt.NDArray[np.int64] = attrs.field(converter=_i64, eq=False)
    host_rows: npt.NDArray[np.int64] = attrs.field(converter=_i64, eq=False)

    def __attrs_post_init__(self) -> None:
        if self.device_blocks.shape != self.host_rows.shape:
            raise ValueError("device_blocks and host_rows differ in length")


@attrs.frozen(kw_only=True)
class CopyJob:
    """One transfer: every pair of every part moves in ``direction``.

    ``timeout_s`` overrides the actor's default deadline for this job.
    """

    job_id: int
    direction: Direction
    parts: tuple[GroupBlocks, ...]
    timeout_s: float | None = None

    @property
    def num_blocks(self) -> int:
        return sum(len(p.device_blocks) for p in self.parts)

    @property
    def block_ids(self) -> tuple[int, ...]:
        """The engine blocks the job touches, sorted, each once."""
        if not self.parts:
            return ()
        blocks = np.unique(np.concatenate([p.device_blocks for p in self.parts]))
        return tuple(int(b) for b in blocks)


class Completion(Protocol):
    """What the completion bridge needs of a running job (a CUDA event, a thread job)."""

    def query(self) -> bool:
        """True once the job has ended (done or failed); never blocks."""

    def synchronize(self) -> None:
        """Block until the job has ended."""

    def exception(self) -> BaseException | None:
        """The job's error once it has ended, else None."""


@runtime_checkable
class Cancellable(Protocol):
    """A completion whose not-yet-started work can be dropped."""

    def cancel(self) -> None:
        """Drop what has not started. The completion still ends only once what had
        started has finished, with :class:`JobCancelled` if anything was dropped."""


@runtime_checkable
class DeviceFenced(Protocol):
    """A completion that can order the engine's later device work after its job without
    a CPU wait (on CUDA: the compute stream waits on the job's event).

    :class:`~kvferry.transfer.StoreActor` uses it to flush a store whose device blocks
    the engine is about to reuse; completions without it are waited for on the CPU.
    """

    def order_before_compute(self, mark: object | None = None) -> None:
        """Make work enqueued afterwards on the engine's compute stream (``mark``'s, from
        the engine's ``capture_compute``; default: the stream the job was ordered after)
        run only once this job's copies have finished; returns at once (the job may
        still run)."""


class CopyEngine(Protocol):
    """Runs jobs. ``submit`` is called from one thread (the transfer actors' loop);
    it raises only when nothing of the job was started.

    Engines may also offer ``submit_batch(jobs, compute)`` (all of a step's jobs of one
    direction at once: one plan, one launch) and ``capture_compute()`` (where the
    engine's compute stands, captured on the engine's thread); :func:`submit_batch` and
    :func:`capture_compute` fall back to one ``submit`` per job and to no mark.
    """

    def submit(self, job: CopyJob) -> Completion: ...

    def job_bytes(self, job: CopyJob) -> int: ...

    def close(self) -> None: ...


class EndedCompletion:
    """A :class:`Completion` that has already ended (with ``error``, or done)."""

    __slots__ = ("_error",)

    def __init__(self, error: BaseException | None) -> None:
        self._error = error

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def exception(self) -> BaseException | None:
        return self._error


def capture_compute(engine: CopyEngine) -> object | None:
    """The engine's mark of where its compute stands (a CUDA engine: an event recorded
    on the calling thread's current stream), or None for engines without one. Call it on
    the thread that runs the engine's forward, inside the engine's call."""
    capture = getattr(engine, "capture_compute", None)
    return capture() if callable(capture) else None


def submit_batch(
    engine: CopyEngine, jobs: Sequence[CopyJob], compute: object | None = None
) -> list[Completion]:
    """Submit ``jobs`` as one batch where the engine can, else one by one; a completion
    per job, in order. A job the engine refuses gets a completion ended with the error."""
    batch = getattr(engine, "submit_batch", None)
    if callable(batch):
        completions: list[Completion] = batch(jobs, compute)
        return completions
    out: list[Completion] = []
    for job in jobs:
        try:
            out.append(engine.submit(job))
        except Exception as exc:
            out.append(EndedCompletion(exc))
    return out


def job_bytes(layout: KVLayout, job: CopyJob) -> int:
    """Bytes ``job`` moves (every pair, the row bytes of its group)."""
    return sum(len(p.device_blocks) * layout.groups[p.group].row_bytes for p in job.parts)


class FutureCompletion:
    """A :class:`Completion` over a ``concurrent.futures.Future``."""

    __slots__ = ("_future",)

    def __init__(self, future: concurrent.futures.Future[object]) -> None:
        self._future = future

    def query(self) -> bool:
        return self._future.done()

    def synchronize(self) -> None:
        concurrent.futures.wait([self._future])

    def exception(self) -> BaseException | None:
        if not self._future.done():
            return None
        return self._future.exception()


def copy_job(layout: KVLayout, pool: HostPool, job: CopyJob) -> int:
    """Run ``job`` now and return the bytes moved, once the copies are done (on CUDA,
    ordered after the calling thread's current stream, through a one-off engine)."""
    check_job(layout, job, pool.rows.shape[0], pool.row_bytes)
    if layout.device.type == "cpu":
        _, kernel = batch_kernel()
        plan = plan_job(layout, job, pool.rows.data_ptr(), pool.rows.stride(0))
        kernel(plan.dsts, plan.srcs, plan.sizes)
        return plan.nbytes
    from ._cuda import CudaCopyEngine

    # waited for at once: enqueued by this thread, no issue thread to start
    engine = CudaCopyEngine(
        layout, pool, issue="inline", staging_bytes=max(job.num_blocks, 1) * pool.row_bytes
    )
    try:
        completion = engine.submit(job)
        completion.synchronize()
        error = completion.exception()
    finally:
        engine.close()
    if error is not None:
        raise TransferError(f"job {job.job_id} failed: {error!r}") from error
    return job_bytes(layout, job)


def new_copy_engine(
    layout: KVLayout,
    pool: HostPool,
    *,
    num_threads: int | None = None,
    piece_bytes: int | None = None,
    staging_bytes: int | None = None,
) -> CopyEngine:
    """The copy engine for the layout's device: CUDA streams + events, or copy threads.

    ``num_threads`` and ``piece_bytes`` tune the CPU engine, ``staging_bytes`` the CUDA
    one (device memory it keeps per direction); ``None`` takes each engine's default.
    """
    if layout.device.type == "cuda":
        from ._cuda import CudaCopyEngine

        if staging_bytes is None:
            return CudaCopyEngine(layout, pool)
        return CudaCopyEngine(layout, pool, staging_bytes=staging_bytes)
    from ._threads import DEFAULT_PIECE_BYTES, ThreadCopyEngine

    return ThreadCopyEngine(
        layout, pool, num_threads=num_threads, piece_bytes=piece_bytes or DEFAULT_PIECE_BYTES
    )
