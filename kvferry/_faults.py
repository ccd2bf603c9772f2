"""Seeded fault injection for the soak (``benchmarks/soak.py``); re-exported by
:mod:`kvferry.testing`.

:class:`SoakFaultEngine` wraps the real copy engine. For each job, in the order the
transfer actors submit them, it draws from a seeded RNG whether to damage it, and how:

- ``"fail"``: the job runs, then its destination is garbled and it is reported failed;
- ``"hang"``: the job runs and is garbled, then its completion does not end until the
  transfer actor cancels it (its deadline passed) or ``hang_s`` seconds went by; either
  way it ends failed;
- ``"reject"``: ``submit`` raises a plain ``RuntimeError`` (not a kvferry error: an
  unexpected exception), nothing is copied;
- ``"crash"``: the job runs and succeeds, but the engine's ``job_bytes`` raises a
  ``RuntimeError`` when the transfer actor collects the job: an unexpected exception
  inside the actor, outside any copy.

Garbling makes a fault honest: a consumer that ignored a failure would serve garbage
(a load) or make garbage visible (a store), and the soak's output comparison would see it.

The engine runs in vLLM's worker process and is built by ``factory(layout, pool)``, so
it is configured through the environment (inherited by vLLM's processes):
``KVFERRY_SOAK_FAULTS`` holds a JSON :class:`FaultPlan`. Every injected fault is appended
as one JSON line to the plan's ``log`` file (opened in append mode and closed per line,
so the soak process reads it at any time), and so is the end of every hang (``"how"``:
``"cancelled"`` or ``"timer"``). The same seed gives the same fault for the n-th job.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import attrs

from .transfer import Cancellable, Completion, CopyEngine, CopyJob, JobCancelled, new_copy_engine
from .transfer._layout import KVLayout
from .transfer._pool import HostPool
from .transfer._testing import FaultyCopyEngine, InjectedFault

ENV_VAR = "KVFERRY_SOAK_FAULTS"
FaultKind = Literal["fail", "hang", "reject", "crash"]
FAULT_KINDS: tuple[FaultKind, ...] = ("fail", "hang", "reject", "crash")


@attrs.frozen(kw_only=True)
class FaultPlan:
    """What to inject: each job gets kind k with probability ``rates[k]`` (kinds drawn in
    the order of :data:`FAULT_KINDS` from one uniform number per job)."""

    seed: int
    rates: Mapping[str, float]
    log: str
    hang_s: float = 10.0
    """How long a hang lasts if nothing cancels it (set it past the job deadline)."""

    def __attrs_post_init__(self) -> None:
        unknown = set(self.rates) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)} (known: {FAULT_KINDS})")
        if sum(self.rates.values()) > 1.0:
            raise ValueError(f"fault rates add up to more than 1: {dict(self.rates)}")

    def to_env(self) -> str:
        return json.dumps(
            {"seed": self.seed, "rates": dict(self.rates), "log": self.log, "hang_s": self.hang_s}
        )

    @classmethod
    def from_env(cls) -> FaultPlan:
        raw = os.environ.get(ENV_VAR)
        if not raw:
            raise RuntimeError(f"{ENV_VAR} is not set: the soak's copy engine has no fault plan")
        d = json.loads(raw)
        return cls(seed=d["seed"], rates=d["rates"], log=d["log"], hang_s=d["hang_s"])

    def draw(self, rng: random.Random) -> FaultKind | None:
        u = rng.random()
        for kind in FAULT_KINDS:
            p = self.rates.get(kind, 0.0)
            if u < p:
                return kind
            u -= p
        return None


class _Log:
    """Appends JSON lines to a file, from any thread of the worker process."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def write(self, **entry: Any) -> None:
        line = json.dumps({"pid": os.getpid(), **entry}) + "\n"
        with self._lock, open(self._path, "a") as f:
            f.write(line)


class _DamagedCompletion:
    """Ends with the wrapped job, garbles its destination once, reports ``error``.

    A hang (``hang_s`` not None) also waits until :meth:`cancel` or ``hang_s`` passed.
    """

    def __init__(
        self,
        inner: Completion,
        garble: Any,
        error: BaseException,
        *,
        hang_s: float | None = None,
        on_hang_end: Any = None,
    ) -> None:
        self._inner = inner
        self._garble = garble
        self._error = error
        self._lock = threading.Lock()
        self._hang_until = None if hang_s is None else time.monotonic() + hang_s
        self._released = threading.Event()
        self._cancelled = False
        self._on_hang_end = on_hang_end
        if hang_s is None:
            self._released.set()

    def _held(self) -> bool:
        if self._released.is_set():
            return False
        assert self._hang_until is not None
        if time.monotonic() < self._hang_until:
            return True
        self._release("timer")
        return False

    def _release(self, how: str) -> None:
        with self._lock:
            if self._released.is_set():
                return
            self._released.set()
        if self._on_hang_end is not None:
            self._on_hang_end(how)

    def _apply(self) -> None:
        with self._lock:
            garble, self._garble = self._garble, None
        if garble is not None:
            garble()

    def query(self) -> bool:
        if not self._inner.query() or self._held():
            return False
        self._apply()
        return True

    def synchronize(self) -> None:
        self._inner.synchronize()
        if self._hang_until is not None:
            self._released.wait(max(0.0, self._hang_until - time.monotonic()))
            self._held()
        self._apply()

    def exception(self) -> BaseException | None:
        if not self.query():
            return None
        if self._cancelled:
            return JobCancelled(f"injected hang, cancelled: {self._error}")
        return self._inner.exception() or self._error

    def cancel(self) -> None:
        self._cancelled = True
        if isinstance(self._inner, Cancellable):
            self._inner.cancel()
        self._release("cancelled")


@attrs.define(eq=False)
class SoakFaultEngine:
    """A copy engine that injects the faults of ``plan`` into ``inner``'s jobs."""

    inner: CopyEngine
    layout: KVLayout
    pool: HostPool
    plan: FaultPlan
    _rng: random.Random = attrs.field(init=False)
    _log: _Log = attrs.field(init=False)
    _garbler: FaultyCopyEngine = attrs.field(init=False)
    _n: int = 0
    _crash_jobs: set[int] = attrs.field(factory=set)

    def __attrs_post_init__(self) -> None:
        self._rng = random.Random(self.plan.seed)
        self._log = _Log(self.plan.log)
        # Reuses its garbling: device blocks of a load, host rows of a store.
        self._garbler = FaultyCopyEngine(
            inner=self.inner, layout=self.layout, pool=self.pool, faults=()
        )

    def submit(self, job: CopyJob) -> Completion:
        n = self._n
        self._n += 1
        kind = self.plan.draw(self._rng)
        if kind is None:
            return self.inner.submit(job)
        self._log.write(
            event="injected",
            n=n,
            kind=kind,
            job_id=job.job_id,
            direction=job.direction,
            num_blocks=job.num_blocks,
        )
        if kind == "reject":
            raise RuntimeError(f"injected: submit of {job.direction} job {job.job_id} raised")
        completion = self.inner.submit(job)
        if kind == "crash":
            self._crash_jobs.add(job.job_id)
            return completion
        error = InjectedFault(f"injected {kind}: {job.direction} job {job.job_id}")

        def garble() -> None:
            self._garbler._garble(job)

        if kind == "fail":
            return _DamagedCompletion(completion, garble, error)

        def hang_ended(how: str) -> None:
            self._log.write(event="hang_ended", how=how, job_id=job.job_id, n=n)

        return _DamagedCompletion(
            completion, garble, error, hang_s=self.plan.hang_s, on_hang_end=hang_ended
        )

    def job_bytes(self, job: CopyJob) -> int:
        if job.job_id in self._crash_jobs:
            self._crash_jobs.discard(job.job_id)
            raise RuntimeError(f"injected crash: job_bytes of {job.direction} job {job.job_id}")
        return self.inner.job_bytes(job)

    def close(self) -> None:
        self.inner.close()


def soak_copy_engine(layout: KVLayout, pool: HostPool) -> SoakFaultEngine:
    """The ``copy_engine`` factory of the soak: the default engine, with the faults of
    the plan in ``$KVFERRY_SOAK_FAULTS``."""
    return SoakFaultEngine(
        inner=new_copy_engine(layout, pool), layout=layout, pool=pool, plan=FaultPlan.from_env()
    )


def read_fault_log(path: str | Path) -> list[dict[str, Any]]:
    """Every entry the soak's copy engines wrote so far (an absent file: none)."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
