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

The tag tables of ARC's and S3-FIFO's ghost lists and of the admission counter
(:class:`~kvferry.cache._table.TagTable`) insert, find and remove compiled too, one pass
per tag where numpy makes a dozen passes per probe round: an eviction's few thousand ghost
pushes and lookups. On the replay, ARC 0.379 -> 0.356 of vLLM's time and S3-FIFO 0.388 ->
0.352 (in one process, four runs each, seed 600). Their layout may differ from numpy's
(a spilled tag can take a cell numpy gives a later one), never their answers.

The compact key index (:class:`~kvferry.cache._index.KeyIndex`) finds, enters and
removes keys compiled too: a batch's keys joined into one buffer, hashed, probed and
verified in one call, where its Python way is a dozen chains of ``map`` (on the replay, a
request 2.3x the dict index's time in Python, about the dict's compiled).

Compiled at first use in a process (about 8 s on the 2-core machine) and cached on disk
next to this module (numba's ``cache=True``; where that is read-only, in numba's per-user
cache), so later processes load them in about 0.5 s, 0.7 s with numba's import
(``tests/cache/test_kernels.py`` checks that a second process compiles none).

Who owns what: pure functions over the arrays the caller passes; nothing shared.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import cache
from types import SimpleNamespace
from typing import Any, TypeVar, cast

import numpy as np

from .._logging import get_logger
from ._slots import READY, STORING

WIDTH = 8
"""A tag table's entries per bucket (``_table.WIDTH``; here, so that it imports this)."""
INDEX_EMPTY = 2**31 - 1
"""The compact key index's empty cell (``_index.EMPTY``; here, so that it imports this)."""
INDEX_SATURATED = 2**16 - 1
"""Its pass counts stay here once there (``_index._SATURATED``)."""
INDEX_FAR = 255
"""Its shifts saturate here (``_index._FAR``)."""

_log = get_logger("kvferry.cache")

_mix: Any = None
"""The compact index's digest of a key, compiled (set by ``_compile``)."""
_same_key: Any = None
"""Whether a slot holds a key, compiled (set by ``_compile``)."""

F = TypeVar("F", bound=Callable[..., Any])

ENV = "KVFERRY_JIT"
"""``KVFERRY_JIT=0`` turns the compiled loops off (the directory's ``compiled=None``)."""


def wanted() -> bool:
    """Whether ``compiled=None`` asks for the compiled loops (the environment's say)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def choose(compiled: bool | None) -> Any | None:
    """The kernels for an owner's ``compiled`` (None: where numba is installed, unless
    ``KVFERRY_JIT=0``; True: required, ``ValueError`` without them; False: none)."""
    kernels = load() if compiled or (compiled is None and wanted()) else None
    if compiled and kernels is None:
        raise ValueError(
            "compiled=True needs numba (pip install 'kvferry[jit]'), which is not "
            "installed or failed to compile the loops (see the log)"
        )
    return kernels


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
        """Make every one of ``slots`` READY if all are STORING and none is named twice
        (its second time reads READY); else nothing (what was made READY is STORING
        again)."""
        for i in range(len(slots)):
            s = slots[i]
            if s < 0 or s >= num_slots or state[s] != STORING:
                for j in range(i):
                    state[slots[j]] = STORING
                return False
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

    # -- the tag tables (``_table.TagTable``, flat views of its arrays) ------------------

    i64, i32 = t.Array(t.int64, 1, "C"), t.Array(t.int32, 1, "C")
    tags_in = (t.Array(t.int64, 1, "C"), t.Array(t.int64, 1, "A", readonly=True))
    vals_in = (t.Array(t.int32, 1, "C"), t.Array(t.int32, 1, "A", readonly=True))
    W = WIDTH

    @njit([t.none(i64, i32, i32, t.int64, tg, vl, i64) for tg in tags_in for vl in vals_in])
    def table_insert(
        ftags: Any, fvals: Any, over: Any, nb: int, tags: Any, vals: Any, pos: Any
    ) -> None:
        """Each tag into the first free cell from its home bucket on; every full bucket
        passed counts it in ``over``. The caller made sure there is room."""
        for i in range(len(tags)):
            tag = tags[i]
            b = (tag >> 1) % nb
            while True:
                base = b * W
                at = -1
                for c in range(W):
                    if ftags[base + c] == 0:
                        at = base + c
                        break
                if at >= 0:
                    ftags[at] = tag
                    fvals[at] = vals[i]
                    pos[i] = at
                    break
                over[b] += 1
                b = (b + 1) % nb

    @njit([t.none(i64, i32, t.int64, tg, i64) for tg in tags_in])
    def table_find(ftags: Any, over: Any, nb: int, tags: Any, pos: Any) -> None:
        """The flat position of each tag (the first in probe order), -1 where absent: its
        home bucket, then on while the bucket left once overflowed."""
        for i in range(len(tags)):
            tag = tags[i]
            b = (tag >> 1) % nb
            pos[i] = -1
            for _ in range(nb):
                base = b * W
                at = -1
                for c in range(W):
                    if ftags[base + c] == tag:
                        at = base + c
                        break
                if at >= 0:
                    pos[i] = at
                    break
                if over[b] <= 0:
                    break
                b = (b + 1) % nb

    @njit([t.boolean(i64, i32, i32, t.int64, tg) for tg in tags_in])
    def table_remove(ftags: Any, fvals: Any, over: Any, nb: int, pos: Any) -> bool:
        """Empty the entries at ``pos`` (each live, each once), giving back the overflow
        counts of the buckets each passed; False (nothing changed) if one is not live."""
        end = len(ftags)
        for p in pos:
            if p < 0 or p >= end or ftags[p] == 0:
                return False
        for p in pos:
            b = (ftags[p] >> 1) % nb
            own = p // W
            while b != own:
                over[b] -= 1
                b = (b + 1) % nb
            ftags[p] = 0
            fvals[p] = -1
        return True

    # -- the compact key index (``_index.KeyIndex``, its arrays) ---------------------------
    #
    # Keys are read as 32-bit words (``words`` a key: the index compiles only keys whose
    # length is a multiple of 4, as the connector's are), the key bytes row = slot.

    u8, u16, u32 = (t.Array(x, 1, "C") for x in (t.uint8, t.uint16, t.uint32))
    keys_in = (t.Array(t.uint32, 1, "C"), t.Array(t.uint32, 1, "C", readonly=True))
    empty, saturated, far = INDEX_EMPTY, INDEX_SATURATED, INDEX_FAR
    u64 = numba.uint64
    m1, m2 = u64(0x9E3779B97F4A7C15), u64(0xC2B2AE3D27D4EB4F)
    f1, f2 = u64(0xFF51AFD7ED558CCD), u64(0xC4CEB9FE1A85EC53)

    inline = cast(Callable[[F], F], numba.njit(cache=True, inline="always"))

    @inline
    def mix(keys: Any, at: int, words: int, seed: int) -> int:
        """A key's digest (its ``words`` from ``at``), 0 .. 2**63 - 1: each word multiplied
        into a state that starts at ``seed``, then murmur3's finalizer. Not a
        cryptographic hash: the seed is random and the index's own."""
        h = u64(seed) ^ (u64(words) * m1)
        for j in range(words):
            h ^= u64(keys[at + j]) * m2
            h = ((h << u64(29)) | (h >> u64(35))) * m1
        h ^= h >> u64(33)
        h *= f1
        h ^= h >> u64(33)
        h *= f2
        h ^= h >> u64(33)
        digest: int = numba.int64(h >> u64(1))
        return digest

    @inline
    def same_key(kb: Any, s: int, keys: Any, at: int, words: int) -> bool:
        """Whether slot ``s``'s key is the one at ``at`` (``s`` may be ``empty``: no)."""
        if s == empty:
            return False
        base = s * words
        for j in range(words):
            if kb[base + j] != keys[at + j]:
                return False
        return True

    # The kernels call these as globals: numba's cache keeps a kernel that calls another
    # compiled function by a global name, and misses one that holds it in a closure cell.
    global _mix, _same_key
    _mix, _same_key = mix, same_key

    @njit([t.int64(kb, t.int64) for kb in keys_in])
    def index_digest(key: Any, seed: int) -> int:
        """One key's digest, as the kernels take it (``mix``): for the Python path."""
        digest: int = _mix(key, 0, len(key), seed)
        return digest

    @njit([t.none(i32, u16, u32, t.int64, t.int64, i64, kb, i64) for kb in keys_in])
    def index_find(
        cells: Any, over: Any, kb: Any, words: int, seed: int, digests: Any, keys: Any, out: Any
    ) -> None:
        """The slot of each key (``keys``: their words one after another), -1 where absent:
        from its home cell (its digest modulo the cells; ``digests``, or ``mix`` of it
        where they are empty) on, while a key passed the cell, each candidate checked
        against the key's words at its slot."""
        ncells = len(cells)
        given = len(digests) > 0
        n = len(out)
        homes = np.empty(n, np.int64)
        # Two passes, each of loads independent of one another (the cells, then the keys
        # at their slots), so that the CPU overlaps their cache misses.
        for i in range(n):
            p = (digests[i] if given else _mix(keys, i * words, words, seed)) % ncells
            homes[i] = p
            out[i] = cells[p]
        for i in range(n):
            at = i * words
            if _same_key(kb, out[i], keys, at, words):
                continue
            p = homes[i]
            found = -1
            # On while a key passed the cell, once round at most: where every cell was
            # passed (counts that saturated stay), an absent key's chain is a cycle.
            for _ in range(ncells - 1):
                if over[p] == 0:
                    break
                p = p + 1 if p + 1 < ncells else 0
                if _same_key(kb, cells[p], keys, at, words):
                    found = cells[p]
                    break
            out[i] = found

    @njit([t.boolean(i32, u16, i32, u8, u32, t.int64, t.int64, i64, kb, i64) for kb in keys_in])
    def index_insert(
        cells: Any,
        over: Any,
        cell: Any,
        shift: Any,
        kb: Any,
        words: int,
        seed: int,
        digests: Any,
        keys: Any,
        slots: Any,
    ) -> bool:
        """Each key's words at its slot, and the slot in the first empty cell from the key's
        home on, every cell passed counting it in ``over``; False (nothing changed) if a
        slot is out of range or holds a key. The caller made sure there is room, and that
        the keys are absent and distinct."""
        capacity = len(cell)
        for s in slots:
            if s < 0 or s >= capacity or cell[s] != -1:
                return False
        ncells = len(cells)
        given = len(digests) > 0
        for i in range(len(slots)):
            s = slots[i]
            base, at = s * words, i * words
            for j in range(words):
                kb[base + j] = keys[at + j]
            p = (digests[i] if given else _mix(keys, at, words, seed)) % ncells
            k = 0
            while cells[p] != empty:
                if over[p] < saturated:
                    over[p] += 1
                p = p + 1 if p + 1 < ncells else 0
                k += 1
            cells[p] = s
            cell[s] = p
            shift[s] = min(k, far)
        return True

    @njit([t.int64(i32, u16, i32, u8, sl) for sl in (i64, t.Array(t.int64, 1, "A", readonly=True))])
    def index_remove(cells: Any, over: Any, cell: Any, shift: Any, slots: Any) -> int:
        """Remove the keys of ``slots``, giving back the counts of the cells each passed;
        how many. -1 (nothing changed) if one is out of range, holds no key of the compact
        length, or was shifted too far to know its home without its digest."""
        capacity = len(cell)
        for s in slots:
            if s < 0 or s >= capacity or cell[s] < 0 or shift[s] == far:
                return -1
        ncells = len(cells)
        n = 0
        for s in slots:
            p = cell[s]
            if p < 0:  # given twice: removed already
                continue
            cell[s] = -1
            cells[p] = empty
            for _ in range(shift[s]):
                p = p - 1 if p > 0 else ncells - 1
                if over[p] < saturated:
                    over[p] -= 1
            n += 1
        return n

    return SimpleNamespace(
        index_digest=index_digest,
        index_find=index_find,
        index_insert=index_insert,
        index_remove=index_remove,
        table_insert=table_insert,
        table_find=table_find,
        table_remove=table_remove,
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
