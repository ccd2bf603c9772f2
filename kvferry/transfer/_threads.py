"""The CPU copy engine: a pool of copy threads running batched copy plans.

``submit`` (on the transfer actors' loop thread) checks the job, plans it
(:mod:`._plan`) and queues its pieces; it raises only when nothing was queued. Copy
threads take pieces — loads before stores, each direction first in first out — and run
each with one call of the batched kernel (:mod:`._kernel`, which releases the GIL), so
one large job spreads over every thread, and several jobs of both directions share the
memory bandwidth.

Loads go first because a request waits on them; stores only delay when a block becomes
visible. So that a stream of loads cannot starve stores, one store piece is taken after
every :data:`LOAD_BURST` load pieces while stores wait.

Between two pieces a copy thread runs a little Python, so it needs the GIL: while
another thread computes in Python, it may wait up to ``sys.getswitchinterval()`` (5 ms)
for it. Pieces are large (:data:`DEFAULT_PIECE_BYTES`) so that this happens rarely;
planning runs on the submitting thread, not on the copy threads, for the same reason.

Who owns what: the queues and every :class:`ThreadJob`'s counters are guarded by the
engine's condition variable; a piece's bytes are touched only by the thread that took
it. A job's completion ends when its last piece has finished or been dropped, so when
it ends nothing of the job can still write.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable

import attrs

from .._logging import get_logger
from ._copy import CopyJob, Direction, JobCancelled, job_bytes
from ._kernel import BatchKernel, batch_kernel
from ._layout import KVLayout
from ._plan import Plan, check_job, plan_job, split_plan
from ._pool import HostPool

LOAD_BURST = 4
DEFAULT_PIECE_BYTES = 8 << 20
"""Big enough that a copy thread takes the GIL rarely (between pieces it runs Python),
small enough to spread one large job over every thread and to cancel it promptly."""


def default_num_threads() -> int:
    """Copy threads shared by both directions: one per core we may use, at least two
    (a load never waits behind a store's piece) and at most four (memory bandwidth, not
    cores, is the limit)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 2
    return max(2, min(4, cores))


class ThreadJob:
    """The :class:`~kvferry.transfer.Completion` of one job on the copy threads.

    Ends once every piece has run or been dropped; its error is the first piece's
    error, else :class:`JobCancelled` if :meth:`cancel` dropped a piece.
    """

    def __init__(self, job_id: int, pieces: int, on_cancel: Callable[[ThreadJob], None]) -> None:
        self.job_id = job_id
        self._left = pieces
        self._on_cancel = on_cancel
        self._cancelled = False
        self._dropped = 0
        self._error: BaseException | None = None
        self._done = threading.Event()
        if pieces == 0:
            self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()

    def exception(self) -> BaseException | None:
        if not self._done.is_set():
            return None
        if self._error is not None:
            return self._error
        if self._dropped:
            return JobCancelled(
                f"job {self.job_id}: cancelled with {self._dropped} pieces not copied"
            )
        return None

    def cancel(self) -> None:
        """Drop the pieces no thread has taken; the job ends once running ones finish."""
        self._on_cancel(self)

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def _piece_ended(self, error: BaseException | None = None, *, dropped: bool = False) -> None:
        """Called with the engine's lock held."""
        if error is not None and self._error is None:
            self._error = error
        self._dropped += dropped
        self._left -= 1
        if self._left == 0:
            self._done.set()


@attrs.define(eq=False)
class _Piece:
    job: ThreadJob
    plan: Plan


class ThreadCopyEngine:
    """The CPU path: ``num_threads`` copy threads (at least one; None:
    :func:`default_num_threads`), jobs cut into pieces of about ``piece_bytes``, run by
    ``kernel`` (``"auto"``, ``"jit"``, ``"memmove"`` — see
    :func:`~kvferry.transfer._kernel.batch_kernel` — or a kernel function)."""

    def __init__(
        self,
        layout: KVLayout,
        pool: HostPool,
        *,
        num_threads: int | None = None,
        piece_bytes: int = DEFAULT_PIECE_BYTES,
        kernel: str | BatchKernel = "auto",
    ) -> None:
        if piece_bytes <= 0:
            raise ValueError(f"piece_bytes must be > 0, got {piece_bytes}")
        # With no copy thread, a submitted job would never end.
        if num_threads is not None and (
            isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1
        ):
            raise ValueError(
                f"num_threads must be a whole number >= 1 (None: the default), got {num_threads!r}"
            )
        self.layout = layout
        self.pool = pool
        self.piece_bytes = piece_bytes
        if callable(kernel):  # tests inject one that records or blocks
            self.kernel_name, self._kernel = getattr(kernel, "__name__", "custom"), kernel
        else:
            self.kernel_name, self._kernel = batch_kernel(kernel)
        self.num_threads = default_num_threads() if num_threads is None else num_threads
        self._cv = threading.Condition()
        self._queues: dict[Direction, collections.deque[_Piece]] = {
            "load": collections.deque(),
            "store": collections.deque(),
        }
        self._load_streak = 0
        self._closed = False
        self._threads = [
            threading.Thread(
                target=self._work, args=(self._kernel,), name=f"kvferry-copy-{i}", daemon=True
            )
            for i in range(self.num_threads)
        ]
        for t in self._threads:
            t.start()
        get_logger("kvferry.transfer").debug(
            "copy_engine_started",
            engine="threads",
            threads=self.num_threads,
            kernel=self.kernel_name,
            piece_bytes=piece_bytes,
            **layout.describe(),
        )

    def job_bytes(self, job: CopyJob) -> int:
        return job_bytes(self.layout, job)

    def submit(self, job: CopyJob) -> ThreadJob:
        """Queue ``job``; raises (copying nothing) if it names blocks or rows that do
        not exist, or if the engine is closed."""
        rows = self.pool.rows
        check_job(self.layout, job, rows.shape[0], self.pool.row_bytes)
        plan = plan_job(self.layout, job, rows.data_ptr(), rows.stride(0))
        pieces = split_plan(plan, self.piece_bytes)
        with self._cv:
            if self._closed:
                raise RuntimeError("the copy engine is closed")
            completion = ThreadJob(job.job_id, len(pieces), self._cancel)
            queue = self._queues[job.direction]
            queue.extend(_Piece(job=completion, plan=p) for p in pieces)
            self._cv.notify(len(pieces))
        return completion

    def _cancel(self, job: ThreadJob) -> None:
        with self._cv:
            job._cancelled = True
            for queue in self._queues.values():
                if any(p.job is job for p in queue):
                    kept = [p for p in queue if p.job is not job]
                    for _ in range(len(queue) - len(kept)):
                        job._piece_ended(dropped=True)
                    queue.clear()
                    queue.extend(kept)

    def _next(self) -> _Piece | None:
        """The next piece to run, or None once closed and drained (lock held)."""
        loads, stores = self._queues["load"], self._queues["store"]
        while not (loads or stores or self._closed):
            self._cv.wait()
        if loads and (not stores or self._load_streak < LOAD_BURST):
            self._load_streak += 1
            return loads.popleft()
        if stores:
            self._load_streak = 0
            return stores.popleft()
        return None

    def _work(self, kernel: BatchKernel) -> None:
        while True:
            with self._cv:
                piece = self._next()
                if piece is None:
                    return
                if piece.job.cancelled:
                    piece.job._piece_ended(dropped=True)
                    continue
            error: BaseException | None = None
            try:
                kernel(piece.plan.dsts, piece.plan.srcs, piece.plan.sizes)
            except BaseException as exc:  # reported through the job, never lost
                error = exc
            with self._cv:
                piece.job._piece_ended(error)

    def pending_pieces(self) -> int:
        """Pieces queued and not yet taken by a copy thread."""
        with self._cv:
            return sum(len(q) for q in self._queues.values())

    def close(self) -> None:
        """Drop queued pieces (their jobs end cancelled), wait for running ones, stop."""
        with self._cv:
            self._closed = True
            for queue in self._queues.values():
                while queue:
                    queue.popleft().job._piece_ended(dropped=True)
            self._cv.notify_all()
        for t in self._threads:
            t.join()
