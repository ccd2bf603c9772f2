"""Test helpers for the host tier: a reference model of the directory, and keys.

:class:`ModelDirectory` is the obviously-right version of
:class:`~kvferry.cache.Directory`, in dicts and sets: it does not choose victims — a test
feeds it the directory's evictions (from the KV events) and the model checks that each was
allowed — and it predicts everything else (lookups, loads, slots in use, what is visible).
Every ``apply_*`` checks the DESIGN §4 invariants it can see (:class:`ModelMismatch`):

1. only a completed, ``ok`` store is a lookup hit;
2. a STORING or pinned block is never evicted, and its slot is never handed out again
   before the job ends;
5. never more than ``capacity`` slots in use.

Who owns what: plain objects owned by one test.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import attrs
import numpy as np
import numpy.typing as npt

from ._directory import Key

I64 = npt.NDArray[np.int64]


class ModelMismatch(AssertionError):
    """The directory did something the model says it must not (a test failure)."""


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise ModelMismatch(message)


def key(i: int, group: int = 0) -> Key:
    """A deterministic offload key: an 8-byte "hash" and a 4-byte group, like vLLM's."""
    return i.to_bytes(8, "big") + group.to_bytes(4, "big")


@attrs.define
class ModelEntry:
    slot: int
    ready: bool
    pins: int = 0
    stamp: int = 0
    """Recency, by the directory's documented rules (only LRU tests read it)."""


class ModelDirectory:
    """What a directory of ``capacity`` slots must hold, given the evictions it chose."""

    def __init__(self, capacity: int, *, store_threshold: int = 1) -> None:
        self.capacity = capacity
        self.store_threshold = store_threshold
        self.entries: dict[Key, ModelEntry] = {}
        self.dropped: dict[int, ModelEntry] = {}
        """Slots a reset dropped while a job used them: freed when the job ends."""
        self.offers: Counter[Key] = Counter()
        self.clock = 0

    # -- expectations ------------------------------------------------------------------

    def used(self) -> int:
        return len(self.entries) + len(self.dropped)

    def visible(self) -> set[Key]:
        return {k for k, e in self.entries.items() if e.ready}

    def pinned(self) -> int:
        return sum(1 for e in [*self.entries.values(), *self.dropped.values()] if e.pins)

    def lookup(self, keys: Sequence[Key]) -> int:
        n = 0
        for k in keys:
            e = self.entries.get(k)
            if e is None or not e.ready:
                break
            n += 1
        return n

    def evictable(self, protected: Iterable[Key] = ()) -> list[Key]:
        """Keys a policy may evict, least recently used first."""
        skip = set(protected)
        keys = [k for k, e in self.entries.items() if e.ready and not e.pins and k not in skip]
        return sorted(keys, key=lambda k: self.entries[k].stamp)

    def slots_in_use(self) -> set[int]:
        return {e.slot for e in self.entries.values()} | set(self.dropped)

    def _entry_of_slot(self, slot: int) -> tuple[Key | None, ModelEntry]:
        for k, e in self.entries.items():
            if e.slot == slot:
                return k, e
        _expect(slot in self.dropped, f"slot {slot} is not in use")
        return None, self.dropped[slot]

    def _stamp(self, keys: Sequence[Key]) -> None:
        """A batch's head becomes the most recent (the directory's LRU rule)."""
        for i, k in enumerate(keys):
            e = self.entries[k]
            e.stamp = max(e.stamp, self.clock + len(keys) - i)  # a repeated key: its first
        self.clock += len(keys)

    # -- effects, checked --------------------------------------------------------------

    def apply_evicted(self, keys: Iterable[Key], protected: Iterable[Key] = ()) -> None:
        allowed = set(self.evictable(protected))
        for k in keys:
            _expect(k in allowed, f"evicted {k!r}, which is not READY and unpinned (or protected)")
            allowed.discard(k)
            del self.entries[k]

    def apply_prepare_load(self, keys: Sequence[Key], slots: I64 | None) -> None:
        loadable = all(k in self.entries and self.entries[k].ready for k in keys)
        if slots is None:
            _expect(not loadable, "prepare_load refused READY keys")
            return
        _expect(loadable, "prepare_load pinned a key that is not READY")
        _expect([self.entries[k].slot for k in keys] == slots.tolist(), "pinned the wrong slots")
        for k in keys:
            self.entries[k].pins += 1
        # LRU: a load is no recency of its own; the request's touch when it ends is.

    def apply_complete_load(self, slots: I64) -> None:
        for s in slots.tolist():
            k, e = self._entry_of_slot(s)
            _expect(e.ready and e.pins > 0, f"slot {s} completed a load it was not pinned for")
            e.pins -= 1
            if k is None and not e.pins:
                del self.dropped[s]

    def present_ready(self, keys: Sequence[Key]) -> list[Key]:
        """Keys of a store offer that are READY: protected from this call's evictions."""
        return [k for k in keys if k in self.entries and self.entries[k].ready]

    def apply_prepare_store(self, keys: Sequence[Key], slots: I64) -> None:
        """After :meth:`apply_evicted` of the evictions the call made (a READY key offered
        again is no recency for LRU: the request's touch when it ends is)."""
        seen: set[Key] = set()
        full = False
        for k, s in zip(keys, slots.tolist(), strict=True):
            if k in self.entries or k in seen:
                _expect(s == -1 or k not in seen, f"{k!r} given a second slot")
                _expect(s == -1, f"present key {k!r} given a slot")
                continue
            seen.add(k)
            self.offers[k] += 1
            if self.offers[k] < self.store_threshold:
                _expect(s == -1, f"{k!r} stored before its {self.store_threshold}th offer")
                continue
            if s == -1:
                full = True
                continue
            _expect(0 <= s < self.capacity, f"slot {s} out of range")
            _expect(s not in self.slots_in_use(), f"slot {s} handed out twice")
            self.entries[k] = ModelEntry(slot=s, ready=False)
        _expect(self.used() <= self.capacity, "capacity exceeded")
        if full:
            _expect(self.used() == self.capacity, "a store was skipped as full with room left")

    def apply_complete_store(self, slots: I64, ok: bool) -> None:
        stored = []
        for s in slots.tolist():
            k, e = self._entry_of_slot(s)
            _expect(not e.ready, f"slot {s} completed a store twice")
            if k is None:
                del self.dropped[s]
            elif ok:
                e.ready = True
                stored.append(k)
            else:
                del self.entries[k]
        self._stamp(stored)

    def apply_touch(self, keys: Sequence[Key]) -> None:
        self._stamp([k for k in keys if k in self.entries and self.entries[k].ready])

    def apply_clear(self, keys: Sequence[Key]) -> None:
        expected = {k for k, e in self.entries.items() if e.ready and not e.pins}
        _expect(set(keys) == expected and len(keys) == len(expected), "clear dropped other keys")
        for k in keys:
            del self.entries[k]

    def apply_reset(self) -> None:
        for e in self.entries.values():
            if e.pins or not e.ready:
                self.dropped[e.slot] = e
        self.entries.clear()
