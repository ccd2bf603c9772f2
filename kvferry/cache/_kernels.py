"""The directory's per-request loops over slots, compiled with numba where it is installed.

A request's calls (its lookup, its load, its store, its end) each pass over the slots of
its ~40 keys: their states, their pins. In Python that is ~100 ns a slot and a slot is
read several times a call (4.4 µs to unpin 32 slots on the 2-core machine); compiled,
the whole call costs about what calling it costs (0.3 µs), plus 0.7 µs to hand over the
slots as an array. On ``benchmarks/bookkeeping.py``'s replay that is 10-13% less CPU time
(ARC 0.441 -> 0.398 of vLLM's, LRU 0.172 -> 0.149); on
``benchmarks/scheduler_overhead.py``, where the directory is a third of the connector's
time and runs with caches the model cooled, no difference beyond the noise. vLLM
installs numba (the ``jit`` extra names it for a user without vLLM); without it, or with
``KVFERRY_JIT=0`` in the environment, the directory runs the same loops in Python
(:class:`~kvferry.cache.Directory`'s ``compiled``).

Each kernel does the common case only and says so: it either did its whole job, or
changed nothing and answers that it did not (a slot out of range, in another state, a
pin missing), and the directory's Python path then does the call as it always does, with
its invariant reports. So a kernel is never the only place an invariant is held, and
both paths give the same results (``tests/cache/test_kernels.py`` drives directories
with and without them through the same seeded histories).

Compiled at first use in a process (about 3 s on the 2-core machine) and cached on disk
next to this module (numba's ``cache=True``; where that is read-only, in numba's per-user
cache), so later processes load them in about 0.4 s, numba's import included.

Who owns what: pure functions over the arrays the caller passes; nothing shared.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import cache
from types import SimpleNamespace
from typing import Any, TypeVar

from .._logging import get_logger
from ._slots import READY, STORING

_log = get_logger("kvferry.cache")

F = TypeVar("F", bound=Callable[..., Any])

ENV = "KVFERRY_JIT"
"""``KVFERRY_JIT=0`` turns the compiled loops off (the directory's ``compiled=None``)."""


def wanted() -> bool:
    """Whether ``compiled=None`` asks for the compiled loops (the environment's say)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


@cache
def load() -> Any | None:
    """The compiled kernels (a namespace of functions), or None where numba is missing or
    fails to compile them (logged once)."""
    try:
        import numba
    except ModuleNotFoundError:
        return None
    except Exception as exc:  # installed, but it does not import (a numpy it refuses)
        _log.warning("kernels_unavailable", error=repr(exc))
        return None
    try:
        return _compile(numba)
    except Exception as exc:  # an unsupported numba/numpy pair: the Python loops serve
        _log.warning("kernels_unavailable", error=repr(exc))
        return None


def _compile(numba: Any) -> SimpleNamespace:
    def njit(signatures: list[Any]) -> Callable[[F], F]:
        compiled: Callable[[F], F] = numba.njit(signatures, cache=True, boundscheck=False)
        return compiled

    t = numba.types
    slots = t.Array(t.int64, 1, "A")
    types = {
        "state": t.Array(t.int8, 1, "C"),
        "pins": t.Array(t.int32, 1, "C"),
        "released": t.Array(t.uint32, 1, "C"),
        "int64": t.int64,
        "boolean": t.boolean,
        "none": t.none,
        "slots": slots,
        "two slots": t.Tuple((slots, slots)),
    }

    def sigs(returns: str, *args: str) -> list[Any]:
        """The signatures to compile: ``slots`` arguments contiguous and writable (the
        common case, matched exactly), or any other (any layout, read-only: the arrays
        messages carry are frozen), which every other input converts to."""
        out = []
        for slots_in in (t.Array(t.int64, 1, "C"), t.Array(t.int64, 1, "A", readonly=True)):
            params = [slots_in if a == "slots" else types[a] for a in args]
            out.append(types[returns](*params))
        return out

    @njit(sigs("int64", "state", "slots"))
    def leading_ready(state: Any, slots: Any) -> int:
        """How many of ``slots``, from the first, are READY (-1, an absent key, is not)."""
        n = 0
        for s in slots:
            if s < 0 or state[s] != READY:
                break
            n += 1
        return n

    @njit(sigs("int64", "state", "pins", "slots"))
    def lease_leading(state: Any, pins: Any, slots: Any) -> int:
        """Pin the leading READY ``slots``; their number."""
        n = 0
        for s in slots:
            if s < 0 or state[s] != READY:
                break
            pins[s] += 1
            n += 1
        return n

    @njit(sigs("boolean", "state", "pins", "slots"))
    def pin_if_all_ready(state: Any, pins: Any, slots: Any) -> bool:
        """Pin every one of ``slots`` (a slot twice: twice) if all are READY; else nothing."""
        for s in slots:
            if s < 0 or state[s] != READY:
                return False
        for s in slots:
            pins[s] += 1
        return True

    @njit(sigs("boolean", "state", "pins", "slots", "int64"))
    def unpin_ready(state: Any, pins: Any, slots: Any, num_slots: int) -> bool:
        """Release one pin of each of ``slots`` if each is READY and pinned, in order (a
        slot twice needs two pins); else nothing (what was released is pinned again)."""
        for i in range(len(slots)):
            s = slots[i]
            if s < 0 or s >= num_slots or state[s] != READY or pins[s] <= 0:
                for j in range(i):
                    pins[slots[j]] += 1
                return False
            pins[s] -= 1
        return True

    @njit(sigs("boolean", "state", "slots", "int64"))
    def ready_if_all_storing(state: Any, slots: Any, num_slots: int) -> bool:
        """Make every one of ``slots`` READY if all are STORING; else nothing."""
        for s in slots:
            if s < 0 or s >= num_slots or state[s] != STORING:
                return False
        for s in slots:
            state[s] = READY
        return True

    @njit(sigs("slots", "state", "slots"))
    def ready_of(state: Any, slots: Any) -> Any:
        """The READY ones of ``slots``, in order."""
        out = slots.copy()
        n = 0
        for s in slots:
            if s >= 0 and state[s] == READY:
                out[n] = s
                n += 1
        return out[:n]

    @njit(sigs("slots", "state", "pins", "slots"))
    def pin_ready(state: Any, pins: Any, slots: Any) -> Any:
        """Pin the READY ones of ``slots`` (a slot twice: twice); those, in order."""
        out = slots.copy()
        n = 0
        for s in slots:
            if s >= 0 and state[s] == READY:
                pins[s] += 1
                out[n] = s
                n += 1
        return out[:n]

    @njit(sigs("two slots", "state", "slots"))
    def absent_and_ready(state: Any, found: Any) -> Any:
        """Of a store's keys' slots (-1: absent): the positions of the absent ones, and
        the READY slots, each in order."""
        absent = found.copy()
        ready = found.copy()
        a = r = 0
        for i in range(len(found)):
            s = found[i]
            if s < 0:
                absent[a] = i
                a += 1
            elif state[s] == READY:
                ready[r] = s
                r += 1
        return absent[:a], ready[:r]

    @njit(sigs("boolean", "state", "pins", "slots", "int64"))
    def evictable_distinct(state: Any, pins: Any, victims: Any, num_slots: int) -> bool:
        """Whether ``victims`` are distinct slots, each READY and unpinned."""
        for s in victims:
            if s < 0 or s >= num_slots or state[s] != READY or pins[s] != 0:
                return False
        if len(victims) > 1:
            ordered = victims.copy()
            ordered.sort()
            for i in range(1, len(ordered)):
                if ordered[i] == ordered[i - 1]:
                    return False
        return True

    @njit(sigs("boolean", "slots"))
    def any_present(found: Any) -> bool:
        """Whether any of ``found`` is a slot (not -1, absent)."""
        for s in found:
            if s >= 0:
                return True
        return False

    @njit(sigs("none", "state", "slots", "int64"))
    def set_state(state: Any, slots: Any, value: int) -> None:
        """``state[slots] = value``, without numpy's fancy-index call."""
        for s in slots:
            state[s] = value

    @njit(sigs("int64", "released", "slots", "int64"))
    def absent_if_current(released_at: Any, slots: Any, epoch: int) -> int:
        """How many of ``slots`` are -1 (absent), if none of the others was released after
        ``epoch``; else -1."""
        absent = 0
        for s in slots:
            if s < 0:
                absent += 1
            elif released_at[s] > epoch:
                return -1
        return absent

    return SimpleNamespace(
        leading_ready=leading_ready,
        absent_if_current=absent_if_current,
        any_present=any_present,
        set_state=set_state,
        lease_leading=lease_leading,
        pin_if_all_ready=pin_if_all_ready,
        unpin_ready=unpin_ready,
        ready_if_all_storing=ready_if_all_storing,
        ready_of=ready_of,
        pin_ready=pin_ready,
        absent_and_ready=absent_and_ready,
        evictable_distinct=evictable_distinct,
    )
