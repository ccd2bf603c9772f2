"""The host tier's directory: hits only after completed stores, pins, capacity, admission,
watermarks, clear and reset."""

from __future__ import annotations

import numpy as np
import pytest

from kvferry import ConfigError
from kvferry.cache import (
    BlocksRemoved,
    BlocksStored,
    Directory,
)
from kvferry.cache._testing import key as k

from ._compiled import both


def store(d: Directory, *keys: bytes) -> np.ndarray:
    slots = d.prepare_store(list(keys))
    d.complete_store(slots[slots >= 0], ok=True)
    return slots


def evicted(d: Directory) -> list[bytes]:
    return [key for e in d.take_events() if isinstance(e, BlocksRemoved) for key in e.keys]


def test_a_prepared_store_is_not_a_hit_until_it_completes() -> None:
    d = Directory(4)
    slots = d.prepare_store([k(1), k(2)])
    assert d.lookup([k(1), k(2)]) == 0
    d.complete_store(slots, ok=True)
    assert d.lookup([k(1), k(2), k(3)]) == 2


def test_lookup_counts_only_the_leading_ready_keys() -> None:
    d = Directory(4)
    store(d, k(1), k(3))
    assert d.lookup([k(1), k(2), k(3)]) == 1
    stats = d.statistics()
    assert (stats.lookups, stats.hits, stats.misses) == (1, 1, 2)


@pytest.mark.parametrize("seed", range(20))
def test_lookup_and_lease_is_a_lookup_then_a_lease_of_its_hit(seed: int) -> None:
    rng = np.random.default_rng(seed)
    one, two = Directory(16), Directory(16)
    for d in (one, two):  # the same history: some ready, some still being stored
        r = np.random.default_rng(seed)
        for _ in range(6):
            slots = d.prepare_store([k(int(i)) for i in r.integers(0, 24, 4)])
            live = slots[slots >= 0]
            d.complete_store(live[r.random(len(live)) < 0.8], ok=True)
    for _ in range(10):
        keys = [k(int(i)) for i in rng.integers(0, 24, int(rng.integers(0, 8)))]
        n = one.lookup(keys)
        want = one.lease(keys[:n])
        got = two.lookup_and_lease(keys)
        assert got.tolist() == want.tolist() and len(got) == n
    assert one.statistics() == two.statistics()
    assert one._pins.tolist() == two._pins.tolist()


def test_a_failed_store_is_never_visible_and_frees_its_slot() -> None:
    d = Directory(1)
    slots = d.prepare_store([k(1)])
    d.complete_store(slots, ok=False)
    assert d.lookup([k(1)]) == 0
    assert d.statistics().used == 0
    assert d.prepare_store([k(2)])[0] >= 0


@pytest.mark.parametrize("compiled", [False, None])
def test_a_failed_store_naming_a_slot_twice_frees_it_once(compiled: bool | None) -> None:
    """A caller's bug: the slot must not enter the free stack twice (two keys would then
    share it)."""
    d = Directory(3, compiled=compiled)
    slots = d.prepare_store([k(1), k(2)])
    d.complete_store(np.array([slots[0], slots[0], slots[1]]), ok=False)
    assert d.statistics().used == 0 and d.stores_failed == 2 and d.invariant_errors == 1
    new = d.prepare_store([k(3), k(4), k(5), k(6)])
    assert sorted(new[:3].tolist()) == [0, 1, 2] and new[3] == -1


@pytest.mark.parametrize("compiled", [False, None])
@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo"])
@pytest.mark.parametrize("n", [2, 60])  # a check in Python, or one sort (more than _SMALL)
def test_a_completed_store_naming_a_slot_twice_makes_it_ready_once(
    compiled: bool | None, policy: str, n: int
) -> None:
    """A caller's bug: the slot is admitted, counted and announced once, and evicted
    once (the policy does not hold it twice)."""
    d = Directory(n + 1, policy=policy, watermarks=(1.0, 1.0), events=True, compiled=compiled)
    keys = [k(i) for i in range(n)]
    slots = d.prepare_store(keys)
    d.complete_store(np.concatenate([slots, slots[:1]]), ok=True)
    assert d.stores_completed == n and d.statistics().used == n
    (stored,) = d.take_events()
    assert list(stored.keys) == keys
    assert d.lookup(keys) == n
    # Filling the directory again evicts every one of them, each once.
    fresh = [k(1000 + i) for i in range(n + 1)]
    assert (store(d, *fresh) >= 0).all()
    assert d.evictions == n and d.lookup(keys[:1]) == 0
    assert d.invariant_errors == 1  # the caller's bug is named
    assert d.statistics().used == n + 1


@pytest.mark.parametrize("compiled", [False, None])
@pytest.mark.parametrize("ok", [True, False])
def test_a_store_a_reset_dropped_naming_a_slot_twice_frees_it_once(
    compiled: bool | None, ok: bool
) -> None:
    """The stores in flight at a reset are freed when they end, each slot once: a slot
    named twice must not enter the free stack twice."""
    d = Directory(3, compiled=compiled)
    slots = d.prepare_store([k(1), k(2)])
    d.reset()
    d.complete_store(np.array([slots[0], slots[0], slots[1]]), ok=ok)
    assert d.statistics().used == 0 and d.lookup([k(1)]) == 0
    assert d.invariant_errors == 1
    new = d.prepare_store([k(3), k(4), k(5), k(6)])
    assert sorted(new[:3].tolist()) == [0, 1, 2] and new[3] == -1


@both
def test_a_store_a_reset_dropped_completed_with_a_pin_keeps_its_slot_until_the_unpin(
    compiled: bool,
) -> None:
    """``complete_store(..., pin=...)``: a copy still reads the slots (a write down to a
    lower tier; the connector's chunks read from Redis and kept on disk are a load's, which
    a reset does not mark stale). A store a reset dropped is never a hit, but its slot is
    not freed before that pin's unpin: handed to another store meanwhile, the write would
    read the new key's bytes, and its unpin would take the new key's pin (ABA)."""
    d = Directory(2, watermarks=(1.0, 1.0), compiled=compiled)
    old = d.prepare_store([k(1)])
    d.reset()
    d.complete_store(old, ok=True, pin=old)
    assert d.lookup([k(1)]) == 0
    new = d.prepare_store([k(2), k(3)])
    assert int(old[0]) not in new.tolist()  # still read: not handed out again
    assert d.used == 2 and d.statistics().pinned == 1
    d.complete_store(new[new >= 0], ok=True)
    leased = d.lookup_and_lease([k(2)])
    assert len(leased) == 1
    assert d.unpin(old) == 1  # the write ended: the slot is freed now, never a hit
    assert d.used == 1 and d.lookup([k(1)]) == 0
    # k(2)'s lease still holds: a store that needs room finds nothing evictable.
    assert d.prepare_store([k(3), k(4)])[1] == -1
    assert d.lookup([k(2)]) == 1 and d.statistics().pinned == 1
    assert d.invariant_errors == 0


@both
@pytest.mark.parametrize("write_back", [False, True])
def test_restored_blocks_are_evicted_after_an_eviction_that_found_nothing(
    compiled: bool, write_back: bool
) -> None:
    """An eviction that finds nothing evictable stops the evictor's (``room_short`` 0)
    until a block becomes evictable: a restore's blocks are (READY, unpinned). Written
    back, a store then finds no free slot: skipped as full (its inline eviction only
    demotes), while restored blocks could have been evicted ahead of it."""
    d = Directory(10, watermarks=(0.5, 0.9), write_back=write_back, compiled=compiled)
    storing = d.prepare_store([k(i) for i in range(10)])
    assert d.evict() == 0  # above the high watermark, and nothing evictable
    d.complete_store(storing[:5], ok=False)
    assert d.restore([k(100 + i) for i in range(5)]) == 5
    assert d.used == 10 and d.room_short() == 5
    assert d.evict() == 5  # the restored blocks, down to the low watermark
    if write_back:
        slots, _ = d.take_demotions()
        d.end_demotions(slots)
    assert d.prepare_store([k(200)])[0] >= 0
    assert d.stores_skipped_full == 0


@both
@pytest.mark.parametrize("write_back", [False, True])
def test_a_store_whose_own_keys_are_all_that_is_evictable_does_not_stop_the_evictor(
    compiled: bool, write_back: bool
) -> None:
    """A store's present keys are not evicted by that store (pinned for the call): its
    inline eviction may find nothing, but they are evictable as soon as it returns. The
    evictor's eviction must not stop as if nothing were (``room_short`` 0 until a block
    becomes evictable): written back, the next store would find no free slot again."""
    d = Directory(10, watermarks=(0.5, 0.9), write_back=write_back, compiled=compiled)
    for i in range(10):
        store(d, k(i))
    out = d.prepare_store([k(i) for i in range(10)] + [k(50)])
    assert out[-1] == -1  # full: every block is one of the store's own
    assert d.room_short() == 5
    assert d.evict() == 5
    if write_back:
        slots, _ = d.take_demotions()
        d.end_demotions(slots)
    assert d.prepare_store([k(60)])[0] >= 0
    assert d.stores_skipped_full == 1


def test_present_and_repeated_keys_are_skipped() -> None:
    d = Directory(4)
    store(d, k(1))
    slots = d.prepare_store([k(1), k(2), k(2)])
    assert slots[0] == -1 and slots[1] >= 0 and slots[2] == -1
    assert d.statistics().stores_skipped_present == 1


def test_lru_evicts_the_least_recently_used_ready_block() -> None:
    d = Directory(2, watermarks=(1.0, 1.0), events=True)
    store(d, k(1))
    store(d, k(2))
    d.complete_load(d.prepare_load([k(1)]))
    d.touch([k(1)])  # the request that loaded k(1) ended: used more recently than k(2)
    d.take_events()
    store(d, k(3))
    assert evicted(d) == [k(2)]
    assert d.lookup([k(1)]) == 1 and d.lookup([k(3)]) == 1


def test_a_prefix_loses_its_tail_first() -> None:
    d = Directory(3, watermarks=(1.0, 1.0), events=True)
    store(d, k(1), k(2), k(3))  # one request's prefix: k(1) is its head
    d.take_events()
    store(d, k(9))
    assert evicted(d) == [k(3)]


def test_pinned_and_storing_blocks_are_never_evicted() -> None:
    d = Directory(2, events=True)
    store(d, k(1))
    pinned = d.prepare_load([k(1)])
    assert pinned is not None
    d.prepare_store([k(2)])  # STORING
    assert list(d.prepare_store([k(3)])) == [-1]  # nothing evictable: skipped as full
    assert d.statistics().stores_skipped_full == 1
    d.complete_load(pinned)
    d.take_events()
    assert d.prepare_store([k(3)])[0] >= 0
    assert evicted(d) == [k(1)]


def test_keys_offered_for_store_are_not_evicted_by_that_store() -> None:
    d = Directory(2, watermarks=(1.0, 1.0), events=True)
    store(d, k(1))
    store(d, k(2))  # k(1) is the least recently used...
    d.take_events()
    d.prepare_store([k(1), k(3)])  # ...but offered again here: k(2) goes
    assert evicted(d) == [k(2)]


def test_capacity_is_never_exceeded() -> None:
    d = Directory(3, watermarks=(1.0, 1.0))
    for i in range(10):
        store(d, k(i))
        assert d.statistics().used <= 3
    assert d.statistics().evictions == 7


def test_prepare_load_of_a_missing_key_pins_nothing() -> None:
    d = Directory(2)
    store(d, k(1))
    assert d.prepare_load([k(1), k(2)]) is None
    assert d.statistics().pinned == 0


def test_store_threshold_admits_a_key_at_its_nth_offer() -> None:
    d = Directory(4, store_threshold=2)
    assert list(d.prepare_store([k(1)])) == [-1]
    assert d.statistics().stores_skipped_threshold == 1
    assert d.prepare_store([k(1)])[0] >= 0


def test_the_evictor_keeps_occupancy_between_the_watermarks() -> None:
    d = Directory(100, watermarks=(0.5, 0.9))
    for i in range(90):
        store(d, k(i))
    assert d.room_short() == 0  # at the high watermark, not above
    store(d, k(90))
    assert d.room_short() == 41
    assert d.evict() == 41
    assert d.used == 50 and d.room_short() == 0
    assert d.statistics().evictions_inline == 0


def test_an_inline_eviction_also_goes_down_to_the_low_watermark() -> None:
    d = Directory(10, watermarks=(0.5, 0.9))
    for i in range(10):
        store(d, k(i))
    store(d, k(10))  # no evictor ran: this store evicts, in one batch
    stats = d.statistics()
    assert stats.evictions_inline == stats.evictions == 6
    assert d.used == 5


def test_clear_drops_ready_unpinned_keys_only() -> None:
    d = Directory(4, events=True)
    store(d, k(1), k(2))
    pinned = d.prepare_load([k(2)])
    d.prepare_store([k(3)])
    d.take_events()
    assert d.clear() == [k(1)]
    assert d.take_events() == [BlocksRemoved(keys=[k(1)])]
    assert pinned is not None and d.lookup([k(2)]) == 1


def test_reset_hides_everything_and_frees_slots_in_flight_when_their_jobs_end() -> None:
    d = Directory(3, events=True)
    store(d, k(1), k(2))
    pinned = d.prepare_load([k(1)])
    storing = d.prepare_store([k(3)])
    assert pinned is not None
    d.take_events()
    removed = d.discard([k(2)])
    store(d, k(2))
    assert d.reset() == 2
    # An eviction before it still counts; k(1) too, though a load still reads it: it is
    # no longer a hit. k(3) never was. By name: no AllBlocksCleared (it names no medium).
    assert d.take_events() == [
        BlocksRemoved(keys=removed),
        BlocksStored(keys=[k(2)]),
        BlocksRemoved(keys=[k(1), k(2)]),
    ]
    assert d.lookup([k(1)]) == 0 and d.lookup([k(2)]) == 0
    assert d.used == 2  # k(1)'s slot is still read by a load, k(3)'s still written
    d.complete_store(storing, ok=True)
    assert d.lookup([k(3)]) == 0  # a store from before the reset never shows
    d.complete_load(pinned)
    assert d.used == 0
    assert d.take_events() == []


def test_events_record_stores_and_evictions_in_order() -> None:
    d = Directory(2, watermarks=(1.0, 1.0), events=True)
    store(d, k(1), k(2))
    store(d, k(3))
    assert d.take_events() == [
        BlocksStored(keys=[k(1), k(2)]),
        BlocksRemoved(keys=[k(2)]),
        BlocksStored(keys=[k(3)]),
    ]


def test_no_events_are_kept_unless_asked_for() -> None:
    d = Directory(2)
    store(d, k(1))
    assert d.take_events() == []


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"policy": "mru"}, "eviction_policy"),
        ({"policy": "no.such.module:Policy"}, "eviction_policy"),
        ({"policy": "kvferry.cache:Directory"}, "eviction_policy"),
        ({"watermarks": (0.9, 0.5)}, "eviction_watermarks"),
        ({"watermarks": (0.0, 0.5)}, "eviction_watermarks"),
        ({"store_threshold": 0}, "store_threshold"),
    ],
)
def test_bad_settings_name_their_config_key(kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        Directory(4, **kwargs)  # type: ignore[arg-type]
    assert err.value.key == key


def test_statistics_report_the_policy() -> None:
    d = Directory(4, policy="ARC")
    store(d, k(1))
    stats = d.statistics()
    assert stats.policy == "arc"
    assert stats.policy_stats["t1"] == 1
    assert stats.occupancy == 0.25


def test_admission_forgets_the_least_recently_offered_keys_first() -> None:
    from kvferry.cache import AdmissionFilter
    from kvferry.cache._table import tags_of

    adm = AdmissionFilter(2, tracker_size=2)
    a, b, c = (tags_of([k(i)]) for i in range(3))
    assert adm.offer(a).tolist() == [False]
    assert adm.offer(b).tolist() == [False]
    assert adm.offer(a).tolist() == [True]  # a's second offer; a is the youngest again
    assert adm.offer(c).tolist() == [False]  # two keys fit: b, offered least recently, goes
    assert adm.offer(b).tolist() == [False]  # b counts from one again (a goes)
    assert adm.offer(c).tolist() == [True]
    assert adm.skipped == 4


def test_an_unknown_index_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r'"compact", "dict" or None, got \'hash\''):
        Directory(4, index="hash")
