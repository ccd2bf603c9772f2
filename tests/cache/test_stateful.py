"""The directory against a reference model, under random operations, for every policy.

Hypothesis drives a :class:`~kvferry.cache.Directory` and a
:class:`~kvferry.cache._testing.ModelDirectory` with the same operations — lookups, loads,
stores (completed ok or failed, in any order), touches, evictions, clears and resets —
and after every step holds DESIGN §4 invariants 1 (a hit is only a completed store),
2 (nothing in flight is evicted or handed out again) and 5 (capacity), and that the KV
events, replayed, give exactly the keys a lookup would hit. The model learns each
eviction from the events, and checks that the policy was allowed to make it; under LRU
with inline eviction it also checks that the victims were the least recently used.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvferry.cache import (
    BlocksRemoved,
    BlocksStored,
    Directory,
    KVEvent,
    _directory,
    _kernels,
    replay,
)
from kvferry.cache._testing import ModelDirectory, key

CAPACITY = 5
KEYS = [key(i) for i in range(10)]

keys_st = st.lists(st.sampled_from(KEYS), min_size=1, max_size=5)


class RandomPolicy:
    """A user policy (loaded by import path in the tests): seeded random victims."""

    name = "random"

    def __init__(self, capacity: int) -> None:
        self._rng = np.random.default_rng(0)
        self._all = np.arange(capacity)

    def admit(self, slots: Any, tags: Any) -> None:
        pass

    def reuse(self, slots: Any) -> None:
        pass

    def touch(self, slots: Any) -> None:
        pass

    def store_miss(self, tags: Any) -> None:
        pass

    def victims(self, n: int, evictable: Any, tags: Any) -> Any:
        cand = self._all[evictable(self._all)]  # a whole-cache mask: fine for a toy
        return self._rng.permutation(cand)[:n]

    def forget(self, slots: Any) -> None:
        pass

    def clear(self) -> None:
        pass

    def statistics(self) -> dict[str, float]:
        return {}


class DirectoryMachine(RuleBasedStateMachine):
    policy: str = "lru"
    watermarks: tuple[float, float] = (1.0, 1.0)
    store_threshold: int = 1
    check_lru_order: bool = False
    compiled: bool | None = None  # the compiled loops where numba is installed
    keep_lookups: bool = False  # requests' lookups kept for their touch (from 1M slots)
    index: str | None = None  # the directory's default (a dict at this size)
    log_order: bool = False  # LRU's order in logs even at (1, 1) (from 1M slots)

    def __init__(self) -> None:
        super().__init__()
        thresholds = _directory._KEEP_LOOKUPS_FROM, _directory._LOG_ORDER_FROM
        if self.keep_lookups:
            _directory._KEEP_LOOKUPS_FROM = 0
        if self.log_order:
            _directory._LOG_ORDER_FROM = 0
        try:
            self.d = Directory(
                CAPACITY,
                policy=self.policy,
                watermarks=self.watermarks,
                store_threshold=self.store_threshold,
                events=True,
                index=self.index,
                compiled=self.compiled,
            )
        finally:
            _directory._KEEP_LOOKUPS_FROM, _directory._LOG_ORDER_FROM = thresholds
        assert self.d._keeps == self.keep_lookups
        self.model = ModelDirectory(CAPACITY, store_threshold=self.store_threshold)
        self.loads: list[Any] = []
        self.stores: list[Any] = []
        self.running: list[list[bytes]] = []  # requests' keys, touched when they end
        self.events: list[KVEvent] = []

    def _take(self) -> tuple[list[bytes], list[bytes]]:
        """This step's events: (stored keys, removed keys)."""
        events = self.d.take_events()
        self.events.extend(events)
        stored = [k for e in events if isinstance(e, BlocksStored) for k in e.keys]
        removed = [k for e in events if isinstance(e, BlocksRemoved) for k in e.keys]
        return stored, removed

    def _evicted(self, removed: list[bytes], protected: list[bytes]) -> None:
        if self.check_lru_order:
            oldest = self.model.evictable(protected)[: len(removed)]
            assert set(removed) == set(oldest), (removed, oldest)
        self.model.apply_evicted(removed, protected)

    @rule(keys=keys_st)
    def lookup(self, keys: list[bytes]) -> None:
        assert self.d.lookup(keys) == self.model.lookup(keys)

    @rule(keys=keys_st)
    def prepare_load(self, keys: list[bytes]) -> None:
        slots = self.d.prepare_load(keys)
        self.model.apply_prepare_load(keys, slots)
        if slots is not None and len(slots):
            self.loads.append(slots)

    @rule(keys=keys_st)
    def request(self, keys: list[bytes]) -> None:
        """What the connector does for a new request: load the hit prefix, store the rest."""
        n = self.d.lookup(keys)
        assert n == self.model.lookup(keys)
        if n:
            self.prepare_load(keys[:n])
        self.prepare_store(keys[n:])
        self.running.append(keys)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def request_ends(self, i: int) -> None:
        """A request ends: the touch of its keys (its lookup's, where they are kept)."""
        self.touch(self.running.pop(i % len(self.running)))

    @precondition(lambda self: self.model.visible())
    @rule(data=st.data())
    def load_hits(self, data: st.DataObject) -> None:
        """A request that found its prefix: load some of the visible keys."""
        keys = data.draw(
            st.lists(st.sampled_from(sorted(self.model.visible())), min_size=1, max_size=4)
        )
        self.prepare_load(keys)

    @precondition(lambda self: self.loads)
    @rule(i=st.integers(0, 100))
    def complete_load(self, i: int) -> None:
        slots = self.loads.pop(i % len(self.loads))
        self.d.complete_load(slots)
        self.model.apply_complete_load(slots)

    @rule(keys=keys_st)
    def prepare_store(self, keys: list[bytes]) -> None:
        protected = self.model.present_ready(keys)
        slots = self.d.prepare_store(keys)
        stored, removed = self._take()
        assert not stored
        self._evicted(removed, protected)
        self.model.apply_prepare_store(keys, slots)
        live = slots[slots >= 0]
        # A store job may complete in parts, in any order.
        for part in np.array_split(live, 2 if len(live) > 2 else 1):
            if len(part):
                self.stores.append(part)

    @precondition(lambda self: self.stores)
    @rule(i=st.integers(0, 100), ok=st.sampled_from([True, True, True, False]))
    def complete_store(self, i: int, ok: bool) -> None:
        slots = self.stores.pop(i % len(self.stores))
        self.d.complete_store(slots, ok)
        self.model.apply_complete_store(slots, ok)

    @rule(keys=keys_st)
    def touch(self, keys: list[bytes]) -> None:
        self.d.touch(keys)
        self.model.apply_touch(keys)

    @rule()
    def evict(self) -> None:
        """What the evictor does between messages: down to the low watermark."""
        short = self.d.room_short()
        evictable = len(self.model.evictable())
        assert self.d.evict() == min(short, evictable)  # no block lost from the policy's order
        stored, removed = self._take()
        assert not stored
        self._evicted(removed, [])

    @rule(roll=st.integers(0, 3))
    def evict_everything(self, roll: int) -> None:
        """A policy yields every evictable block, however long its pinned ones stayed."""
        if roll:
            return
        evictable = len(self.model.evictable())
        assert self.d._evict(self.d.num_slots, None) == evictable
        stored, removed = self._take()
        self._evicted(removed, [])

    # Clears and resets wipe the state the other rules build: make them rare.
    @rule(roll=st.integers(0, 7))
    def clear(self, roll: int) -> None:
        if roll:
            return
        keys = self.d.clear()
        self.model.apply_clear(keys)
        self._take()

    @rule(roll=st.integers(0, 7))
    def reset(self, roll: int) -> None:
        if roll:
            return
        self.d.reset()
        self.model.apply_reset()
        self._take()

    @invariant()
    def holds_what_the_model_holds(self) -> None:
        self.events.extend(self.d.take_events())
        visible = self.model.visible()
        assert self.d.visible_keys() == visible  # invariant 1
        assert replay(self.events) == visible  # the events tell the truth
        assert self.d.used == self.model.used() <= CAPACITY  # invariant 5
        for k, e in self.model.entries.items():  # invariant 2: slots stay put
            assert self.d.slot_of(k) == e.slot
        stats = self.d.statistics()
        assert stats.pinned == self.model.pinned()
        assert stats.used == self.model.used()


def machine(**attrs: Any) -> type[DirectoryMachine]:
    cls = type(f"Directory_{attrs.get('policy', 'lru')}", (DirectoryMachine,), attrs)
    cls.TestCase.settings = settings(
        max_examples=80, stateful_step_count=60, derandomize=True, database=None, deadline=None
    )
    return cls


TestLRUExact = machine(policy="lru", check_lru_order=True).TestCase
TestLRUWatermarks = machine(policy="lru", watermarks=(0.5, 0.8)).TestCase
TestARC = machine(policy="arc").TestCase
TestARCWatermarks = machine(policy="arc", watermarks=(0.5, 0.8)).TestCase
TestS3FIFO = machine(policy="s3fifo").TestCase
TestS3FIFOWatermarks = machine(policy="s3fifo", watermarks=(0.5, 0.8)).TestCase
TestUserPolicy = machine(policy="tests.cache.test_stateful:RandomPolicy").TestCase
TestAdmission = machine(policy="arc", store_threshold=2).TestCase
# The directory's loops in Python, where the others run compiled (numba installed).
TestLRUExactInPython = machine(policy="lru", check_lru_order=True, compiled=False).TestCase
TestARCInPython = machine(policy="arc", compiled=False).TestCase
TestS3FIFOWatermarksInPython = machine(
    policy="s3fifo", watermarks=(0.5, 0.8), compiled=False
).TestCase
# Requests' lookups kept for their touches (the compiled loops do that from a million slots).
needs_numba = pytest.mark.skipif(_kernels.load() is None, reason="numba is not installed")
TestLRUExactKeepingLookups = needs_numba(
    machine(policy="lru", check_lru_order=True, compiled=True, keep_lookups=True).TestCase
)
TestARCKeepingLookups = needs_numba(
    machine(policy="arc", compiled=True, keep_lookups=True).TestCase
)
# The compact index (compiled where numba is installed, and in Python), and the directory
# as it is from a million slots: compact, its lookups kept, LRU's order in logs.
TestLRUExactCompact = machine(policy="lru", check_lru_order=True, index="compact").TestCase
TestS3FIFOWatermarksCompact = machine(
    policy="s3fifo", watermarks=(0.5, 0.8), index="compact"
).TestCase
TestARCCompactInPython = machine(policy="arc", index="compact", compiled=False).TestCase
TestLRUExactAsFromAMillionSlots = needs_numba(
    machine(
        policy="lru",
        check_lru_order=True,
        compiled=True,
        keep_lookups=True,
        index="compact",
        log_order=True,
    ).TestCase
)
TestARCAsFromAMillionSlots = needs_numba(
    machine(policy="arc", compiled=True, keep_lookups=True, index="compact").TestCase
)
