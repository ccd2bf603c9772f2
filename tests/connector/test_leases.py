"""A lookup's hit is leased (pinned) until vLLM allocates its blocks, and the lease always
ends: nothing evicts a hit between get_num_new_matched_tokens and update_state_after_alloc,
and a hit vLLM never allocates holds nothing past its schedule pass."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvferry.cache import ClearAll, CompleteStore, GetStatistics, Lookup, PrepareStore

from ._steps import BLOCK, acked, allocated, key, request, scheduler_side, step, store_keys

SLOT_BYTES = 2 * 2 * BLOCK * 2 * 64 * 2  # 2 layers x (K, V) x 128 tokens x 2 heads x 64 x bf16


def pinned(side: Any) -> int:
    return int(side._ask(GetStatistics).pinned)


def stored(side: Any, keys: list[bytes]) -> list[int]:
    slots = side._ask(lambda r: PrepareStore(keys=tuple(keys), reply=r))
    side.directory_tell(CompleteStore(slots=slots, ok=True))
    return [int(s) for s in slots]


def load_rows(side: Any) -> list[int]:
    [load] = side._pending_loads
    return [int(r) for p in load.copy.parts for r in p.host_rows]


@pytest.fixture
def small(make_vllm_config: Any, kv_cache_config: Any) -> Iterator[Any]:
    """Eight host slots; the evictor brings six used down to four."""
    with scheduler_side(
        make_vllm_config,
        kv_cache_config,
        cpu_bytes_to_use=8 * SLOT_BYTES,
        eviction_watermarks=[0.5, 0.7],
    ) as side:
        assert side.geometry.num_slots == 8
        yield side


def test_an_eviction_queued_behind_the_lookup_spares_the_hit(small: Any) -> None:
    """The interleaving of issue 12: a store pushes occupancy past the high watermark, the
    evictor's EvictSome lands in the directory's mailbox behind the lookup, and is served
    before update_state_after_alloc's PrepareLoad. The hit's blocks are the oldest, so
    without a lease they are its victims and the load job gets no host rows."""
    a, other = request("a", 4 * BLOCK + 8), request("o", 3 * BLOCK + 8, seed=5)
    a_slots = stored(small, [key(a, c) for c in range(4)])  # the oldest: first to go
    store_keys(small, [key(other, c) for c in range(3)])  # 7 of 8 used: past the high mark
    small.on_new_request(a)

    assert small.get_num_new_matched_tokens(a, 0) == (4 * BLOCK, True)
    small.update_state_after_alloc(a, allocated([1, 2, 3, 4]), 4 * BLOCK)

    assert load_rows(small) == a_slots
    stats = small._ask(GetStatistics)
    assert stats.evictions == 3  # the evictor ran: it took the other request's blocks
    assert stats.pinned == 4


def test_a_clear_between_lookup_and_allocation_leaves_the_hit(small: Any) -> None:
    """Whatever evicts in between (here everything unpinned goes), the leased hit stays and
    its load gets a host row for every block."""
    a = request("a", 2 * BLOCK + 8)
    store_keys(small, [key(a, 0), key(a, 1)])
    small.on_new_request(a)
    assert small.get_num_new_matched_tokens(a, 0) == (2 * BLOCK, True)
    assert small._ask(ClearAll) == []
    small.update_state_after_alloc(a, allocated([7, 8]), 2 * BLOCK)
    rows = load_rows(small)
    assert len(rows) == 2 and min(rows) >= 0
    # The lease became the load's pins: one pin per block, released when the load ends.
    assert pinned(small) == 2
    [load] = small.build_connector_meta(step({}, {})).loads
    small.update_connector_output(acked(load.copy.job_id))
    assert pinned(small) == 0


def test_a_hit_never_allocated_is_released_when_the_schedule_pass_ends(small: Any) -> None:
    """vLLM may ask again and again for a request it cannot allocate: each pass's lease
    ends with the pass (build_connector_meta), and asking again does not stack pins."""
    a = request("a", 3 * BLOCK + 8)
    store_keys(small, [key(a, c) for c in range(3)])
    small.on_new_request(a)
    for _ in range(3):
        assert small.get_num_new_matched_tokens(a, 0) == (3 * BLOCK, True)
        assert small.get_num_new_matched_tokens(a, 0) == (3 * BLOCK, True)  # asked twice
        assert pinned(small) == 3
        small.build_connector_meta(step({}, {}))
        assert pinned(small) == 0


def test_an_allocation_without_external_tokens_releases_the_lease(small: Any) -> None:
    a = request("a", 2 * BLOCK + 8)
    store_keys(small, [key(a, 0), key(a, 1)])
    small.on_new_request(a)
    assert small.get_num_new_matched_tokens(a, 0) == (2 * BLOCK, True)
    small.update_state_after_alloc(a, allocated([1, 2, 3]), 0)
    assert pinned(small) == 0
    assert small._pending_loads == []


def test_an_aborted_waiting_request_releases_its_lease(small: Any) -> None:
    a = request("a", 2 * BLOCK + 8)
    store_keys(small, [key(a, 0), key(a, 1)])
    small.on_new_request(a)
    assert small.get_num_new_matched_tokens(a, 0) == (2 * BLOCK, True)
    assert small.request_finished(a, ([],)) == (False, {"kvferry": {"tokens_loaded": 0}})
    assert pinned(small) == 0


def test_a_deferred_lookup_holds_no_lease(small: Any) -> None:
    a, b = request("a", 2 * BLOCK + 8), request("b", 2 * BLOCK + 8)  # the same prompt
    store_keys(small, [key(a, 0), key(a, 1)])
    for r in (a, b):
        small.on_new_request(r)
    assert small.get_num_new_matched_tokens(a, 0) == (2 * BLOCK, True)
    small.update_state_after_alloc(a, allocated([1, 2]), 2 * BLOCK)
    assert small.get_num_new_matched_tokens(b, 0) == (None, False)
    assert pinned(small) == 2  # a's load only


def test_a_finished_request_refreshes_the_recency_of_its_blocks(
    make_vllm_config: Any, kv_cache_config: Any
) -> None:
    """Touch from request_finished: blocks a request just used (here loaded) are the last
    an inline eviction takes, as vLLM's own offloading orders them."""
    with scheduler_side(
        make_vllm_config,
        kv_cache_config,
        cpu_bytes_to_use=8 * SLOT_BYTES,
        eviction_watermarks=[1.0, 1.0],
    ) as side:
        a, other = request("a", 4 * BLOCK + 8), request("o", 4 * BLOCK + 8, seed=3)
        store_keys(side, [key(a, c) for c in range(4)])
        side.on_new_request(a)
        assert side.get_num_new_matched_tokens(a, 0) == (4 * BLOCK, True)
        side.update_state_after_alloc(a, allocated([1, 2, 3, 4]), 4 * BLOCK)
        [load] = side.build_connector_meta(step({}, {})).loads
        side.update_connector_output(acked(load.copy.job_id))
        store_keys(side, [key(other, c) for c in range(4)])  # full; a's blocks the oldest
        a.num_computed_tokens = a.num_tokens
        assert side.request_finished(a, ([1, 2, 3, 4, 5],))[0] is False
        store_keys(side, [b"new-1", b"new-2"])  # evicts two blocks inline
        assert side._ask(lambda r: Lookup(keys=tuple(key(a, c) for c in range(4)), reply=r)) == 4
        others = tuple(key(other, c) for c in range(4))
        assert side._ask(lambda r: Lookup(keys=others, reply=r)) == 2  # its tail went


def test_a_load_takes_its_lease_s_pins_without_asking_the_directory(small: Any) -> None:
    """The lease pins the hit's keys in order: the load takes those slots as they are (no
    PrepareLoad, no answer to wait for), counted a load, unpinned when it ends."""
    a = request("a", 4 * BLOCK + 8)
    slots = stored(small, [key(a, c) for c in range(4)])
    small.on_new_request(a)
    # The engine's own cache holds the first chunk: the hit is chunks 1-3.
    assert small.get_num_new_matched_tokens(a, BLOCK) == (3 * BLOCK, True)
    handled = small.directory.statistics().messages_handled
    small.update_state_after_alloc(a, allocated([5, 6, 7, 8]), 3 * BLOCK)
    assert small.directory.statistics().messages_handled == handled  # nothing asked
    assert load_rows(small) == slots[1:]
    stats = small._ask(GetStatistics)
    assert (stats.pinned, stats.loads_prepared) == (3, 3)
    [load] = small.build_connector_meta(step({}, {})).loads
    small.update_connector_output(acked(load.copy.job_id))
    assert pinned(small) == 0
