"""The directory against a reference model, under random operations, for every policy.

Hypothesis drives a :class:`~kvferry.cache.Directory` and a
:class:`~kvferry.cache._testing.ModelDirectory` with the same operations — lookups, loads,
lookups' leases (unpinned, or loaded with ``load_leased``, a reset between or not), stores
(completed ok or failed, in any order, or completed pinned for a copy and unpinned later),
restores, touches, evictions, clears and resets; with ``write_back``, demotions taken and
ended — and after every step holds DESIGN §4 invariants 1 (a hit is only a completed
store), 2 (nothing in flight is evicted or handed out again) and 5 (capacity), and that
the KV events, replayed, give exactly the keys a lookup would hit, and that no call was a
broken invariant (``invariant_errors``) but the caller's bugs a rule makes on purpose (a
demotion ended before it was taken). The model learns each eviction from the events, and
checks that the policy was allowed to make it; under LRU with inline eviction it also
checks that the victims were the least recently used. A DEMOTING block (``write_back``)
is, in the model, an entry not ready (present, never a hit, never evicted) until its
demotion ends.
"""

from __future__ import annotations

import random
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
from kvferry.cache._testing import ModelDirectory, ModelEntry, key

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
    write_back: bool = False  # evicted blocks DEMOTING until their demotion ends

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
                write_back=self.write_back,
            )
        finally:
            _directory._KEEP_LOOKUPS_FROM, _directory._LOG_ORDER_FROM = thresholds
        assert self.d._keeps == self.keep_lookups
        self.model = ModelDirectory(CAPACITY, store_threshold=self.store_threshold)
        self.loads: list[Any] = []
        self.stores: list[Any] = []
        self.running: list[list[bytes]] = []  # requests' keys, touched when they end
        self.events: list[KVEvent] = []
        self.leases: list[Any] = []  # lookups' leases (pinned), not yet loaded or unpinned
        self.pinned_stores: list[Any] = []  # stores completed pinned, not yet unpinned
        self.listed: dict[int, bytes] = {}  # evicted (write_back), not yet taken: slot, key
        self.taken: list[Any] = []  # demotions taken, not yet ended
        # Restored keys (no event: nothing new was stored) by their model entries: visible
        # and not in the events' replay while that entry is theirs.
        self.restored: dict[bytes, ModelEntry] = {}
        self.invariant_errors = 0  # the caller's bugs a rule made on purpose

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
        slots = [self.model.entries[k].slot for k in removed if k in self.model.entries]
        self.model.apply_evicted(removed, protected)
        if self.write_back:  # present, never a hit, its slot held until its demotion ends
            for k, s in zip(removed, slots, strict=True):
                self.model.entries[k] = ModelEntry(slot=s, ready=False)
                self.listed[s] = k

    def _unpinned(self, slots: Any) -> None:
        """The model's side of one unpin per slot (a lease's, a pinned store's): a slot a
        reset dropped is freed at its last."""
        self.model.apply_complete_load(slots)

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

    @precondition(lambda self: self.stores)
    @rule(i=st.integers(0, 100), mask=st.integers(1, 31))
    def complete_store_pinned(self, i: int, mask: int) -> None:
        """A store completed with a ``pin`` (a copy still reads it: a write down to a lower
        tier) of some of its slots (``mask``, the first where it names none); one a reset
        dropped is pinned all the same, and freed at its unpin."""
        slots = self.stores.pop(i % len(self.stores))
        listed = slots.tolist()
        pin = [s for j, s in enumerate(listed) if mask >> j & 1] or listed[:1]
        dropped = [s for s in pin if s in self.model.dropped]
        self.d.complete_store(slots, True, pin=np.array(pin, np.int64))
        self.model.apply_complete_store(slots, True)
        for s in pin:
            if s in dropped:
                self.model.dropped[s] = ModelEntry(slot=s, ready=True, pins=1)
            else:
                [e] = [e for e in self.model.entries.values() if e.slot == s]
                e.pins += 1
        self.pinned_stores.append(np.array(pin, np.int64))

    @precondition(lambda self: self.pinned_stores)
    @rule(i=st.integers(0, 100))
    def unpin_store(self, i: int) -> None:
        """The copy of a store completed pinned is done."""
        slots = self.pinned_stores.pop(i % len(self.pinned_stores))
        assert self.d.unpin(slots) == len(slots)
        self._unpinned(slots)

    @rule(seed=st.integers(0, 2**16 - 1))
    def lookup_and_lease(self, seed: int) -> None:
        """A lookup's hit, leased (pinned) until the engine loads it or gives up: 1-4
        visible keys (where there are any), then 0-2 of any (from one drawn seed: lists
        drawn made every machine slower)."""
        rng = random.Random(seed)
        visible = sorted(self.model.visible())
        keys = rng.choices(visible, k=1 + rng.randrange(4)) if visible else []
        keys += rng.choices(KEYS, k=rng.randrange(3) if keys else 1 + rng.randrange(2))
        slots = self.d.lookup_and_lease(keys)
        n = self.model.lookup(keys)
        assert slots.tolist() == [self.model.entries[k].slot for k in keys[:n]]
        for k in keys[:n]:  # a key given twice: pinned twice
            self.model.entries[k].pins += 1
        if n:
            self.leases.append(slots)

    @precondition(lambda self: self.leases)
    @rule(roll=st.integers(0, 3))
    def reset_while_leased(self, roll: int) -> None:
        """A reset between a lookup's lease and its load (or its unpin)."""
        self.reset(roll)

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 100))
    def load_leased(self, i: int) -> None:
        """The engine loads a lease (a reset may have dropped its slots since): its pins
        become the load's."""
        self.d.load_leased(self.leases[i % len(self.leases)])
        self.loads.append(self.leases.pop(i % len(self.leases)))

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 100))
    def unpin_lease(self, i: int) -> None:
        """The engine gives a lease up."""
        slots = self.leases.pop(i % len(self.leases))
        assert self.d.unpin(slots) == len(slots)
        self._unpinned(slots)

    @rule(keys=keys_st)
    def restore(self, keys: list[bytes]) -> None:
        """A lower tier's blocks found at start: READY without a store, up to the free
        slots, keys present (in any state) skipped; no events."""
        m = self.d.restore(keys)
        new = [k for k in dict.fromkeys(keys) if k not in self.model.entries]
        assert m == min(len(new), CAPACITY - self.model.used())
        for k in new[:m]:
            s = self.d.slot_of(k)
            assert s is not None and 0 <= s < CAPACITY and s not in self.model.slots_in_use()
            self.model.entries[k] = self.restored[k] = ModelEntry(slot=s, ready=True)
        self.model._stamp(new[:m])  # admitted as a completed store is
        assert self._take() == ([], [])

    @precondition(lambda self: self.listed)  # write_back: an empty take is a no-op
    @rule(now=st.integers(0, 2))
    def take_demotions(self, now: int) -> None:
        """Demotions evicted since the last take, in order; those a reset dropped since
        are not handed out (freed now). Written down in parts, in any order: ``now`` of
        them (at most) end at once (rules chained across steps are rare under
        Hypothesis's swarm of rules: DEMOTING blocks would fill the directory)."""
        slots, keys = self.d.take_demotions()
        held = []
        for s, k in self.listed.items():
            e = self.model.entries.get(k)
            if e is not None and e.slot == s:
                held.append((s, k))
            else:  # a reset dropped it
                del self.model.dropped[s]
        self.listed = {}
        assert list(zip(slots.tolist(), keys, strict=True)) == held
        if len(slots):
            for part in np.array_split(slots, 2 if len(slots) > 2 else 1):
                self.taken.append(part)
            for _ in range(min(now, len(self.taken))):
                self.end_demotions(len(self.taken) - 1)

    @precondition(lambda self: self.listed)
    @rule(i=st.integers(0, 100))
    def end_demotion_not_taken(self, i: int) -> None:
        """A caller's bug: a demotion ended before take_demotions handed it out. Reported
        (one invariant error), and nothing changes: the next take hands it out still."""
        listed = list(self.listed)
        self.d.end_demotions(np.array([listed[i % len(listed)]], np.int64))
        self.invariant_errors += 1

    @precondition(lambda self: self.taken)
    @rule(i=st.integers(0, 100))
    def end_demotions(self, i: int) -> None:
        """A demotion written down (or given up) ends: its slot is free."""
        slots = self.taken.pop(i % len(self.taken))
        self.d.end_demotions(slots)
        for s in slots.tolist():
            k, e = self.model._entry_of_slot(s)
            assert not e.ready and not e.pins
            if k is None:
                del self.model.dropped[s]
            else:
                del self.model.entries[k]

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
        self.restored = {k: e for k, e in self.restored.items() if self.model.entries.get(k) is e}
        assert replay(self.events) == visible - set(self.restored)  # the events tell the truth
        assert self.d.used == self.model.used() <= CAPACITY  # invariant 5
        for k, e in self.model.entries.items():  # invariant 2: slots stay put
            assert self.d.slot_of(k) == e.slot
        stats = self.d.statistics()
        assert stats.pinned == self.model.pinned()
        assert stats.used == self.model.used()
        assert stats.demoting == len(self.listed) + sum(map(len, self.taken))
        assert self.d.invariant_errors == self.invariant_errors


def machine(max_examples: int = 80, **attrs: Any) -> type[DirectoryMachine]:
    cls = type(f"Directory_{attrs.get('policy', 'lru')}", (DirectoryMachine,), attrs)
    cls.TestCase.settings = settings(
        max_examples=max_examples,
        stateful_step_count=60,
        derandomize=True,
        database=None,
        deadline=None,
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
# A lower tier written on eviction (write: "on_evict"): evicted blocks DEMOTING until the
# demotions taken are ended; inline evictions and the evictor's, compiled and in Python.
# Half the examples each: the suite's time (see ``make test``).
TestLRUExactWriteBack = machine(40, policy="lru", check_lru_order=True, write_back=True).TestCase
TestS3FIFOWatermarksWriteBackInPython = machine(
    40, policy="s3fifo", watermarks=(0.5, 0.8), write_back=True, compiled=False
).TestCase
