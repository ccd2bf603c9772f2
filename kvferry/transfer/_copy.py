"""Copy jobs and the copy engines that run them.

A :class:`CopyJob` moves engine blocks between the engine's KV tensors (described by a
:class:`~kvferry.transfer.KVLayout`) and host rows of the :class:`HostPool`. A copy
engine's ``submit`` starts a job and returns a :class:`Completion`, which the completion
bridge turns into an awaitable. :class:`ThreadCopyEngine` is the CPU path: one copy
thread per direction (torch copies release the GIL), so both directions move at once and
the jobs of one direction finish in order. The CUDA path is in ``_cuda.py``.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Literal, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from ._layout import KVLayout
from ._pool import HostPool

Direction = Literal["store", "load"]


def _i64(a: npt.ArrayLike) -> npt.NDArray[np.int64]:
    view = np.ascontiguousarray(a, dtype=np.int64).view()
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
    job_id: int
    direction: Direction
    parts: tuple[GroupBlocks, ...]

    @property
    def num_blocks(self) -> int:
        return sum(len(p.device_blocks) for p in self.parts)


class Completion(Protocol):
    """What the completion bridge needs of a running job (a CUDA event, a thread future)."""

    def query(self) -> bool:
        """True once the job has ended (done or failed); never blocks."""

    def synchronize(self) -> None:
        """Block until the job has ended."""

    def exception(self) -> BaseException | None:
        """The job's error once it has ended, else None."""


class CopyEngine(Protocol):
    def submit(self, job: CopyJob) -> Completion: ...

    def job_bytes(self, job: CopyJob) -> int: ...

    def close(self) -> None: ...


def _runs(dev: npt.NDArray[np.int64], rows: npt.NDArray[np.int64]) -> list[tuple[int, int, int]]:
    """Split block pairs into maximal runs where both sides are consecutive: (dev, row, n)."""
    if len(dev) == 0:
        return []
    breaks = np.flatnonzero((np.diff(dev) != 1) | (np.diff(rows) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(dev)]))
    return [(int(dev[s]), int(rows[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]


def copy_job(layout: KVLayout, pool: HostPool, job: CopyJob, *, non_blocking: bool = False) -> int:
    """Run ``job`` with torch copies (on the current stream, on CUDA); returns bytes moved."""
    nbytes = 0
    rows_t = pool.rows
    num_rows = rows_t.shape[0]
    for part in job.parts:
        group = layout.groups[part.group]
        if len(part.host_rows) and (part.host_rows.min() < 0 or part.host_rows.max() >= num_rows):
            raise IndexError(f"job {job.job_id}: host rows outside the pool (0..{num_rows - 1})")
        dev_blocks = part.device_blocks
        if len(dev_blocks) and (dev_blocks.min() < 0 or dev_blocks.max() >= layout.num_blocks):
            raise IndexError(f"job {job.job_id}: device blocks outside 0..{layout.num_blocks - 1}")
        for d0, r0, n in _runs(part.device_blocks, part.host_rows):
            for seg in group.segments:
                dev = seg.view[d0 : d0 + n]
                host = rows_t[r0 : r0 + n, seg.offset : seg.offset + seg.nbytes]
                if job.direction == "store":
                    host.copy_(dev, non_blocking=non_blocking)
                else:
                    dev.copy_(host, non_blocking=non_blocking)
                nbytes += n * seg.nbytes
    return nbytes


class FutureCompletion:
    """A :class:`Completion` over a thread's ``concurrent.futures.Future``."""

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


class ThreadCopyEngine:
    """The CPU path: one copy thread per direction."""

    def __init__(self, layout: KVLayout, pool: HostPool) -> None:
        self.layout = layout
        self.pool = pool
        self._threads = {
            "store": concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvferry-store"),
            "load": concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvferry-load"),
        }

    def job_bytes(self, job: CopyJob) -> int:
        return sum(
            len(p.device_blocks) * self.layout.groups[p.group].row_bytes for p in job.parts
        )

    def _run(self, job: CopyJob) -> float:
        t0 = time.perf_counter()
        copy_job(self.layout, self.pool, job)
        return time.perf_counter() - t0

    def submit(self, job: CopyJob) -> Completion:
        return FutureCompletion(self._threads[job.direction].submit(self._run, job))

    def close(self) -> None:
        for pool in self._threads.values():
            pool.shutdown(wait=True)


def new_copy_engine(layout: KVLayout, pool: HostPool) -> CopyEngine:
    """The copy engine for the layout's device: CUDA streams + events, or copy threads."""
    if layout.device.type == "cuda":
        from ._cuda import CudaCopyEngine

        return CudaCopyEngine(layout, pool)
    return ThreadCopyEngine(layout, pool)


