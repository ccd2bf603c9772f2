"""The host tier's block directory: which key lives in which host slot, in which state.

A slot is FREE, STORING (a store was prepared and has not completed: never a lookup hit,
never evicted) or READY (readable). A READY slot may be pinned by loads (a count);
pinned slots are never evicted. Eviction is LRU over READY, unpinned slots.

Per-slot state lives in numpy arrays; the key → slot map is one dict. This class is
plain, synchronous and single-owner: :class:`~kvferry.cache.DirectoryActor` owns one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt

FREE, STORING, READY = 0, 1, 2

Key = bytes


@attrs.frozen(kw_only=True)
class DirectoryStatistics:
    """Counters of one directory, in blocks (offloaded blocks, not engine blocks)."""

    capacity: int
    used: int
    ready: int
    pinned: int
    lookups: int
    hits: int
    misses: int
    stores_prepared: int
    stores_skipped_present: int
    stores_skipped_full: int
    stores_completed: int
    stores_failed: int
    loads_prepared: int
    loads_completed: int
    evictions: int


class Directory:
    """Key → slot bookkeeping with pins and LRU eviction, for ``num_slots`` host slots."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        self.num_slots = num_slots
        self._slot_of: dict[Key, int] = {}
        self._key_of: list[Key | None] = [None] * num_slots
        self._state = np.zeros(num_slots, dtype=np.int8)
        self._pins = np.zeros(num_slots, dtype=np.int32)
        # READY slots, least recently used first.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._c = dict.fromkeys(
            (
                "lookups", "hits", "misses", "stores_prepared", "stores_skipped_present",
                "stores_skipped_full", "stores_completed", "stores_failed",
                "loads_prepared", "loads_completed", "evictions",
            ),
            0,
        )
        self.evicted: list[Key] = []
        """Keys evicted since the last :meth:`take_evicted`."""

    # -- queries -----------------------------------------------------------------------

    def lookup(self, keys: Sequence[Key]) -> int:
        """Number of leading ``keys`` that are READY (a hit is only a completed store)."""
        n = 0
        for key in keys:
            slot = self._slot_of.get(key)
            if slot is None or self._state[slot] != READY:
                break
            n += 1
        self._c["lookups"] += 1
        self._c["hits"] += n
        self._c["misses"] += len(keys) - n
        return n

    def state_of(self, key: Key) -> int:
        slot = self._slot_of.get(key)
        return FREE if slot is None else int(self._state[slot])

    def slot_of(self, key: Key) -> int | None:
        return self._slot_of.get(key)

    # -- loads -------------------------------------------------------------------------

    def prepare_load(self, keys: Sequence[Key]) -> npt.NDArray[np.int64] | None:
        """Pin the READY slots of ``keys`` for a load; None (nothing pinned) if any is not READY."""
        slots = np.empty(len(keys), dtype=np.int64)
        for i, key in enumerate(keys):
            slot = self._slot_of.get(key)
            if slot is None or self._state[slot] != READY:
                return None
            slots[i] = slot
        for slot in slots.tolist():
            self._pins[slot] += 1
            self._lru.move_to_end(slot)
        self._c["loads_prepared"] += len(keys)
        return slots

    def complete_load(self, slots: npt.ArrayLike) -> None:
        """Unpin the slots of a finished (or failed) load."""
        for slot in np.asarray(slots, dtype=np.int64).tolist():
            assert self._state[slot] == READY and self._pins[slot] > 0, (slot, self._pins[slot])
            self._pins[slot] -= 1
            self._c["loads_completed"] += 1

    # -- stores ------------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[Key]) -> npt.NDArray[np.int64]:
        """Reserve a slot per key; -1 where the key is skipped.

        A key already STORING or READY is skipped (counted as present); when no slot is
        free and nothing is evictable, the key is skipped (counted as full): a skipped
        store is only a future miss.
        """
        slots = np.full(len(keys), -1, dtype=np.int64)
        for i, key in enumerate(keys):
            if key in self._slot_of:
                self._c["stores_skipped_present"] += 1
                continue
            slot = self._allocate()
            if slot < 0:
                self._c["stores_skipped_full"] += 1
                continue
            self._slot_of[key] = slot
            self._key_of[slot] = key
            self._state[slot] = STORING
            slots[i] = slot
            self._c["stores_prepared"] += 1
        return slots

    def complete_store(self, slots: npt.ArrayLike, ok: bool) -> None:
        """A prepared store finished: READY if ``ok``, else the slot is freed (never visible)."""
        for slot in np.asarray(slots, dtype=np.int64).tolist():
            assert self._state[slot] == STORING, (slot, self._state[slot])
            if ok:
                self._state[slot] = READY
                self._lru[slot] = None
                self._c["stores_completed"] += 1
            else:
                self._release(slot)
                self._c["stores_failed"] += 1

    # -- space -------------------------------------------------------------------------

    def _allocate(self) -> int:
        if self._free:
            return self._free.pop()
        for slot in self._lru:
            if self._pins[slot] == 0:
                key = self._key_of[slot]
                assert key is not None
                self.evicted.append(key)
                self._c["evictions"] += 1
                del self._lru[slot]
                self._release(slot, to_free_list=False)
                return slot
        return -1

    def _release(self, slot: int, *, to_free_list: bool = True) -> None:
        key = self._key_of[slot]
        assert key is not None
        del self._slot_of[key]
        self._key_of[slot] = None
        self._state[slot] = FREE
        self._lru.pop(slot, None)
        if to_free_list:
            self._free.append(slot)

    def clear(self) -> list[Key]:
        """Drop every READY, unpinned key; returns them. STORING and pinned slots stay."""
        dropped = []
        for slot in list(self._lru):
            if self._pins[slot] == 0:
                key = self._key_of[slot]
                assert key is not None
                dropped.append(key)
                self._release(slot)
        return dropped

    def take_evicted(self) -> list[Key]:
        evicted, self.evicted = self.evicted, []
        return evicted

    def statistics(self) -> DirectoryStatistics:
        state = self._state
        return DirectoryStatistics(
            capacity=self.num_slots,
            used=int(np.count_nonzero(state)),
            ready=int(np.count_nonzero(state == READY)),
            pinned=int(np.count_nonzero(self._pins)),
            **self._c,
        )
