"""The host tier's block directory: which key lives in which host slot, in which state.

A slot is FREE, STORING (a store was prepared and has not completed: never a lookup hit,
never evicted) or READY (readable); a READY slot may be pinned by loads and lookups' leases
(a count). After a reset, slots still in flight are *dropped*: invisible at once, freed
when their store completes (completed with a ``pin``: at that pin's unpin) or their last
load ends. With ``write_back`` (a lower tier written on eviction), an evicted slot is
DEMOTING instead of FREE: no longer a hit, its key still present (not stored again
meanwhile), its bytes kept until the caller, who took it with
:meth:`Directory.take_demotions` and wrote it down (or chose not to), ends it with
:meth:`Directory.end_demotions`. The invariants the tests hold
(docs/architecture.md, "Invariants and where they are held"):

1. a lookup hit is only a key whose store completed with ``ok``;
2. a STORING or pinned slot is never evicted, never reassigned;
5. at most ``num_slots`` keys are held, whatever happens.

A call that would break one (unpinning a slot that is not pinned, completing a store not
in flight, a policy choosing a victim that is not evictable) is a bug elsewhere: the slots
concerned are left alone, and it is logged (``invariant_broken``, an
:class:`~kvferry.InvariantError`) and counted in ``invariant_errors``, never asserted.

Per-slot state lives in numpy arrays. The key → slot map is a
:class:`~kvferry.cache._index.KeyIndex` (``index="compact"``: the keys' bytes in one
buffer, an open-addressing int32 table of slots by their digest, found and entered by
compiled kernels; no Python object per block, 40% of a dict's bytes) or a dict of the
caller's key objects (:class:`~kvferry.cache._index.DictIndex`, ``index="dict"``). By
default the compact one from ``_COMPACT_FROM`` (100k) slots where the loops are compiled,
a dict below (and without numba, whose absence leaves the compact index twice as slow).
A request's keys are resolved once: the calls that follow a lookup on a
prefix or a suffix of its keys (its load, its store) reuse that resolution while no key
came or went in between. Which block
to evict is the policy's choice (:mod:`~kvferry.cache._policy`); how many, and when, is
this class's: above the high watermark it asks the policy for enough victims to come down
to the low one, in one batch.
The :class:`~kvferry.cache.EvictorActor` triggers that between messages, so a store
rarely evicts inline. An eviction costs O(evicted blocks), whatever the capacity: the
policy reads victims off its own order and asks :meth:`Directory._evictable` about those
candidates only (READY, unpinned, not offered by the store making room); no pass over all
slots (``benchmarks/bookkeeping.py``, scaling from 10k to 4M slots).

Who owns what: plain, synchronous and single-owner; :class:`~kvferry.cache.DirectoryActor`
owns one, and tests and benchmarks drive one directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import numpy.typing as npt

from .._errors import InvariantError
from .._logging import get_logger
from . import _kernels
from ._admission import DEFAULT_WATERMARKS, AdmissionFilter, check_store_threshold, check_watermarks
from ._events import MEDIUM, BlocksRemoved, BlocksStored, KVEvent
from ._index import DictIndex, KeyIndex
from ._policy import EvictionPolicy, make_policy
from ._slots import DEMOTING, FREE, READY, READY_DROPPED, STORING, STORING_DROPPED
from ._statistics import DirectoryStatistics
from ._table import tags_of

I64 = npt.NDArray[np.int64]

__all__ = [
    "DEMOTING",
    "FREE",
    "READY",
    "READY_DROPPED",
    "STORING",
    "STORING_DROPPED",
    "Directory",
]

Key = bytes

_NO_TAGS = np.zeros(0, np.int64)

_MAX_UNTAGGED = 1 << 16
"""Stored keys hashed at the latest after this many (``tags_in_batches``)."""

_SMALL = 48
"""Up to this many slots, a check over them loops in Python: cheaper than numpy's calls
(measured on the 2-core machine, checking slots of a 1M-slot directory: 13 slots 4.6 µs
in Python against 14.9 in numpy, 64 slots 19.4 against 15.6)."""

_LOG_ORDER_FROM = 1_000_000
"""From this many slots LRU keeps its order in numpy logs even where stores evict inline:
an OrderedDict of millions of entries costs a few cache misses a block more. Measured on
the 2-core machine (``benchmarks/bookkeeping.py``'s scaling run, LRU at watermarks (1, 1),
ns per block-op, best of 3 segments, two runs each): at 100k slots 1,165-1,190 with the
OrderedDict against 1,251-1,336 with the logs, at 1M 1,555-1,575 against 1,499-1,546,
at 4M 1,900 against 1,601."""

_COMPACT_FROM = 100_000
"""From this many slots (with the compiled loops) the directory's index is compact by
default: its kernels then cost less than a dict, and hold the keys in a third of the
bytes. Below, a dict: the connector's calls are a few keys each, with its caches cold, and
a dict's few gets cost less than the kernel's call and the keys' join. Measured on the
2-core machine: ``benchmarks/scheduler_overhead.py`` (a host tier of 1,536 slots),
``sched_overhead_vs_vllm`` 0.656, 0.664 with a dict against 0.669, 0.688 compact,
alternated; ``benchmarks/bookkeeping.py``'s scaling run (ns per block-op, the best
segment, seeds 600-602, alternated, dict / compact, LRU's order an OrderedDict with the
dict and logs with the compact index): at 10k slots LRU (1, 1) 859-950 / 782-902, ARC
(1, 1) 1,436-1,563 / 1,422-1,569; at 100k 1,104-1,346 / 956-1,050 and 1,794-1,919 /
1,517-1,722; at 1M 1,380-1,474 / 1,023-1,192 and 2,011-2,125 / 1,599-1,688."""

_KEEP_LOOKUPS_FROM = 1_000_000
"""From this many slots (with the compiled loops) a request's lookup is kept for the touch
at its end, which then does not resolve its keys again: at millions of slots each dict
lookup is a few cache misses. Below, keeping costs what it saves. Measured on the 2-core
machine (``benchmarks/bookkeeping.py``'s scaling run, LRU at watermarks (1, 1), ns per
block-op, the best segment of a run, each run resolving again / kept): at 10k slots 998,
1,041 / 1,037, 1,108; at 100k 1,338, 1,360 / 1,232, 1,375; at 1M 1,895, 1,729 / 1,609,
1,609; at 4M 2,147, 1,925 / 1,548, 1,511."""

_RECENT = 1024
"""Lookups kept for the touch at their request's end (:meth:`Directory.touch`): about
the requests in flight; beyond, the oldest is dropped and its touch resolves its keys."""

_EPOCH_MAX = 0xFFFF_FFFF
"""The release counter's bound (``_released_at`` is uint32): reached, it starts again at
0 and every lookup kept is dropped."""

_log = get_logger("kvferry.cache")


def _first_of_each(slots: I64) -> I64:
    """``slots`` with each slot's first place only, in order (``slots`` itself when none
    repeats, the common case: a set of a few dozen ints, or one sort for more)."""
    if len(slots) <= _SMALL:
        listed = slots.tolist()
        if len(set(listed)) == len(listed):
            return slots
        return np.array(list(dict.fromkeys(listed)), np.int64)
    _, first = np.unique(slots, return_index=True)
    if len(first) == len(slots):
        return slots
    return slots[np.sort(first)]


class _Kept:
    """A request's lookup kept for its touch: its keys, their slots (-1: absent), and the
    release counter and the inserts when they were right."""

    __slots__ = ("epoch", "found", "inserts", "keys")

    def __init__(self, keys: tuple[Key, ...], found: I64, epoch: int, inserts: int) -> None:
        self.keys, self.found, self.epoch, self.inserts = keys, found, epoch, inserts


class Directory:
    """Key → slot bookkeeping with pins, admission, a pluggable eviction policy and events.

    ``policy``: ``"lru"``, ``"arc"``, ``"s3fifo"``, ``"package.module:Class"`` or an
    :class:`EvictionPolicy`. ``watermarks``: (low, high) occupancy; above high, eviction
    brings it down to low (``(1.0, 1.0)``: evict only what a store needs, inline).
    ``store_threshold``: store a key only at its N-th offer (1: always), counted over the
    last ``tracker_size`` distinct keys offered. ``events``: record :mod:`KV events
    <kvferry.cache._events>` for :meth:`take_events`. ``write_back``: evicted slots are
    DEMOTING until :meth:`end_demotions` (their bytes are written to a lower tier first).
    ``index``: the key index, ``"dict"`` (the caller's key objects in a dict, ~150 bytes a
    block) or ``"compact"`` (no Python object per block, ~65 bytes a block; compiled, as
    fast as the dict or faster from 10k slots, twice as slow in Python:
    ``benchmarks/bookkeeping.py``); None (the default): compact from ``_COMPACT_FROM``
    slots where compiled, else the dict.

    ``compiled``: the per-request calls' passes over their slots, and the policy's ghost
    lists' tag tables, compiled with numba
    (:mod:`~kvferry.cache._kernels`; None: where numba is installed, unless
    ``KVFERRY_JIT=0``; True: numba is required); else, and for every call a compiled pass
    leaves to it (an invariant broken, a slot dropped by a reset), they loop in Python
    over memoryviews of the state arrays (a numpy call costs more than a whole short
    request). Both hand the policy one array per call; the per-capacity work (eviction)
    is vectorized.
    """

    def __init__(
        self,
        num_slots: int,
        *,
        policy: str | EvictionPolicy = "lru",
        watermarks: tuple[float, float] = DEFAULT_WATERMARKS,
        store_threshold: int = 1,
        tracker_size: int = 64_000,
        events: bool = False,
        medium: str = MEDIUM,
        write_back: bool = False,
        index: str | None = None,
        compiled: bool | None = None,
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        if index not in ("compact", "dict", None):
            raise ValueError(f'index must be "compact", "dict" or None, got {index!r}')
        check_store_threshold(store_threshold)
        self.num_slots = num_slots
        # The per-request loops over slots, compiled (numba) or None: in Python.
        self._k = _kernels.choose(compiled)
        if index is None:
            compact = self._k is not None and num_slots >= _COMPACT_FROM
            index = "compact" if compact else "dict"
        self.index = index
        """The key index in use: ``index``, by default compact from ``_COMPACT_FROM`` slots
        where compiled, else a dict."""
        self.low, self.high = check_watermarks(watermarks)
        # LRU's order: an OrderedDict where a store evicts its few blocks inline (the
        # connector's watermarks (1, 1)) with the dict index; numpy logs for the evictor's
        # large batches, with the compact index (an OrderedDict would hold ~200 bytes a
        # block: no Python object per block is the point of it), and for millions of slots
        # (from _LOG_ORDER_FROM).
        inline = self.high >= 1.0 and index == "dict" and num_slots < _LOG_ORDER_FROM
        self.policy = make_policy(
            policy,
            num_slots,
            lru_order="dict" if inline else "log",
            compiled=self._k is not None,  # its ghost lists' tables
        )
        self.store_threshold = store_threshold
        self._admission = (
            AdmissionFilter(store_threshold, tracker_size, compiled=self._k is not None)
            if store_threshold > 1
            else None
        )
        self._index: KeyIndex | DictIndex = (
            KeyIndex(num_slots, compiled=self._k is not None)
            if index == "compact"
            else DictIndex(num_slots)
        )
        # The last batch of keys resolved, and its slots, while the index is unchanged
        # (``_changes``): a request's load and store reuse its lookup's resolution.
        self._changes = 0
        self._last: tuple[int, tuple[Key, ...], list[int] | None] = (-1, (), [])
        self._last_array: I64 | None = None  # the same slots as an array (either, or both)
        self._last_at = 0  # where the last _find_array's keys start in _last
        # A request's lookup, kept until its touch, by its last key (compiled loops, from
        # _KEEP_LOOKUPS_FROM slots): at its end other requests' stores have changed the
        # index, and the touch would resolve its keys again (a second dict lookup per
        # key; at millions of slots, cache misses). What the lookup found is still right
        # where none of its slots was released since (``_released_at``: the release
        # counter's value at each slot's last release), and what it did not find where
        # no key was inserted since (``_inserts``).
        self._recent: dict[Key, _Kept] = {}
        self._last_rec: _Kept | None = None  # the one of the batch in _last
        self._inserts = 0
        self._epoch = 0
        self._keeps = self._k is not None and num_slots >= _KEEP_LOOKUPS_FROM
        self._released_at = np.zeros(num_slots + 1 if self._keeps else 0, np.uint32)
        # One extra slot at the end: the FREE sentinel that slot -1 (absent) reads.
        self._state = np.zeros(num_slots + 1, np.int8)
        self._pins = np.zeros(num_slots + 1, np.int32)
        self._st = self._state.data
        self._pn = self._pins.data
        # Tags (hash of the key) only for a policy that keeps history of evicted keys.
        self._uses_tags = bool(getattr(self.policy, "uses_tags", True))
        # A policy's touch of the index's slots as found (-1, any state), if it has one.
        self._touch_found = getattr(self.policy, "touch_found", None)
        self._tag = np.zeros(num_slots if self._uses_tags else 0, np.int64)
        # A policy that takes its tags in batches (ARC): a store's keys are hashed at the
        # next eviction, with every store's since (one numpy pass instead of a few calls
        # per store; the admission filter needs its tags at once).
        self._batch_tags = (
            self._uses_tags
            and self._admission is None
            and bool(getattr(self.policy, "tags_in_batches", False))
        )
        self._untagged: list[Sequence[Key]] = []  # stored keys not yet hashed, per store
        # Their slots: views of the free stack, which only _release writes, and it hashes
        # them first.
        self._untagged_slots: list[npt.NDArray[np.int32]] = []
        self._untagged_len = 0
        self._free = np.arange(num_slots - 1, -1, -1, dtype=np.int32)  # a stack, top last
        self._num_free = num_slots
        self._events: list[KVEvent] | None = [] if events else None
        self.medium = medium
        """The medium its events name ("CPU" for host memory, "DISK" for the disk tier)."""
        self.write_back = write_back
        self._demoting: list[int] = []  # evicted, not yet taken by take_demotions()
        # DEMOTING slots taken by take_demotions() and not yet ended (a flag a slot, and
        # the FREE sentinel's, never set): only those may end_demotions() free.
        self._handed = np.zeros(num_slots + 1 if write_back else 0, np.bool_)
        self._num_demoting = 0  # DEMOTING slots, taken or not
        self.lookups = self.hits = self.misses = 0
        self.stores_prepared = self.stores_skipped_present = self.stores_skipped_full = 0
        self.stores_completed = self.stores_failed = 0
        self.loads_prepared = self.loads_completed = 0
        self.evictions = self.evictions_inline = self.resets = 0
        self._stuck = False  # the last eviction found nothing; until a block becomes evictable
        self.invariant_errors = 0
        """Broken invariants found (and survived) so far: a bug each; see :meth:`_broken`."""

    # -- the key index -------------------------------------------------------------------

    def _find(self, keys: Sequence[Key]) -> list[int]:
        """The slot of each key (-1: absent). A prefix or a suffix of the last batch
        resolved is not resolved again while no key came or went since."""
        at = self._cached(keys)
        if at is None:
            found = self._index.find(keys)
            self._resolved(keys, found, None)
            return found
        slots, whole = self._last[2], self._last_array
        if slots is not None:
            return slots[at]
        out: list[int] = whole[at].tolist() if whole is not None else self._index.find(keys)
        return out  # (resolved as an array: it is always there)

    def _find_array(self, keys: Sequence[Key]) -> I64:
        """:meth:`_find` as an int64 array (what the compiled loops take), from the same
        resolution; it, or a view of it, not to be written to."""
        at = self._cached(keys)
        if at is None:
            self._last_at = 0
            found = self._index.find_array(keys)
            self._resolved(keys, None, found)
            return found
        self._last_at = at.start
        whole = self._last_array
        if whole is None:
            whole = self._last_array = np.array(self._last[2], np.int64)
        return whole[at]

    def _cached(self, keys: Sequence[Key]) -> slice | None:
        """Where ``keys`` are in the last batch resolved, if they are a prefix or a suffix
        of it and no key came or went since; else None."""
        k = len(keys)
        changes, last, _ = self._last
        n = len(last)
        if changes == self._changes and 0 < k <= n:
            batch = keys if isinstance(keys, tuple) else tuple(keys)
            # The end keys first: a miss costs no copy of the batch.
            if batch[0] == last[0] and batch == (last if k == n else last[:k]):
                return slice(0, k)
            if k < n and batch[-1] == last[-1] and batch == last[n - k :]:
                return slice(n - k, n)
        return None

    def _resolved(self, keys: Sequence[Key], slots: list[int] | None, array: I64 | None) -> None:
        """The last batch resolved: its slots as a list, or as an array (the other made
        when asked for)."""
        self._last = (self._changes, keys if isinstance(keys, tuple) else tuple(keys), slots)
        self._last_array = array
        self._last_rec = None

    def _index_keys(self, keys: Sequence[Key], slots: npt.NDArray[np.integer]) -> None:
        self._changes += 1
        self._inserts += 1
        self._index.insert(keys, slots)

    def _keep(self, keys: Sequence[Key], found: I64) -> None:
        """Keep a request's lookup (``found``: its keys' slots) for its touch."""
        k = len(keys)
        if not k:
            return
        batch = keys if isinstance(keys, tuple) else tuple(keys)
        rec = _Kept(batch, found.copy(), self._epoch, self._inserts)
        recent = self._recent
        recent[batch[-1]] = rec
        if len(recent) > _RECENT:
            del recent[next(iter(recent))]
        # The batch of _last is this one (not one it is a part of): the request's store
        # of its missing keys, which follows at once, fills them in.
        self._last_rec = rec if self._last_at == 0 and len(self._last[1]) == k else None

    def _found_at_end(self, keys: Sequence[Key]) -> I64 | None:
        """The slots of a finished request's keys, from its lookup kept (see ``_recent``),
        or None: not kept, or a slot it found was released since (resolve them again)."""
        k = self._k
        rec = self._recent.pop(keys[-1], None) if keys else None
        if rec is None or k is None:  # (k is there wherever lookups are kept)
            return None
        batch, found, epoch, inserts = rec.keys, rec.found, rec.epoch, rec.inserts
        if not (batch is keys or batch == (keys if isinstance(keys, tuple) else tuple(keys))):
            return None
        absent = k.absent_if_current(self._released_at, found, epoch)
        if absent < 0:
            return None
        if absent and inserts != self._inserts:  # keys it did not find may be there now
            at = np.flatnonzero(found < 0)
            found[at] = self._index.find([keys[i] for i in at.tolist()])
        return found

    def _store_into_kept(self, at: int, idx: list[int] | range, new: I64, whole: bool) -> None:
        """A store of a kept lookup's missing keys (``at``: where they start in it; ``idx``:
        those stored, in the store's keys; ``new``: their slots): the lookup holds them
        now. ``whole``: no other key was inserted by the store (none given twice)."""
        rec = self._last_rec
        self._last_rec = None
        if rec is None or self._k is None:
            return
        found, epoch = rec.found, rec.epoch
        if epoch != self._epoch and self._k.absent_if_current(self._released_at, found, epoch) < 0:
            # The store's eviction took one of the slots the lookup found: dropped.
            last = rec.keys[-1]
            if self._recent.get(last) is rec:
                del self._recent[last]
            return
        m = len(new)
        if isinstance(idx, range):
            found[at : at + m] = new
        else:
            found[np.asarray(idx[:m], np.int64) + at] = new
        rec.epoch = self._epoch
        if whole:
            rec.inserts = self._inserts

    # -- queries -----------------------------------------------------------------------

    def lookup(self, keys: Sequence[Key]) -> int:
        """Number of leading ``keys`` that are READY (a hit is only a completed store)."""
        n: int
        if self._k is not None:
            found_array = self._find_array(keys)
            n = self._k.leading_ready(self._state, found_array)
            if self._keeps:
                self._keep(keys, found_array)
        else:
            st = self._st
            n = 0
            for s in self._find(keys):
                if st[s] != READY:  # -1 (absent) reads the FREE sentinel
                    break
                n += 1
        self._count_lookup(len(keys), n)
        return n

    def lookup_and_lease(self, keys: Sequence[Key]) -> I64:
        """:meth:`lookup` then :meth:`lease` of the hit, in one pass: the slots of the
        leading READY ``keys``, each pinned (their number is the hit)."""
        if self._k is not None:
            found_array = self._find_array(keys)
            n = self._k.lease_leading(self._state, self._pins, found_array)
            if self._keeps:
                self._keep(keys, found_array)
            self._count_lookup(len(keys), n)
            return found_array[:n].copy()
        st, pins = self._st, self._pn
        found = self._find(keys)
        n = 0
        for s in found:
            if st[s] != READY:  # -1 (absent) reads the FREE sentinel
                break
            pins[s] += 1
            n += 1
        self._count_lookup(len(keys), n)
        return np.array(found[:n], np.int64)

    def _count_lookup(self, asked: int, hits: int) -> None:
        self.lookups += 1
        self.hits += hits
        self.misses += asked - hits

    def ready(self, keys: Sequence[Key]) -> npt.NDArray[np.bool_]:
        """For each of ``keys``, whether it is READY (hybrid models look past a miss)."""
        st = self._st
        out = np.fromiter((st[s] == READY for s in self._find(keys)), np.bool_, len(keys))
        self._count_lookup(len(keys), int(np.count_nonzero(out)))
        return out

    def slot_of(self, key: Key) -> int | None:
        return self._index.find_one(key)

    @property
    def used(self) -> int:
        return self.num_slots - self._num_free

    # -- loads -------------------------------------------------------------------------

    def prepare_load(self, keys: Sequence[Key]) -> I64 | None:
        """Pin the READY slots of ``keys`` for a load; None (nothing pinned) if any is not READY.

        A load is a reuse: the policy counts it.
        """
        if self._k is not None:
            found_array = self._find_array(keys)
            if not self._k.pin_if_all_ready(self._state, self._pins, found_array):
                return None
            out = found_array.copy()
        else:
            st, pins = self._st, self._pn
            found = self._find(keys)
            for s in found:
                if st[s] != READY:  # -1 (absent) reads the FREE sentinel
                    return None
            for s in found:  # a key given twice is pinned twice, and unpinned twice
                pins[s] += 1
            out = np.array(found, np.int64)
        self.policy.reuse(out)
        self.loads_prepared += len(out)
        return out

    def load_leased(self, slots: I64) -> None:
        """A load of slots a lookup leased (pinned): their pins become the load's, released
        by :meth:`complete_load`. A load is a reuse: the policy counts it, of the READY
        slots only (not those a reset dropped since the lease)."""
        st, pins = self._st, self._pn
        n = len(slots)
        held = [s for s in slots.tolist() if 0 <= s < self.num_slots and pins[s] > 0]
        if len(held) < n or any(st[s] != READY for s in held):
            if len(held) < n or any(st[s] not in (READY, READY_DROPPED) for s in held):
                # Not a lease (a bug elsewhere): the load still holds only pinned slots.
                self._broken("load_of_slots_not_leased", "counted", slots=slots.tolist())
            # The policy's reuse is of its own slots only: one a reset dropped is freed
            # when the load ends and taken by another key, which a reuse recorded now
            # would be credited to (the policies replay their records at their next
            # decision); one out of range would make that decision raise.
            slots = np.array([s for s in held if st[s] == READY], np.int64)
        self.policy.reuse(slots)
        self.loads_prepared += n

    def complete_load(self, slots: npt.ArrayLike, handed: npt.ArrayLike = ()) -> None:
        """Unpin the slots of a finished (or failed) load; ``handed``: the load's slots
        whose pins a write of them keeps (counted as loaded, not unpinned)."""
        self.loads_completed += self.unpin(slots) + len(np.asarray(handed))

    def lease(self, keys: Sequence[Key]) -> I64:
        """Pin each READY key of ``keys`` (others are skipped); returns the pinned slots.

        A lookup's hit is leased until the engine allocates its blocks (then
        :meth:`prepare_load` pins it for the load) or gives up (:meth:`unpin`), so that no
        eviction comes in between. A lease is not recency: a waiting request is looked up
        again every step, and its blocks get their recency when it ends (:meth:`touch`).
        """
        if self._k is not None:
            out: I64 = self._k.pin_ready(self._state, self._pins, self._find_array(keys))
            return out
        st, pins = self._st, self._pn
        slots = [s for s in self._find(keys) if st[s] == READY]
        for s in slots:
            pins[s] += 1
        return np.array(slots, np.int64)

    def unpin(self, slots: npt.ArrayLike) -> int:
        """Release one pin of each of ``slots`` (a load's or a lease's); returns how many."""
        if self._k is not None:
            arr = np.asarray(slots, np.int64)
            if self._k.unpin_ready(self._state, self._pins, arr, self.num_slots):
                self._stuck = False
                return len(arr)
            # Else (a slot not pinned, out of range, dropped by a reset): nothing was
            # released, and the loop below does it slot by slot, with its reports.
        st, pins = self._st, self._pn
        freed = []
        n = 0
        bad = []
        for s in np.asarray(slots, np.int64).tolist():
            state = st[s] if 0 <= s < self.num_slots else FREE
            if state not in (READY, READY_DROPPED) or pins[s] <= 0:
                bad.append(s)  # never below zero: a pin left is safer than a slot freed
                continue
            pins[s] -= 1
            n += 1
            if state == READY_DROPPED and pins[s] == 0:  # a reset dropped it: free it now
                freed.append(s)
        self._stuck = False
        if freed:
            self._release(np.array(freed, np.int64))
        if bad:
            self._broken("unpin_of_a_slot_not_pinned", "skipped", slots=bad)
        return n

    def touch(self, keys: Sequence[Key]) -> None:
        """A request finished with these keys (head first): recency for the policy."""
        kept = self._found_at_end(keys) if self._keeps else None
        if self._touch_found is not None:  # it picks the READY slots itself
            self._touch_found(kept.tolist() if kept is not None else self._find(keys))
            return
        if self._k is not None:
            found = kept if kept is not None else self._find_array(keys)
            ready = self._k.ready_of(self._state, found)
            if len(ready):
                self.policy.touch(ready)
            return
        st = self._st
        slots = [s for s in self._find(keys) if st[s] == READY]
        if slots:
            self.policy.touch(np.array(slots, np.int64))

    # -- stores ------------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[Key], *, admit: bool = True) -> I64:
        """Reserve a slot per key; -1 where the key is skipped.

        Skipped, in this order: a key already STORING or READY (present; a READY one is a
        reuse for the policy and is not evicted by this call), a repeated key, a key
        offered fewer than ``store_threshold`` times (unless ``admit`` is False: a block
        read up from a lower tier was admitted there), and — when no slot is free and
        nothing is evictable — the last keys of the call (full): a skipped store is only
        a future miss.
        """
        k = len(keys)
        idx: list[int] | range = range(k)
        protect = None
        kept_at = 0
        if self._k is not None:
            found_array = self._find_array(keys)
            kept_at = self._last_at  # where these keys are in a kept lookup, if linked
            # Some present (rare: a store names keys its lookup missed): skip them, and
            # count a reuse of the READY ones.
            if self._k.any_present(found_array):
                absent, ready = self._k.absent_and_ready(self._state, found_array)
                idx = absent.tolist()
                if len(ready):
                    protect = ready
                    self.policy.reuse(protect)
                self.stores_skipped_present += k - len(idx)
        elif max(found := self._find(keys), default=-1) >= 0:  # some present: as above
            st = self._st
            idx = [i for i, s in enumerate(found) if s < 0]
            reused = [s for s in found if st[s] == READY]
            if reused:
                protect = np.array(reused, np.int64)
                self.policy.reuse(protect)
            self.stores_skipped_present += k - len(idx)
        new_keys = list(keys) if len(idx) == k else [keys[i] for i in idx]
        twice = False
        if len(new_keys) > 1 and len(set(new_keys)) < len(new_keys):  # a key given twice
            twice = True
            seen: set[Key] = set()
            idx = [i for i in idx if not (keys[i] in seen or seen.add(keys[i]))]  # type: ignore[func-returns-value]
            new_keys = [keys[i] for i in idx]
        if not new_keys:
            return np.full(k, -1, np.int64)
        tags = (
            tags_of(new_keys)
            if (self._uses_tags and not self._batch_tags) or self._admission is not None
            else None
        )
        if admit and self._admission is not None and tags is not None:
            admitted = self._admission.offer(tags)
            keep = admitted.tolist()
            idx = [i for i, a in zip(idx, keep, strict=True) if a]
            new_keys = [key for key, a in zip(new_keys, keep, strict=True) if a]
            tags = tags[admitted]
        need = len(new_keys)
        if self._uses_tags and tags is not None:
            self.policy.store_miss(tags)
        # With ``tags_in_batches``, the keys wait to be hashed at the next eviction; one in
        # this call hashes them now, so that the policy learns of these misses first.
        later = self._batch_tags and need <= self._num_free
        if self._batch_tags and not later:
            self._tag_stores()
            tags = tags_of(new_keys)
            self.policy.store_miss(tags)
        if need > self._num_free:
            # DEMOTING slots are on their way out (write_back): not evicted twice.
            used = self.used - self._num_demoting
            short = max(
                need - self._num_free - self._num_demoting,
                used + need - int(self.low * self.num_slots),
            )
            if short > 0:
                self.evictions_inline += self._evict(short, protect)
        m = min(need, self._num_free)
        self.stores_skipped_full += need - m
        if not m:
            return np.full(k, -1, np.int64)
        top = self._num_free
        taken = self._free[top - m : top][::-1]
        new = taken.astype(np.int64)  # the caller's: nothing here keeps it
        self._num_free = top - m
        self._index_keys(new_keys if m == need else new_keys[:m], new)
        if self._k is not None:
            self._k.set_state(self._state, new, STORING)
        else:
            self._state[new] = STORING
        if self._last_rec is not None:
            self._store_into_kept(kept_at, idx, new, not twice)
        if later:
            self._untagged.append(new_keys)
            self._untagged_slots.append(taken)
            self._untagged_len += m
            if self._untagged_len > _MAX_UNTAGGED:
                self._tag_stores()
        elif self._uses_tags and tags is not None:
            self._tag[new] = tags[:m]
        self.stores_prepared += m
        if m == k:
            return new
        out = np.full(k, -1, np.int64)
        out[np.asarray(idx[:m], np.int64)] = new
        return out

    def complete_store(self, slots: npt.ArrayLike, ok: bool, pin: npt.ArrayLike = ()) -> None:
        """A prepared store finished: READY if ``ok``, else the slot is freed (never visible).

        ``pin``: of the READY ones, slots pinned at once (one pin each, released by
        :meth:`unpin`): a copy still reads them (a write down to a lower tier), and no
        eviction may come between their completion and the pin. A store a reset dropped
        is never READY; named in ``pin`` (with ``ok``), its slot is pinned all the same
        and freed at the last unpin, not before: no other store takes it meanwhile.
        """
        arr = np.asarray(slots, np.int64)
        if not len(arr):
            return
        st, end = self._st, self.num_slots
        # All STORING, none named twice, the common case: the compiled loop makes them
        # READY as it checks.
        made_ready = (
            ok and self._k is not None and self._k.ready_if_all_storing(self._state, arr, end)
        )
        if not made_ready and len(arr) > 1:
            # A caller's bug: a slot named twice is completed once (twice, a READY one
            # would be admitted and announced twice, a freed one enter the free stack
            # twice and two keys could then share it).
            once = _first_of_each(arr)
            if len(once) < len(arr):
                self._broken(
                    "complete_store_named_a_slot_twice", "completed once", slots=arr.tolist()
                )
                arr = once
        live = None
        if not made_ready and (
            len(arr) > _SMALL  # a step's store is checked in Python
            or not all(0 <= s < end and st[s] == STORING for s in arr.tolist())
        ):
            in_range = (arr >= 0) & (arr < self.num_slots)
            state = np.where(in_range, self._state[np.where(in_range, arr, -1)], FREE)
            live = state == STORING
        if live is not None and not live.all():
            dropped = state == STORING_DROPPED
            if not (live | dropped).all():
                # Not a store in flight (completed twice, or never prepared): left alone.
                self._broken(
                    "complete_store_of_a_slot_not_storing",
                    "skipped",
                    slots=arr[~(live | dropped)].tolist(),
                    ok=ok,
                )
            gone = arr[dropped]  # stores a reset dropped: never visible, freed now...
            pinned = np.asarray(pin, np.int64)
            if ok and len(pinned) and len(gone):
                # ...unless a copy still reads them (``pin``): kept, pinned, until its last
                # unpin frees them, as a load's (another store must not take them first).
                read = np.isin(gone, pinned)
                if read.any():
                    kept = gone[read]
                    self._state[kept] = READY_DROPPED
                    np.add.at(self._pins, pinned[np.isin(pinned, kept)], 1)
                    gone = gone[~read]
            self._release(gone)
            arr = arr[live]
        if ok:
            self._stuck = False
            if not made_ready:
                self._state[arr] = READY
            pinned = np.asarray(pin, np.int64)
            if len(pinned):
                np.add.at(self._pins, pinned[np.isin(pinned, arr)], 1)  # a slot twice: 2 pins
            tags = self._tag[arr] if self._uses_tags and not self._batch_tags else _NO_TAGS
            self.policy.admit(arr, tags)
            self.stores_completed += len(arr)
            if self._events is not None and len(arr):
                self._events.append(
                    BlocksStored(keys=self._keys_of(arr.tolist()), medium=self.medium)
                )
        else:
            self._unindex(arr.tolist())
            self._release(arr)
            self.stores_failed += len(arr)

    def _tag_stores(self) -> None:
        """Hash the keys stored since the last call (``tags_in_batches``): their slots'
        tags, and the policy's store misses, in the order the stores came."""
        if not self._untagged:
            return
        keys = (
            self._untagged[0] if len(self._untagged) == 1 else chain.from_iterable(self._untagged)
        )
        slots = np.concatenate(self._untagged_slots)
        self._untagged, self._untagged_slots, self._untagged_len = [], [], 0
        tags = np.fromiter(map(hash, keys), np.int64, len(slots))
        tags |= 1  # as tags_of
        self._tag[slots] = tags
        self.policy.store_miss(tags)

    def _keys_of(self, slots: list[int] | I64) -> list[Key]:
        arr = np.asarray(slots, np.int64)
        return self._index.keys_of(arr[self._index.holds(arr)])

    def _unindex(self, slots: list[int] | I64) -> None:
        self._changes += 1
        for s in self._index.remove(np.asarray(slots, np.int64)):
            self._broken("unindex_of_a_slot_without_key", "skipped", slot=s)

    def restore(self, keys: Sequence[Key]) -> int:
        """Enter ``keys`` as READY without a store (a lower tier's files found at start):
        no admission, no events (nothing new was stored); up to the free slots, in order.
        They are evictable at once (an eviction that found nothing goes on). Returns how
        many were entered; the rest are the caller's to drop."""
        distinct = list(dict.fromkeys(keys))
        found = self._index.find(distinct)
        new = [k for k, s in zip(distinct, found, strict=True) if s < 0]
        m = min(len(new), self._num_free)
        if not m:
            return 0
        new = new[:m]
        top = self._num_free
        slots = self._free[top - m : top][::-1].astype(np.int64)
        self._num_free = top - m
        self._index_keys(new, slots)
        self._state[slots] = READY
        tags = tags_of(new) if self._uses_tags else None
        if tags is not None:
            self._tag[slots] = tags
        self.policy.admit(slots, tags if tags is not None else _NO_TAGS)
        self._stuck = False  # evictable blocks: the evictor's eviction goes on
        return m

    def discard(self, keys: Sequence[Key]) -> list[Key]:
        """Drop these keys if READY and unpinned (a lower tier found them bad or gone);
        returns those dropped (their removal is an event, like an eviction)."""
        st, pins = self._st, self._pn
        slots = [s for s in self._find(keys) if st[s] == READY and not pins[s]]
        if not slots:
            return []
        arr = np.array(sorted(set(slots)), np.int64)
        gone = self._keys_of(arr.tolist())
        self._tag_stores()
        self.policy.forget(arr)
        if self._events is not None:
            self._events.append(BlocksRemoved(keys=gone, medium=self.medium))
        self._unindex(arr.tolist())
        self._release(arr)
        return gone

    # -- space -------------------------------------------------------------------------

    def room_short(self) -> int:
        """Blocks to evict to come down to the low watermark; 0 unless above the high one,
        or while nothing became evictable since an eviction found nothing to evict."""
        used = self.used - self._num_demoting  # on their way out already
        if self._stuck or used <= self.high * self.num_slots:
            return 0
        return max(0, used - int(self.low * self.num_slots))

    def evict(self, max_blocks: int | None = None) -> int:
        """Evict towards the low watermark (at most ``max_blocks``); returns how many."""
        n = self.room_short()
        if max_blocks is not None:
            n = min(n, max_blocks)
        return self._evict(n, None) if n > 0 else 0

    def _evictable(self, slots: I64) -> npt.NDArray[np.bool_]:
        """Which of ``slots`` the policy may evict now: READY and unpinned (what the store
        making room protects is pinned for the call)."""
        out: npt.NDArray[np.bool_] = (self._state[slots] == READY) & (self._pins[slots] == 0)
        return out

    def _evict(self, n: int, protect: I64 | None) -> int:
        """Have the policy choose ``n`` victims and drop them: O(n), not O(capacity).

        A dozen numpy calls whatever ``n`` (a store's inline eviction of a few dozen
        blocks costs what its calls cost). Every policy's choice, the built-in ones'
        too, is checked in one pass (in range, READY, unpinned, distinct: invariant 2
        is held here, not trusted to the policy), and only a bad choice takes the slow
        path.
        """
        if protect is not None:
            self._pins[protect] += 1  # a repeated slot is counted once, and given back once
        try:
            self._tag_stores()
            victims = np.asarray(self.policy.victims(n, self._evictable, self._tag), np.int64)
            m = len(victims)
            good = m <= n
            if m and good and self._k is not None:
                good = self._k.evictable_distinct(self._state, self._pins, victims, self.num_slots)
            elif m and good and m <= _SMALL:
                # A store's inline eviction: checked in Python (fewer µs than the calls).
                st, pn, end = self._st, self._pn, self.num_slots
                chosen = victims.tolist()
                good = len(set(chosen)) == m and all(
                    0 <= s < end and st[s] == READY and pn[s] == 0 for s in chosen
                )
            elif m and good:
                # uint64: a negative slot is out of range too. The sentinel slot reads FREE.
                in_range = victims.view(np.uint64) < self.num_slots
                good = int(np.count_nonzero(in_range)) == m
                if good:
                    ok = (self._state[victims] == READY) & (self._pins[victims] == 0)
                    good = int(np.count_nonzero(ok)) == m
                if good and m > 1:
                    ordered = np.sort(victims)
                    good = not np.count_nonzero(ordered[1:] == ordered[:-1])
            if not good:
                ok = (victims >= 0) & (victims < self.num_slots)
                ok[ok] = self._evictable(victims[ok])
        finally:
            if protect is not None:
                self._pins[protect] -= 1
        if not good:
            _, first = np.unique(victims, return_index=True)
            once = np.zeros(m, np.bool_)
            once[first] = True
            # Invariant 2: a policy (maybe the user's) never frees what is pinned, being
            # stored or already free. Only its valid choices are evicted.
            self._broken(
                "policy_chose_a_slot_not_evictable",
                f"{self.policy.name}: skipped",
                asked=n,
                bad=victims[~(ok & once)].tolist(),
            )
            victims = victims[ok & once][:n]
            m = len(victims)
        # Nothing (more) evictable until a block becomes so; not where what this store
        # protects may be all there is: evictable again once it returns.
        self._stuck = m < n and protect is None
        if not m:
            return 0
        if self._events is not None:
            self._events.append(BlocksRemoved(keys=self._keys_of(victims), medium=self.medium))
        self.evictions += m
        if self.write_back:
            # Not a hit from now on, but kept (and its key, so that it is not stored
            # again meanwhile) until the caller wrote it down: end_demotions frees it.
            self._state[victims] = DEMOTING
            self._demoting.extend(victims.tolist())
            self._num_demoting += m
            return m
        self._unindex(victims)
        self._release(victims)
        return m

    def take_demotions(self) -> tuple[I64, list[Key]]:
        """Slots evicted since the last call (``write_back``), with their keys: each is
        the caller's to write down, then to end with :meth:`end_demotions`. Slots a reset
        dropped meanwhile are not handed out (their bytes are of no use): freed now."""
        if not self._demoting:
            return np.zeros(0, np.int64), []
        taken = np.array(self._demoting, np.int64)
        self._demoting = []
        held = self._index.holds(taken)
        if not held.all():
            self._end(taken[~held])
            taken = taken[held]
        self._handed_out()[taken] = True
        return taken, self._index.keys_of(taken)

    def end_demotions(self, slots: npt.ArrayLike) -> None:
        """Free DEMOTING slots taken by :meth:`take_demotions` (written down or not).

        Any other slot is a caller's bug, reported and left alone: one not DEMOTING, and
        one DEMOTING that was not handed out yet (freed now, it could be stored again
        while still listed, and the next :meth:`take_demotions` would hand out a slot
        holding another key, to be written down under it and freed twice).
        """
        arr = np.asarray(slots, np.int64)
        if not len(arr):
            return
        in_range = (arr >= 0) & (arr < self.num_slots)
        at = np.where(in_range, arr, -1)  # out of range: the sentinel (FREE, not handed)
        demoting = self._state[at] == DEMOTING
        handed = self._handed_out()
        ok = demoting & handed[at]
        if not ok.all():
            if not demoting.all():
                self._broken(
                    "end_demotion_of_a_slot_not_demoting", "skipped", slots=arr[~demoting].tolist()
                )
            if not (ok | ~demoting).all():
                self._broken(
                    "end_demotion_of_a_slot_not_taken",
                    "skipped",
                    slots=arr[demoting & ~ok].tolist(),
                )
            arr = arr[ok]
        done = np.unique(arr)
        handed[done] = False
        self._end(done)

    def _handed_out(self) -> npt.NDArray[np.bool_]:
        """The flags of slots handed out by :meth:`take_demotions` (allocated here if
        ``write_back`` was turned on after the directory was made)."""
        if len(self._handed) <= self.num_slots:
            self._handed = np.zeros(self.num_slots + 1, np.bool_)
        return self._handed

    def _end(self, slots: I64) -> None:
        if len(slots):
            self._changes += 1
            self._index.remove(slots)  # those a reset forgot already hold no key: left alone
        self._num_demoting -= len(slots)
        self._stuck = False
        self._release(slots)

    def _broken(self, invariant: str, action: str, **context: object) -> None:
        """Report a broken invariant of this bookkeeping (a bug): counted, logged once
        with its context; the caller has already left the slots concerned alone."""
        self.invariant_errors += 1
        error = InvariantError(invariant, action)
        _log.error("invariant_broken", invariant=invariant, error=str(error), **context)

    def _release(self, slots: I64) -> None:
        if self._untagged:  # a slot freed now may be taken again: its tag is written first
            self._tag_stores()
        self._state[slots] = FREE
        self._pins[slots] = 0
        m = len(slots)
        if self._keeps and m:  # what a kept lookup found here is gone
            if self._epoch >= _EPOCH_MAX:
                self._released_at[:] = 0
                self._epoch = 0
                self._recent.clear()
                self._last_rec = None
            self._epoch += 1
            self._released_at[slots] = self._epoch
        self._free[self._num_free : self._num_free + m] = slots
        self._num_free += m

    def clear(self) -> list[Key]:
        """Drop every READY, unpinned key; returns them. STORING and pinned slots stay."""
        slots = np.flatnonzero((self._state[:-1] == READY) & (self._pins[:-1] == 0))
        keys = self._keys_of(slots.tolist())
        if len(slots):
            self._tag_stores()
            self.policy.forget(slots)
            self._unindex(slots.tolist())
            self._release(slots)
            if self._events is not None:
                self._events.append(BlocksRemoved(keys=keys, medium=self.medium))
        return keys

    def pinned(self) -> tuple[I64, list[Key], I64]:
        """The READY slots pinned now (by loads, by lookups' leases): the slots in order,
        their keys, their pins. O(capacity). A lower tier's directory asks before a
        :meth:`reset`, which forgets these keys while their bytes are still read."""
        slots = np.flatnonzero((self._state[:-1] == READY) & (self._pins[:-1] > 0))
        return slots, self._keys_of(slots), self._pins[slots].astype(np.int64)

    def reset(self) -> int:
        """Forget every key at once (vLLM's ``reset_prefix_cache``); returns how many READY
        blocks were dropped.

        Nothing from before is a hit afterwards. Slots still in flight are not reused
        before their load or store ends (invariant 2): they are freed then.
        """
        state = self._state[:-1]
        ready = state == READY
        dropped = int(ready.sum())
        visible = [] if self._events is None else self._keys_of(np.flatnonzero(ready).tolist())
        pinned = self._pins[:-1] > 0
        state[ready & pinned] = READY_DROPPED
        state[state == STORING] = STORING_DROPPED
        self._release(np.flatnonzero(ready & ~pinned))
        self._changes += 1
        self._index.clear()
        self._recent.clear()
        self._last_rec = None
        self.policy.clear()
        self.resets += 1
        if self._events is not None and visible:
            # Each block the tier held is removed by name, after the batch's earlier events
            # (its evictions included): no AllBlocksCleared, which in vLLM's events names no
            # medium, and would tell a router that the engine's own blocks, and a shared
            # tier's that a reset keeps (Redis), are gone too.
            self._events.append(BlocksRemoved(keys=visible, medium=self.medium))
        return dropped

    # -- events and statistics ----------------------------------------------------------

    @property
    def events_pending(self) -> int:
        """Events recorded and not yet taken."""
        return len(self._events) if self._events else 0

    def take_events(self) -> list[KVEvent]:
        """Events recorded since the last call, in order (empty unless ``events``)."""
        if not self._events:
            return []
        out, self._events = self._events, []
        return out

    def visible_keys(self) -> set[Key]:
        """Every key that is a lookup hit now (for tests; O(capacity))."""
        return set(self._keys_of(np.flatnonzero(self._state[:-1] == READY).tolist()))

    def statistics(self) -> DirectoryStatistics:
        state = self._state[:-1]
        return DirectoryStatistics(
            capacity=self.num_slots,
            used=self.used,
            ready=int(np.count_nonzero(state == READY)),
            pinned=int(np.count_nonzero(self._pins)),
            storing=int(np.count_nonzero(state == STORING)),
            demoting=self._num_demoting,
            lookups=self.lookups,
            hits=self.hits,
            misses=self.misses,
            stores_prepared=self.stores_prepared,
            stores_skipped_present=self.stores_skipped_present,
            stores_skipped_threshold=self._admission.skipped if self._admission else 0,
            stores_skipped_full=self.stores_skipped_full,
            stores_completed=self.stores_completed,
            stores_failed=self.stores_failed,
            loads_prepared=self.loads_prepared,
            loads_completed=self.loads_completed,
            evictions=self.evictions,
            evictions_inline=self.evictions_inline,
            resets=self.resets,
            policy=self.policy.name,
            policy_stats=dict(self.policy.statistics()),
        )
