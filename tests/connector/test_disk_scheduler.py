"""The scheduler half of the disk tier, driven by hand (workers' reports are built here;
tests/connector/test_disk_worker.py runs the worker half, tests/e2e/test_disk_tier.py
both with real vLLM): write-through after a store, lookups over host and disk, a disk hit
read into a reserved host slot, failures, eviction into deletes, the start-time scan."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from kvferry import ConfigError
from kvferry.cache import GetStatistics
from kvferry.connector._metadata import KVFerryWorkerMetadata
from kvferry.tiers import DiskStore
from kvferry.tiers._format import file_size

from ._steps import (
    BLOCK,
    allocated,
    key,
    request,
    router_replay,
    scheduler_side,
    step,
    vllm_hashes,
)

SLOT_BYTES = 2 * 2 * BLOCK * 2 * 64 * 2  # 2 layers x (K, V) x 128 tokens x 2 heads x 64 x bf16


def disk_bytes(chunks: int) -> int:
    return chunks * file_size(SLOT_BYTES)


def reported(acks: dict[int, list[int]], disk_failed: dict[int, list[int]] | None = None) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(
        kv_connector_worker_meta=KVFerryWorkerMetadata(
            acks=acks, stats={}, disk_failed=disk_failed or {}
        ),
        finished_sending=None,
        finished_recving=None,
    )


@pytest.fixture
def side_for(make_vllm_config: Any, kv_cache_config: Any, tmp_path: Any) -> Any:
    def make(host_slots: int = 8, disk_chunks: int = 16, **config: Any) -> Any:
        tiers = [{"kind": "disk", "path": str(tmp_path), "bytes_to_use": disk_bytes(disk_chunks)}]
        return scheduler_side(
            make_vllm_config,
            kv_cache_config,
            cpu_bytes_to_use=host_slots * SLOT_BYTES,
            tiers=tiers,
            **config,
        )

    return make


@pytest.fixture
def side(side_for: Any) -> Iterator[Any]:
    with side_for() as s:
        yield s


def host(side: Any) -> Any:
    return side._ask(GetStatistics)


def store_request(side: Any, req: Any, blocks: list[int]) -> Any:
    """Plan the stores of ``req``'s full chunks; the metadata that carries them."""
    side.on_new_request(req)
    meta = side.build_connector_meta(
        step({req.request_id: (blocks,)}, {req.request_id: req.num_tokens})
    )
    assert meta.stores
    return meta


def write_through(side: Any, req: Any, blocks: list[int]) -> Any:
    """Store ``req`` to host memory; the next step's metadata carries its disk writes."""
    meta = store_request(side, req, blocks)
    side.update_connector_output(reported({s.copy.job_id: [1, 0] for s in meta.stores}))
    return side.build_connector_meta(step({}, {}))


def test_a_stored_block_is_written_down_with_its_host_slot_pinned(side: Any) -> None:
    a = request("a", 3 * BLOCK + 8)
    meta = write_through(side, a, [1, 2, 3, 4])
    [write] = meta.disk_writes
    assert write.chunks.keys == [key(a, c) for c in range(3)]
    assert host(side).ready == 3 and host(side).pinned == 3  # readable, not evictable
    assert side.disk.dir.statistics().storing == 3  # not a hit until written everywhere
    assert side.disk.ready([key(a, 0)]).tolist() == [False]

    side.update_connector_output(reported({write.job_id: [1, 0]}, {write.job_id: [0, 0, 0]}))
    assert host(side).pinned == 0
    assert side.disk.ready([key(a, c) for c in range(3)]).all()
    assert side.statistics().disk_chunks_written == 3
    stats = side.kv_connector_stats()
    assert stats["gauges"]["vllm:kvferry_disk_blocks_used"] == 3
    assert stats["counters"]["vllm:kvferry_disk_blocks_written"] == 3


def test_a_write_that_failed_is_not_a_hit(side: Any) -> None:
    a = request("a", 2 * BLOCK + 8)
    [write] = write_through(side, a, [1, 2, 3]).disk_writes
    side.update_connector_output(reported({write.job_id: [1, 1]}, {write.job_id: [1, 0]}))
    assert side.disk.ready([key(a, 0), key(a, 1)]).tolist() == [False, True]
    assert host(side).pinned == 0


def test_a_write_unreported_per_chunk_counts_as_failed(side: Any) -> None:
    """A worker that acks a write without its per-chunk outcomes: nothing is trusted."""
    a = request("a", 2 * BLOCK + 8)
    [write] = write_through(side, a, [1, 2, 3]).disk_writes
    side.update_connector_output(reported({write.job_id: [1, 0]}))
    assert not side.disk.ready([key(a, 0), key(a, 1)]).any()


def written(side: Any, req: Any, blocks: list[int]) -> None:
    [write] = write_through(side, req, blocks).disk_writes
    n = len(write.chunks.keys)
    side.update_connector_output(reported({write.job_id: [1, 0]}, {write.job_id: [0] * n}))


def evict_host(side: Any) -> None:
    from kvferry.cache import ClearAll

    side._ask(ClearAll)
    assert host(side).used == 0


def test_a_block_only_on_disk_is_a_hit_read_into_a_reserved_host_slot(side: Any) -> None:
    a = request("a", 3 * BLOCK + 8)
    written(side, a, [1, 2, 3, 4])
    evict_host(side)
    b = request("b", 3 * BLOCK + 8)  # the same prompt (the same seeded hashes)
    side.on_new_request(b)
    assert side.get_num_new_matched_tokens(b, 0) == (3 * BLOCK, True)
    assert side.disk.dir.statistics().pinned == 3  # leased: no eviction before the load
    side.update_state_after_alloc(b, allocated([5, 6, 7, 8]), 3 * BLOCK)
    [load] = side._pending_loads
    assert load.disk_reads is not None
    assert load.disk_reads.keys == [key(b, c) for c in range(3)]
    slots = load.disk_reads.slots
    assert (slots >= 0).all()
    assert [int(r) for r in load.copy.parts[0].host_rows] == slots.tolist()
    assert host(side).storing == 3  # reserved: neither a hit nor evictable

    side.build_connector_meta(step({}, {}))
    job = load.copy.job_id
    side.update_connector_output(reported({job: [1, 0]}, {job: [0, 0, 0]}))
    assert host(side).ready == 3 and host(side).pinned == 0  # promoted to host memory
    assert side.disk.dir.statistics().pinned == 0
    stats = side.statistics()
    assert stats.disk_tokens_hit == 3 * BLOCK and stats.tokens_hit == 3 * BLOCK


def test_a_hit_partly_in_host_memory_and_partly_on_disk_loads_both(side_for: Any) -> None:
    with side_for(host_slots=4) as side:
        a = request("a", 4 * BLOCK + 8)
        written(side, a, [1, 2, 3, 4, 5])
        other = request("o", 2 * BLOCK + 8, seed=9)
        written(side, other, [6, 7, 8])  # evicts two of a's from host memory: its tail
        on_host = [bool(side._ask(lambda r, k=k: _lookup(k, r))) for k in _keys(a, 4)]
        assert on_host == [True, True, False, False]
        b = request("b", 4 * BLOCK + 8)
        side.on_new_request(b)
        assert side.get_num_new_matched_tokens(b, 0) == (4 * BLOCK, True)
        side.update_state_after_alloc(b, allocated([9, 10, 11, 12, 13]), 4 * BLOCK)
        [load] = side._pending_loads
        assert load.disk_reads is not None
        assert load.disk_reads.keys == [key(b, 2), key(b, 3)]
        rows = [int(r) for r in load.copy.parts[0].host_rows]
        assert rows[2:] == load.disk_reads.slots.tolist() and min(rows) >= 0
        assert side.statistics().disk_tokens_hit == 2 * BLOCK


def _keys(req: Any, n: int) -> list[bytes]:
    return [key(req, c) for c in range(n)]


def _lookup(k: bytes, r: Any) -> Any:
    from kvferry.cache import Lookup

    return Lookup(keys=(k,), reply=r)


def disk_load(side: Any) -> Any:
    """Request "a" written down and gone from host memory; "b" (its prompt) loaded from
    disk: the load's spec, sent to the workers."""
    a = request("a", 2 * BLOCK + 8)
    written(side, a, [1, 2, 3])
    evict_host(side)
    b = request("b", 2 * BLOCK + 8)
    side.on_new_request(b)
    assert side.get_num_new_matched_tokens(b, 0) == (2 * BLOCK, True)
    side.update_state_after_alloc(b, allocated([5, 6, 7]), 2 * BLOCK)
    [load] = side._pending_loads
    side.build_connector_meta(step({}, {}))
    return load


def test_a_chunk_that_failed_its_read_is_dropped_and_deleted(side: Any) -> None:
    load = disk_load(side)
    a = request("a", 2 * BLOCK + 8)
    job = load.copy.job_id
    side.update_connector_output(reported({job: [1, 1]}, {job: [0, 1]}))  # chunk 1: corrupt
    assert side.disk.ready(_keys(a, 2)).tolist() == [True, False]
    assert host(side).ready == 1 and host(side).storing == 0  # the good one promoted
    assert side.build_connector_meta(step({}, {})).disk_deletes == [key(a, 1)]
    stats = side.statistics()
    assert (stats.loads_failed, stats.disk_loads_failed, stats.loads_failed_copy) == (1, 1, 0)
    # vLLM recomputes b's blocks: they are stored again (the chunk that failed its read
    # is nowhere now; the one promoted to host memory is skipped as present).
    meta = side.build_connector_meta(step({"b": ([5, 6, 7],)}, {"b": 2 * BLOCK + 8}))
    [store] = meta.stores
    assert [int(r) for r in store.copy.parts[0].device_blocks] == [6]


def test_the_disk_tier_evicts_into_deletes_and_never_a_pinned_chunk(side_for: Any) -> None:
    with side_for(disk_chunks=3) as side:
        a = request("a", 3 * BLOCK + 8)
        written(side, a, [1, 2, 3, 4])
        pins = side.disk.lease([key(a, 0)])  # a read in flight
        b = request("b", 2 * BLOCK + 8, seed=4)
        side.on_new_request(b)
        meta = write_through(side, b, [5, 6, 7])  # room by evicting two of a's
        assert side.disk.dir.statistics().evictions == 2
        assert len(meta.disk_writes) == 1
        # The files go before this step's writes (the same metadata, deletes first).
        assert sorted(meta.disk_deletes) == sorted(_keys(a, 3)[1:])
        assert side.disk.ready(_keys(a, 3)).tolist() == [True, False, False]
        side.disk.unpin(pins)


def test_a_disk_hit_is_cut_to_the_host_slots_it_can_be_read_into(side_for: Any) -> None:
    """Host slots for a disk hit are reserved by the lookup: the hit announced is only what
    can be read up now, whatever vLLM does before it allocates."""
    with side_for(host_slots=3) as side:
        a = request("a", 3 * BLOCK + 8)
        written(side, a, [1, 2, 3, 4])
        evict_host(side)
        # Two of the three host slots taken by stores in flight (STORING: never evicted).
        c = request("c", 2 * BLOCK + 8, seed=8)
        store_request(side, c, [5, 6, 7])
        b = request("b", 3 * BLOCK + 8)
        side.on_new_request(b)
        assert side.get_num_new_matched_tokens(b, 0) == (BLOCK, True)  # one slot: one chunk
        assert host(side).storing == 3 and side.disk.dir.statistics().pinned == 1
        assert side.statistics().disk_hits_cut == 1
        side.update_state_after_alloc(b, allocated([8, 9, 10, 11]), BLOCK)
        [load] = side._pending_loads
        assert load.disk_reads is not None and load.disk_reads.keys == [key(b, 0)]
        assert [int(r) for r in load.copy.parts[0].host_rows] == load.disk_reads.slots.tolist()


def test_a_disk_hit_never_allocated_gives_its_host_slots_back(side: Any) -> None:
    a = request("a", 2 * BLOCK + 8)
    written(side, a, [1, 2, 3])
    evict_host(side)
    b = request("b", 2 * BLOCK + 8)
    side.on_new_request(b)
    for _ in range(2):  # asked again: the first reservation is released, not stacked
        assert side.get_num_new_matched_tokens(b, 0) == (2 * BLOCK, True)
        assert host(side).storing == 2 and side.disk.dir.statistics().pinned == 2
    side.build_connector_meta(step({}, {}))  # the schedule pass ended without allocating
    assert host(side).storing == 0 and host(side).used == 0
    assert side.disk.dir.statistics().pinned == 0


def test_a_load_past_its_deadline_keeps_its_disk_slots_reserved_until_reported(
    make_vllm_config: Any, kv_cache_config: Any, tmp_path: Any
) -> None:
    """A late read still writes into its host slots: they are not freed (and reused by a
    store) before every worker reported the load."""
    from kvferry import FerryConfig
    from kvferry.connector._scheduler import SchedulerSide

    now = [0.0]
    extra = {
        "cpu_bytes_to_use": 8 * SLOT_BYTES,
        "job_timeout_s": 5.0,
        "tiers": [{"kind": "disk", "path": str(tmp_path), "bytes_to_use": disk_bytes(8)}],
    }
    side = SchedulerSide(
        make_vllm_config(extra), kv_cache_config, FerryConfig.from_dict(extra), clock=lambda: now[0]
    )
    try:
        load = disk_load(side)
        now[0] = 10.0
        meta = side.build_connector_meta(step({}, {}))
        assert meta.failed_load_job_ids == [load.copy.job_id]
        assert host(side).storing == 2  # still reserved
        side.update_connector_output(
            reported({load.copy.job_id: [1, 1]}, {load.copy.job_id: [0, 0]})
        )
        assert host(side).storing == 0
        assert side.disk.dir.statistics().pinned == 0
    finally:
        side.shutdown()


def test_a_second_request_waits_for_a_disk_load_of_the_same_blocks(side: Any) -> None:
    a = request("a", 2 * BLOCK + 8)
    written(side, a, [1, 2, 3])
    evict_host(side)
    b, c = request("b", 2 * BLOCK + 8), request("c", 2 * BLOCK + 8)
    for r in (b, c):
        side.on_new_request(r)
    side.get_num_new_matched_tokens(b, 0)
    side.update_state_after_alloc(b, allocated([5, 6, 7]), 2 * BLOCK)
    assert side.get_num_new_matched_tokens(c, 0) == (None, False)


def test_a_restarted_scheduler_finds_the_chunks_on_disk(
    make_vllm_config: Any, kv_cache_config: Any, tmp_path: Any
) -> None:
    from kvferry.connector._tiers import disk_fingerprint

    a = request("a", 3 * BLOCK + 8)
    extra = {
        "cpu_bytes_to_use": 8 * SLOT_BYTES,
        "tiers": [{"kind": "disk", "path": str(tmp_path), "bytes_to_use": disk_bytes(8)}],
    }
    fp = disk_fingerprint(make_vllm_config(extra), kv_cache_config, BLOCK, 0)
    store = DiskStore(tmp_path, disk_bytes(8), fp)
    payload = np.arange(SLOT_BYTES, dtype=np.uint8)
    for c in range(3):
        assert store.write(key(a, c), payload) == 0
    # A chunk of another engine (another fingerprint) beside ours is not ours.
    other = DiskStore(
        tmp_path,
        disk_bytes(8),
        disk_fingerprint(make_vllm_config(extra), kv_cache_config, 2 * BLOCK, 0),
    )
    other.write(key(a, 0), payload)
    with scheduler_side(make_vllm_config, kv_cache_config, **extra) as side:
        assert side.disk.restored == 3
        assert side.disk.ready(_keys(a, 3)).all()
        b = request("b", 3 * BLOCK + 8)
        side.on_new_request(b)
        assert side.get_num_new_matched_tokens(b, 0) == (3 * BLOCK, True)


def test_a_per_process_block_hash_stops_the_engine_at_start(
    make_vllm_config: Any, kv_cache_config: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvferry import FerryConfig
    from kvferry.connector._scheduler import SchedulerSide

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    extra = {
        "cpu_bytes_to_use": 8 * SLOT_BYTES,
        "tiers": [{"kind": "disk", "path": str(tmp_path), "bytes_to_use": disk_bytes(8)}],
    }
    config = make_vllm_config(extra)
    config.cache_config.prefix_caching_hash_algo = "xxhash"
    with pytest.raises(ConfigError, match="prefix_caching_hash_algo='sha256'"):
        SchedulerSide(config, kv_cache_config, FerryConfig.from_dict(extra))
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    SchedulerSide(config, kv_cache_config, FerryConfig.from_dict(extra)).shutdown()


@pytest.mark.parametrize(
    ("tier", "key_named"),
    [
        ({"bytes_to_use": 10}, "tiers[0].bytes_to_use"),
        ({"bytes_to_use": 1 << 60}, "tiers[0].bytes_to_use"),
        ({"path": "FILE"}, "tiers[0].path"),
    ],
)
def test_a_bad_path_or_size_stops_the_engine_at_start_naming_the_key(
    side_for: Any,
    tmp_path: Any,
    tier: dict[str, Any],
    key_named: str,
    make_vllm_config: Any,
    kv_cache_config: Any,
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    entry = {"kind": "disk", "path": str(tmp_path / "d"), "bytes_to_use": disk_bytes(8), **tier}
    if entry["path"] == "FILE":
        entry["path"] = str(a_file)
    with pytest.raises(ConfigError) as err:
        with scheduler_side(make_vllm_config, kv_cache_config, tiers=[entry]):
            pass
    assert err.value.key == key_named


def test_a_reset_clears_the_disk_tier_too(side: Any) -> None:
    a = request("a", 2 * BLOCK + 8)
    written(side, a, [1, 2, 3])
    assert side.reset()
    assert not side.disk.ready(_keys(a, 2)).any()
    assert sorted(side.build_connector_meta(step({}, {})).disk_deletes) == sorted(_keys(a, 2))


def test_a_write_a_reset_dropped_has_its_files_deleted_once_it_ended(side: Any) -> None:
    """The write still lands on every worker; it is not a hit, and its files are nobody's:
    left there, they would fill the tier behind the scheduler's back."""
    a = request("a", 2 * BLOCK + 8)
    [write] = write_through(side, a, [1, 2, 3]).disk_writes
    assert side.reset()
    assert side.build_connector_meta(step({}, {})).disk_deletes == []  # still writing
    side.update_connector_output(reported({write.job_id: [1, 0]}, {write.job_id: [0, 0]}))
    assert not side.disk.ready(_keys(a, 2)).any()
    assert sorted(side.build_connector_meta(step({}, {})).disk_deletes) == sorted(_keys(a, 2))
    assert side.disk.dir.statistics().used == 0


def test_a_reset_deletes_the_chunks_a_load_reads_only_once_the_load_ended(side: Any) -> None:
    """vLLM resets while a request waits for its KV from disk: the files of that load stay
    until it ended (the host tier keeps a pinned block's bytes the same way)."""
    load = disk_load(side)
    assert side.reset()
    assert side.build_connector_meta(step({}, {})).disk_deletes == []
    job = load.copy.job_id
    side.update_connector_output(reported({job: [1, 0]}, {job: [0, 0]}))
    a = request("a", 2 * BLOCK + 8)
    assert sorted(side.build_connector_meta(step({}, {})).disk_deletes) == sorted(_keys(a, 2))
    assert side.disk.dir.statistics().used == 0


def test_a_reset_keeps_the_deletes_of_chunks_evicted_before_it(side_for: Any) -> None:
    """An eviction's deletes go with the next step; a reset before it (vLLM calls it
    between steps) still sends them."""
    with side_for(disk_chunks=3) as side:
        a = request("a", 3 * BLOCK + 8)
        written(side, a, [1, 2, 3, 4])
        b = request("b", 2 * BLOCK + 8, seed=4)
        meta = store_request(side, b, [5, 6, 7])
        # Its store ended: b's writes evict two of a's chunks to make room.
        side.update_connector_output(reported({s.copy.job_id: [1, 0] for s in meta.stores}))
        assert side.disk.dir.statistics().evictions == 2
        assert side.reset()
        deletes = side.build_connector_meta(step({}, {})).disk_deletes
        assert sorted(deletes) == sorted(_keys(a, 3))  # the two evicted, and the one held


def chunks_on_disk(
    make_vllm_config: Any, kv_cache_config: Any, path: Any, keys: list[bytes]
) -> None:
    """Files of ``keys`` in the engine's namespace under ``path``, as a run before wrote."""
    from kvferry.connector._tiers import disk_fingerprint

    extra = {
        "cpu_bytes_to_use": 8 * SLOT_BYTES,
        "tiers": [{"kind": "disk", "path": str(path), "bytes_to_use": disk_bytes(8)}],
    }
    fp = disk_fingerprint(make_vllm_config(extra), kv_cache_config, BLOCK, 0)
    store = DiskStore(path, disk_bytes(8), fp)
    for k in keys:
        assert store.write(k, np.arange(SLOT_BYTES, dtype=np.uint8)) == 0


@contextmanager
def side_with_events(make_vllm_config: Any, kv_cache_config: Any, tmp_path: Any) -> Iterator[Any]:
    """A scheduler half with a disk tier of 8 chunks and vLLM's KV events on."""
    from vllm.config import KVEventsConfig

    from kvferry import FerryConfig
    from kvferry.connector._scheduler import SchedulerSide

    extra = {
        "cpu_bytes_to_use": 8 * SLOT_BYTES,
        "tiers": [{"kind": "disk", "path": str(tmp_path), "bytes_to_use": disk_bytes(8)}],
    }
    config = make_vllm_config(extra)
    config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    side = SchedulerSide(config, kv_cache_config, FerryConfig.from_dict(extra))
    try:
        yield side
    finally:
        side.shutdown()


def test_the_disk_tier_announces_its_blocks_complete_with_medium_disk(
    make_vllm_config: Any, kv_cache_config: Any, tmp_path: Any
) -> None:
    """A block written down is a BlockStored of medium DISK with its tokens and parent,
    as the host tier's (routers rebuild their keys from these fields)."""
    from vllm.distributed.kv_events import BlockStored

    with side_with_events(make_vllm_config, kv_cache_config, tmp_path) as side:
        a = request("a", 2 * BLOCK + 8)
        a.all_token_ids = list(range(1000, 1000 + 2 * BLOCK + 8))
        a.lora_request = None
        written(side, a, [1, 2, 3])
        stored = [e for e in side.take_events() if isinstance(e, BlockStored)]
        by_medium = {e.medium: e for e in stored}
        assert set(by_medium) == {"CPU", "DISK"}
        disk = by_medium["DISK"]
        assert disk.block_hashes == by_medium["CPU"].block_hashes  # as vLLM spells hashes
        assert len(disk.block_hashes) == 2
        assert disk.token_ids == list(range(1000, 1000 + 2 * BLOCK))
        assert disk.parent_block_hash is None and disk.block_size == BLOCK
        assert side._book.statistics().entries == 0  # nothing kept once announced


def test_after_a_reset_a_router_replaying_the_events_holds_the_host_blocks_stored_again(
    make_vllm_config: Any, kv_cache_config: Any, tmp_path: Any
) -> None:
    """A reset removes each tier's blocks by name, in its own medium: the host blocks a
    running request stores again in the next step, before vLLM takes the step's events,
    stay held in a router's view whatever order the tiers' events come in."""
    with side_with_events(make_vllm_config, kv_cache_config, tmp_path) as side:
        router: dict[str, set[Any]] = {}
        a = request("a", 2 * BLOCK + 8)
        a.all_token_ids, a.lora_request = list(range(2 * BLOCK + 8)), None
        meta = store_request(side, a, [1, 2, 3])
        a.num_computed_tokens = a.num_tokens
        side.update_connector_output(reported({s.copy.job_id: [1, 0] for s in meta.stores}))
        router_replay(router, side.take_events())
        [write] = side.build_connector_meta(step({}, {"a": 1})).disk_writes
        side.update_connector_output(reported({write.job_id: [1, 0]}, {write.job_id: [0, 0]}))
        router_replay(router, side.take_events())
        held = vllm_hashes([key(a, c) for c in range(2)])
        assert router["CPU"] == router["DISK"] == held

        assert side.reset()
        meta = side.build_connector_meta(step({}, {"a": 1}))
        side.update_connector_output(reported({s.copy.job_id: [1, 0] for s in meta.stores}))
        router_replay(router, side.take_events())
        assert side.get_num_new_matched_tokens(request("b", 2 * BLOCK + 8), 0) == (2 * BLOCK, True)
        assert router["CPU"] == held and router["DISK"] == set()


def test_a_restarted_engine_announces_the_chunks_it_found_on_disk(
    make_vllm_config: Any, kv_cache_config: Any, tmp_path: Any
) -> None:
    """A router drops a restarted engine's blocks; the chunks on disk are hits at once,
    so they are announced (medium DISK; vLLM's placeholder payload: their tokens are not
    known after a restart), and a router replaying the events routes to them."""
    from vllm.distributed.kv_events import BlockStored

    a = request("a", 3 * BLOCK + 8)
    keys = [key(a, c) for c in range(3)]
    chunks_on_disk(make_vllm_config, kv_cache_config, tmp_path, keys)
    with side_with_events(make_vllm_config, kv_cache_config, tmp_path) as side:
        assert side.disk.restored == 3
        router: dict[str, set[Any]] = {}
        events = side.take_events()
        router_replay(router, events)
        assert router.get("DISK") == vllm_hashes(keys)
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert all(e.token_ids == [] and e.block_size == 0 for e in stored)
        router_replay(router, side.take_events())
        assert router["DISK"] == vllm_hashes(keys)  # announced once


def test_chunks_found_at_start_are_announced_a_batch_a_step(
    make_vllm_config: Any, kv_cache_config: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Millions of chunks are announced over many steps, not all in the first."""
    from kvferry.connector import _disk_tier

    monkeypatch.setattr(_disk_tier, "RESTORED_EVENTS_PER_STEP", 2)
    a = request("a", 5 * BLOCK + 8)
    keys = [key(a, c) for c in range(5)]
    chunks_on_disk(make_vllm_config, kv_cache_config, tmp_path, keys)
    with side_with_events(make_vllm_config, kv_cache_config, tmp_path) as side:
        router: dict[str, set[Any]] = {}
        seen = []
        for _ in range(4):
            router_replay(router, side.take_events())
            seen.append(len(router["DISK"]))
        assert seen == [2, 4, 5, 5]
        assert router["DISK"] == vllm_hashes(keys)


def test_a_chunk_found_at_start_that_left_before_its_turn_is_never_announced(
    make_vllm_config: Any, kv_cache_config: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its removal went out before its turn came (a no-op for a router that never heard
    of it): announcing it then would leave it held in the router's view for good."""
    from kvferry.connector import _disk_tier

    monkeypatch.setattr(_disk_tier, "RESTORED_EVENTS_PER_STEP", 2)
    a = request("a", 5 * BLOCK + 8)
    keys = [key(a, c) for c in range(5)]
    chunks_on_disk(make_vllm_config, kv_cache_config, tmp_path, keys)
    with side_with_events(make_vllm_config, kv_cache_config, tmp_path) as side:
        router: dict[str, set[Any]] = {}
        router_replay(router, side.take_events())
        first = set(router["DISK"])
        assert len(first) == 2
        rest = [k for k in keys if not vllm_hashes([k]) & first]
        side.disk.reads_ended(rest, np.ones(len(rest), np.int64))  # failed reads drop them
        for _ in range(3):
            router_replay(router, side.take_events())
            assert router["DISK"] == first == vllm_hashes(list(side.disk.dir.visible_keys()))


def test_a_reset_ends_the_announcements_of_the_chunks_found_at_start(
    make_vllm_config: Any, kv_cache_config: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM resets the prefix cache before every chunk found at start was announced: the
    rest are no hits any more, and are not announced."""
    from kvferry.connector import _disk_tier

    monkeypatch.setattr(_disk_tier, "RESTORED_EVENTS_PER_STEP", 2)
    a = request("a", 5 * BLOCK + 8)
    chunks_on_disk(make_vllm_config, kv_cache_config, tmp_path, [key(a, c) for c in range(5)])
    with side_with_events(make_vllm_config, kv_cache_config, tmp_path) as side:
        router: dict[str, set[Any]] = {}
        router_replay(router, side.take_events())
        assert len(router["DISK"]) == 2
        assert side.reset()
        for _ in range(3):
            router_replay(router, side.take_events())
            assert router["DISK"] == set()


def test_a_later_pipeline_stage_has_the_fingerprint_the_scheduler_computes_for_it(
    make_vllm_config: Any, kv_cache_config: Any
) -> None:
    """vLLM gives the scheduler stage 0's KV-cache config ("the same except layer names"):
    a fingerprint naming the group's layers made the scheduler's idea of a later stage's
    fingerprint differ from that stage's worker's, so it found none of its chunks (a
    restart deleted the disk tier's chunks as held by some ranks only; a Redis tier never
    hit). With more than one stage the fingerprint names the stage's range of layers."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from kvferry.connector._tiers import disk_fingerprint, disk_leader, stage_layers

    from ._configs import pipeline_stage

    def pipeline(stages: int, rank: int) -> Any:
        return pipeline_stage(make_vllm_config({}), stages, rank)

    def layers(*numbers: int) -> Any:
        [group] = kv_cache_config.kv_cache_groups
        names = [f"model.layers.{i}.self_attn.attn" for i in numbers]
        return KVCacheConfig(
            num_blocks=16,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(names, group.kv_cache_spec)],
        )

    total = pipeline(2, 0).model_config.get_total_num_hidden_layers()
    assert total >= 2
    half = stage_layers(pipeline(2, 0), 1)
    assert half is not None and stage_layers(pipeline(2, 0), 0) == [0, half[0]]
    stage0, stage1 = layers(*range(half[0])), layers(*range(half[0], half[1]))
    # The scheduler (rank 0's config, stage 0's layers) and each stage's worker agree.
    for rank, own in ((0, stage0), (1, stage1)):
        scheduler_side = disk_fingerprint(pipeline(2, 0), stage0, BLOCK, rank)
        assert disk_fingerprint(pipeline(2, rank), own, BLOCK, rank) == scheduler_side
    # What the follower on stage 1 takes as its leader is stage 0's worker's.
    assert disk_leader(pipeline(2, 1), stage1, BLOCK, 1) == disk_fingerprint(
        pipeline(2, 0), stage0, BLOCK, 0
    )
    # Stages differ, and with one stage the layers still count.
    assert (
        disk_fingerprint(pipeline(2, 0), stage0, BLOCK, 0).digest
        != disk_fingerprint(pipeline(2, 0), stage0, BLOCK, 1).digest
    )
    one = pipeline(1, 0)
    assert disk_fingerprint(one, stage0, BLOCK, 0) != disk_fingerprint(one, stage1, BLOCK, 0)
