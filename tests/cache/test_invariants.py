"""A call that would break the directory's invariants (a bug elsewhere, or a user's policy)
leaves the slots concerned alone, is logged and counted, and raises nothing: the engine
it runs in keeps going, with or without ``python -O``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvferry.cache import BlocksRemoved, Directory, LRUPolicy
from kvferry.cache._testing import key as k

from ._compiled import both


def ready(d: Directory, *keys: bytes) -> np.ndarray:
    slots = d.prepare_store(list(keys))
    d.complete_store(slots, ok=True)
    return slots


def test_unpinning_a_slot_not_pinned_leaves_it_alone(caplog: pytest.LogCaptureFixture) -> None:
    d = Directory(4)
    slots = ready(d, k(1), k(2))
    pinned = d.prepare_load([k(1)])
    assert pinned is not None
    d.complete_load([int(pinned[0]), int(slots[1]), 99])  # slot 1 was never pinned; 99 no slot
    assert d.invariant_errors == 1
    assert "unpin_of_a_slot_not_pinned" in caplog.text
    stats = d.statistics()
    assert (stats.pinned, stats.ready, stats.loads_completed) == (0, 2, 1)
    assert d.lookup([k(1), k(2)]) == 2


def test_completing_a_store_twice_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    d = Directory(4)
    slots = ready(d, k(1))
    d.complete_store(slots, ok=False)  # already READY: a failure now must not free it
    assert d.invariant_errors == 1
    assert "complete_store_of_a_slot_not_storing" in caplog.text
    assert d.lookup([k(1)]) == 1 and d.used == 1


def test_a_load_of_slots_no_lookup_leased_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    d = Directory(4)
    slots = ready(d, k(1), k(2))
    leased = d.lease([k(1)])
    d.load_leased(leased)  # a lease: fine
    assert d.invariant_errors == 0
    d.load_leased(np.array([slots[1], 99], np.int64))  # never leased; no slot
    assert d.invariant_errors == 1
    assert "load_of_slots_not_leased" in caplog.text
    assert d.statistics().pinned == 1  # nothing pinned by the bad call


@both
@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo"])
@pytest.mark.parametrize("bad", [99, -1])
def test_a_load_of_slots_no_lookup_leased_is_no_reuse_for_the_policy(
    policy: str, bad: int, compiled: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The slots a bad ``load_leased`` names are left alone, the policy's order too: a
    slot out of range would make the policy's next decision raise (an IndexError out of
    a later store), and slot -1 would count a reuse of the last slot."""
    d = Directory(4, policy=policy, watermarks=(1.0, 1.0), events=True, compiled=compiled)
    for i in range(4):
        ready(d, k(i))
    d.load_leased(np.array([bad], np.int64))
    assert d.invariant_errors == 1
    assert "load_of_slots_not_leased" in caplog.text
    d.take_events()
    assert ready(d, k(9))[0] >= 0  # full: the oldest block, never reused, goes
    removed = [key for e in d.take_events() if isinstance(e, BlocksRemoved) for key in e.keys]
    assert removed == [k(0)]
    assert d.statistics().policy_stats.get("promotions", 0) == 0


class _Greedy(LRUPolicy):
    """Offers every slot, evictable or not, twice."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.capacity = capacity

    def victims(self, n: int, evictable: Any, tags: np.ndarray) -> np.ndarray:
        everything = np.arange(self.capacity, dtype=np.int64)
        return np.concatenate([everything, everything])


def test_a_policy_choosing_pinned_or_storing_slots_evicts_only_its_valid_choices(
    caplog: pytest.LogCaptureFixture,
) -> None:
    d = Directory(4, policy=_Greedy(4), watermarks=(1.0, 1.0))
    ready(d, k(1), k(2))
    assert d.prepare_load([k(1)]) is not None  # pinned
    storing = d.prepare_store([k(3)])  # STORING
    d.prepare_store([k(4)])
    # Full: the next store evicts inline, and the policy offers everything.
    new = d.prepare_store([k(5)])
    assert new[0] >= 0
    assert d.invariant_errors == 1
    assert "policy_chose_a_slot_not_evictable" in caplog.text
    assert d.lookup([k(1)]) == 1  # the pinned block stayed
    assert d.lookup([k(2)]) == 0  # the one evictable block went
    d.complete_store(storing, ok=True)
    assert d.lookup([k(3)]) == 1
