"""The host tier's directory: hits only after completed stores, pins, LRU, capacity."""

from __future__ import annotations

import numpy as np
import pytest

from kvferry.actors import ActorSystem
from kvferry.cache import (
    CompleteLoad,
    CompleteStore,
    Directory,
    DirectoryActor,
    GetStatistics,
    Lookup,
    PrepareLoad,
    PrepareStore,
)


def k(i: int) -> bytes:
    return i.to_bytes(8, "big")


def store(d: Directory, *keys: bytes) -> np.ndarray:
    slots = d.prepare_store(list(keys))
    d.complete_store(slots[slots >= 0], ok=True)
    return slots


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


def test_a_failed_store_is_never_visible_and_frees_its_slot() -> None:
    d = Directory(1)
    slots = d.prepare_store([k(1)])
    d.complete_store(slots, ok=False)
    assert d.lookup([k(1)]) == 0
    assert d.statistics().used == 0
    assert d.prepare_store([k(2)])[0] >= 0


def test_present_keys_are_skipped() -> None:
    d = Directory(4)
    store(d, k(1))
    assert d.prepare_store([k(1), k(2)])[0] == -1
    assert d.statistics().stores_skipped_present == 1


def test_lru_evicts_the_least_recently_used_ready_block() -> None:
    d = Directory(2)
    store(d, k(1))
    store(d, k(2))
    d.complete_load(d.prepare_load([k(1)]))  # k(1) used more recently than k(2)
    store(d, k(3))
    assert d.take_evicted() == [k(2)]
    assert d.lookup([k(1)]) == 1 and d.lookup([k(3)]) == 1


def test_pinned_and_storing_blocks_are_never_evicted() -> None:
    d = Directory(2)
    store(d, k(1))
    pinned = d.prepare_load([k(1)])
    assert pinned is not None
    d.prepare_store([k(2)])  # STORING
    assert list(d.prepare_store([k(3)])) == [-1]  # nothing evictable: skipped as full
    assert d.statistics().stores_skipped_full == 1
    d.complete_load(pinned)
    assert d.prepare_store([k(3)])[0] >= 0
    assert d.take_evicted() == [k(1)]


def test_capacity_is_never_exceeded() -> None:
    d = Directory(3)
    for i in range(10):
        store(d, k(i))
        assert d.statistics().used <= 3
    assert d.statistics().evictions == 7


def test_prepare_load_of_a_missing_key_pins_nothing() -> None:
    d = Directory(2)
    store(d, k(1))
    assert d.prepare_load([k(1), k(2)]) is None
    assert d.statistics().pinned == 0


@pytest.mark.anyio
async def test_directory_actor_answers_each_message() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(DirectoryActor(4))
        slots = await ref.ask(lambda r: PrepareStore(keys=(k(1), k(2)), reply=r))
        assert await ref.ask(lambda r: Lookup(keys=(k(1),), reply=r)) == 0
        await ref.tell(CompleteStore(slots=slots, ok=True))
        assert await ref.ask(lambda r: Lookup(keys=(k(1), k(2)), reply=r)) == 2
        pinned = await ref.ask(lambda r: PrepareLoad(keys=(k(2),), reply=r))
        assert pinned is not None and list(pinned) == [slots[1]]
        stats = await ref.ask(lambda r: GetStatistics(reply=r))
        assert stats.pinned == 1 and stats.ready == 2
        await ref.tell(CompleteLoad(slots=pinned))
        stats = await ref.ask(lambda r: GetStatistics(reply=r))
        assert stats.pinned == 0
