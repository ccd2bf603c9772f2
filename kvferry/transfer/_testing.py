"""Failure injection for the copy engines (re-exported by :mod:`kvferry.testing`).

:class:`FaultyCopyEngine` wraps a real engine and damages chosen jobs, deterministically:
the N-th, 2N-th, … job of a direction, counted in submission order. Modes:

- ``"fail"``: the job runs, then its destination is overwritten with garbage and it is
  reported failed. A consumer that ignored the failure would serve garbage, so an
  end-to-end test whose outputs still match proves the failure was honoured (the
  blocks of a failed load recomputed, a failed store never made visible).
- ``"corrupt"``: the same garbage, reported as success: the negative control, showing
  that a comparison of outputs does catch bad KV.
- ``"reject"``: ``submit`` raises, nothing is copied.

Damage is applied once the wrapped job has ended (never while its copy can still
write), on the thread that first sees it end. The factories at the bottom have the
shape ``factory(layout, pool) -> CopyEngine``, for a ``"module:factory"`` config key.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Literal

import attrs
import numpy as np
import torch

from .._errors import TransferError
from ._access import KVBlockAccess
from ._copy import (
    Cancellable,
    Completion,
    CopyEngine,
    CopyJob,
    Direction,
    JobCancelled,
    new_copy_engine,
)
from ._layout import KVLayout
from ._pool import HostPool

FaultMode = Literal["fail", "corrupt", "reject"]
GARBAGE_BYTE = 0x3F
"""What damaged bytes are set to: a finite number in bf16, fp16, fp32 and fp8 alike, so a
model fed it produces wrong tokens rather than NaNs."""


class InjectedFault(TransferError):
    """The error a :class:`FaultyCopyEngine` reports for a job it failed on purpose."""


@attrs.frozen(kw_only=True)
class Fault:
    """Damage every ``every``-th job of ``direction`` (the ``every``-th, ``2*every``-th, …)."""

    direction: Direction
    every: int = 1
    mode: FaultMode = "fail"

    def __attrs_post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"every must be >= 1, got {self.every}")


class _FaultyCompletion:
    """Ends with the wrapped completion; applies the damage once, then reports."""

    def __init__(
        self, inner: Completion, damage: Callable[[], None], error: BaseException | None
    ) -> None:
        self._inner = inner
        self._damage: Callable[[], None] | None = damage
        self._error = error
        self._lock = threading.Lock()

    def _apply(self) -> None:
        with self._lock:
            if self._damage is not None:
                damage, self._damage = self._damage, None
                damage()

    def query(self) -> bool:
        if not self._inner.query():
            return False
        self._apply()
        return True

    def synchronize(self) -> None:
        self._inner.synchronize()
        self._apply()

    def exception(self) -> BaseException | None:
        if not self.query():
            return None
        return self._inner.exception() or self._error

    def cancel(self) -> None:
        if isinstance(self._inner, Cancellable):
            self._inner.cancel()


@attrs.define(eq=False)
class FaultyCopyEngine:
    """A :class:`~kvferry.transfer.CopyEngine` that damages the jobs ``faults`` pick.

    ``injected`` lists ``(job_id, mode)`` of every job damaged so far, in order.
    """

    inner: CopyEngine
    layout: KVLayout
    pool: HostPool
    faults: Sequence[Fault]
    injected: list[tuple[int, FaultMode]] = attrs.field(factory=list)
    _counts: dict[str, int] = attrs.field(factory=dict)

    def _fault_for(self, job: CopyJob) -> Fault | None:
        n = self._counts[job.direction] = self._counts.get(job.direction, 0) + 1
        for fault in self.faults:
            if fault.direction == job.direction and n % fault.every == 0:
                return fault
        return None

    def submit(self, job: CopyJob) -> Completion:
        fault = self._fault_for(job)
        if fault is None:
            return self.inner.submit(job)
        self.injected.append((job.job_id, fault.mode))
        if fault.mode == "reject":
            raise InjectedFault(f"injected: {job.direction} job {job.job_id} rejected")
        completion = self.inner.submit(job)
        error = InjectedFault(f"injected: {job.direction} job {job.job_id} failed")
        return _FaultyCompletion(
            completion, lambda: self._garble(job), error if fault.mode == "fail" else None
        )

    def _garble(self, job: CopyJob) -> None:
        for part in job.parts:
            n = len(part.device_blocks)
            if job.direction == "load":
                access = KVBlockAccess(self.layout, group=part.group)
                garbage = torch.full((n, access.row_bytes), GARBAGE_BYTE, dtype=torch.uint8)
                access.write_blocks(part.device_blocks, garbage)
            else:
                rows = torch.as_tensor(np.array(part.host_rows))
                self.pool.rows[rows] = GARBAGE_BYTE

    def job_bytes(self, job: CopyJob) -> int:
        return self.inner.job_bytes(job)

    def close(self) -> None:
        self.inner.close()


def faulty_engine_factory(*faults: Fault) -> Callable[[KVLayout, HostPool], FaultyCopyEngine]:
    """A ``factory(layout, pool)`` that wraps the default engine with ``faults``."""

    def factory(layout: KVLayout, pool: HostPool) -> FaultyCopyEngine:
        return FaultyCopyEngine(
            inner=new_copy_engine(layout, pool), layout=layout, pool=pool, faults=faults
        )

    return factory


fail_every_load = faulty_engine_factory(Fault(direction="load", every=1))
"""Every load fails (after garbling its blocks): every hit is recomputed."""
fail_every_2nd_load = faulty_engine_factory(Fault(direction="load", every=2))
fail_every_3rd_load = faulty_engine_factory(Fault(direction="load", every=3))
reject_every_2nd_load = faulty_engine_factory(Fault(direction="load", every=2, mode="reject"))
fail_every_2nd_store = faulty_engine_factory(Fault(direction="store", every=2))
"""Every second store fails (after garbling its host rows): those blocks never become hits."""
corrupt_every_load = faulty_engine_factory(Fault(direction="load", every=1, mode="corrupt"))
"""Negative control: every load garbled and reported ok — outputs must differ."""
corrupt_every_store = faulty_engine_factory(Fault(direction="store", every=1, mode="corrupt"))


class ManualCompletion:
    """A :class:`~kvferry.transfer.Completion` a test ends by hand, from any thread.

    Unlike :class:`kvferry.testing.FakeCudaEvent`, ``synchronize`` really blocks until
    :meth:`fire` (for the waiter-thread strategy), and it is cancellable: ``cancel``
    is recorded, and ends the completion with :class:`~kvferry.transfer.JobCancelled`
    when ``cancel_ends`` (nothing of the job was running).
    """

    def __init__(self, *, cancel_ends: bool = False) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.cancel_ends = cancel_ends
        self.cancelled = False

    def fire(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()

    def exception(self) -> BaseException | None:
        return self._error if self._done.is_set() else None

    def cancel(self) -> None:
        self.cancelled = True
        if self.cancel_ends and not self._done.is_set():
            self.fire(JobCancelled("cancelled before it started"))


@attrs.define(eq=False)
class ManualCopyEngine:
    """A copy engine that copies nothing: each job gets a :class:`ManualCompletion`."""

    cancel_ends: bool = False
    submitted: list[CopyJob] = attrs.field(factory=list)
    completions: dict[int, ManualCompletion] = attrs.field(factory=dict)

    def submit(self, job: CopyJob) -> ManualCompletion:
        self.submitted.append(job)
        completion = self.completions[job.job_id] = ManualCompletion(cancel_ends=self.cancel_ends)
        return completion

    def job_bytes(self, job: CopyJob) -> int:
        return job.num_blocks

    def close(self) -> None:
        pass
