"""TierWrites alone, without vLLM: which chunks a store or a demotion sends down to the
disk, what the directory is told and when, and what a write's end changes. Its
collaborators are real (a DiskTier on a temporary directory, a BlockBook); the directory
is a recorder of what it is told. The Redis paths (write-through, write again,
keep-on-disk) run in tests/connector/test_redis_both_halves.py on a real server."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest

from kvferry._config import DiskTierConfig
from kvferry.cache import CompleteStore, Demotions, EndDemotions, TakeDemotions, Unpin
from kvferry.connector._blockinfo import BlockBook
from kvferry.connector._disk_tier import DiskTier
from kvferry.connector._metadata import KEPT, KVFerryWorkerMetadata
from kvferry.connector._requests import JobState
from kvferry.connector._writes import TierWrites
from kvferry.tiers._format import file_size

from ..tiers.conftest import FP

PAYLOAD = 4096


def keys(*ns: int) -> tuple[bytes, ...]:
    return tuple(n.to_bytes(32, "big") + bytes(4) for n in ns)


def slots(*ns: int) -> Any:
    return np.array(ns, np.int64)


class Directory:
    """What TierWrites tells the host directory, in order; ``demoted`` answers its ask."""

    def __init__(self) -> None:
        self.told: list[Any] = []
        self.demoted = Demotions(slots=slots(), keys=())

    def ask(self, make: Any) -> Any:
        msg = make(None)
        assert isinstance(msg, TakeDemotions)
        demoted, self.demoted = self.demoted, Demotions(slots=slots(), keys=())
        return demoted


def writes(
    tmp_path: Any, *, write: str = "through", chunks: int = 8, world_size: int = 1
) -> tuple[TierWrites, Directory]:
    tier = DiskTierConfig(
        index=0,
        path=str(tmp_path),
        bytes_to_use=world_size * chunks * file_size(PAYLOAD),
        write=write,
    )
    fingerprints = [
        attrs.evolve(FP, tp_rank=r, tp_world_size=world_size) for r in range(world_size)
    ]
    directory = Directory()
    ids = iter(range(100, 200))
    w = TierWrites(
        disk=DiskTier(tier, fingerprints, PAYLOAD, events=False),
        redis=None,
        book=BlockBook(chunk_tokens=16, hashes_per_chunk=1),
        counts={"disk_chunks_written": 0, "host_blocks_demoted": 0},
        jobs={},
        new_job_id=lambda: next(ids),
        tell=directory.told.append,
        ask=directory.ask,
        world_size=world_size,
        events_enabled=False,
    )
    return w, directory


def stored(job_keys: tuple[bytes, ...], host: Any) -> JobState:
    return JobState(job_id=1, req_id="r", is_store=True, slots=host, tokens=16, keys=job_keys)


def test_a_store_written_through_pins_its_slots_in_the_message_that_makes_them_hits(
    tmp_path: Any,
) -> None:
    w, d = writes(tmp_path)
    w.store_ended(stored(keys(1, 2), slots(5, 6)))
    [complete] = d.told
    assert isinstance(complete, CompleteStore) and complete.ok
    assert complete.slots.tolist() == [5, 6] and complete.pin.tolist() == [5, 6]
    [(job_id, job)] = w.jobs.items()
    assert job.disk_write and not job.demotion and job.tier == "disk"
    assert job.disk_keys == keys(1, 2) and job.slots.tolist() == [5, 6]
    [spec] = w.disk_writes
    assert spec.job_id == job_id and spec.chunks.keys == list(keys(1, 2))
    assert w.redis_writes == []


def test_a_write_that_ended_unpins_its_slots_and_counts_what_is_on_disk_now(
    tmp_path: Any,
) -> None:
    w, d = writes(tmp_path)
    w.store_ended(stored(keys(1, 2), slots(5, 6)))
    job = w.jobs.pop(100)
    job.disk_failed = np.array([0, 1], np.int64)  # the second failed on the worker
    d.told.clear()
    w.write_ended(job)
    [unpin] = d.told
    assert isinstance(unpin, Unpin) and unpin.slots.tolist() == [5, 6]
    assert w.counts["disk_chunks_written"] == 1
    assert w.disk is not None and w.disk.ready(keys(1, 2)).tolist() == [True, False]


def test_an_unreported_write_counts_as_failed_everywhere(tmp_path: Any) -> None:
    w, _ = writes(tmp_path)
    w.store_ended(stored(keys(1), slots(5)))
    w.write_ended(w.jobs.pop(100))  # no worker's outcomes
    assert w.counts["disk_chunks_written"] == 0
    assert w.disk is not None and not w.disk.ready(keys(1)).any()


def test_chunks_already_on_disk_are_not_written_again(tmp_path: Any) -> None:
    w, d = writes(tmp_path)
    w.store_ended(stored(keys(1), slots(5)))
    job = w.jobs.pop(100)
    job.disk_failed = np.zeros(1, np.int64)
    w.write_ended(job)
    d.told.clear()
    w.store_ended(stored(keys(1, 2), slots(7, 8)))
    [complete] = d.told
    assert complete.slots.tolist() == [7, 8] and complete.pin.tolist() == [8]
    [job] = w.jobs.values()
    assert job.disk_keys == keys(2)


def test_a_disk_written_on_eviction_takes_nothing_at_the_store_and_the_evicted_at_a_demotion(
    tmp_path: Any,
) -> None:
    w, d = writes(tmp_path, write="on_evict")
    w.store_ended(stored(keys(1, 2), slots(5, 6)))
    [complete] = d.told
    assert complete.ok and len(complete.pin) == 0 and not w.jobs
    d.told.clear()
    d.demoted = Demotions(slots=slots(5, 6), keys=keys(1, 2))
    w.demote()
    assert d.told == [] and w.counts["host_blocks_demoted"] == 2
    [job] = w.jobs.values()
    assert job.demotion and job.disk_keys == keys(1, 2)
    job.disk_failed = np.zeros(2, np.int64)
    w.write_ended(w.jobs.pop(job.job_id))
    [ended] = d.told
    assert isinstance(ended, EndDemotions) and ended.slots.tolist() == [5, 6]  # freed


def test_a_demotion_the_disk_has_no_room_for_frees_the_rest_at_once(tmp_path: Any) -> None:
    w, d = writes(tmp_path, write="on_evict", chunks=1)
    d.demoted = Demotions(slots=slots(5, 6), keys=keys(1, 2))
    w.demote()  # one place: the second waits for nothing
    [ended] = d.told
    assert isinstance(ended, EndDemotions) and ended.slots.tolist() == [6]
    [job] = w.jobs.values()
    assert job.disk_keys == keys(1) and job.slots.tolist() == [5]


@pytest.mark.parametrize("write", ["through", "on_evict"])
def test_without_a_disk_or_redis_write_again_takes_nothing(tmp_path: Any, write: str) -> None:
    w, _ = writes(tmp_path, write=write)
    load = JobState(job_id=2, req_id="r", is_store=False, slots=slots(3), tokens=16, keys=keys(9))
    assert w.write_again(load).tolist() == [False]
    assert not w.jobs


def test_a_chunk_whose_read_failed_leaves_the_disk_tier_only_if_a_rank_lost_it(
    tmp_path: Any,
) -> None:
    """Two ranks, each its own files; a load of three chunks fails. Chunk 1 failed on
    both with its files kept (EMFILE, say); chunk 2 failed on both, and rank 1's file is
    gone (corrupt): no longer a hit anywhere, its files deleted on every rank; chunk 3
    was read on rank 0 and failed, kept, on rank 1. The load fails either way."""
    w, d = writes(tmp_path, world_size=2)
    disk = w.disk
    assert disk is not None
    w.store_ended(stored(keys(1, 2, 3), slots(5, 6, 7)))
    write = w.jobs.pop(100)
    write.disk_failed = np.zeros(3, np.int64)
    w.write_ended(write)
    assert disk.ready(keys(1, 2, 3)).all()
    d.told.clear()

    places = disk.lease(keys(1, 2, 3))  # a lookup's hit, then its load
    ranks = [
        KVFerryWorkerMetadata(acks={2: [1, 1]}, disk_failed={2: [KEPT, KEPT, 0]}),
        KVFerryWorkerMetadata(acks={2: [1, 1]}, disk_failed={2: [KEPT, 1, KEPT]}),
    ]
    merged = ranks[0].aggregate(ranks[1])
    assert isinstance(merged, KVFerryWorkerMetadata)
    load = JobState(
        job_id=2,
        req_id="r",
        is_store=False,
        slots=slots(-1, -1, -1),
        tokens=48,
        keys=keys(1, 2, 3),
        disk_keys=keys(1, 2, 3),
        disk_host_slots=slots(0, 1, 2),
        disk_slots=places,
        disk_failed=np.asarray(merged.disk_failed[2], np.int64),
    )
    w.reads_ended(load)
    [failed] = d.told
    assert isinstance(failed, CompleteStore) and not failed.ok  # none read everywhere
    assert failed.slots.tolist() == [0, 1, 2]
    assert disk.ready(keys(1, 2, 3)).tolist() == [True, False, True]
    assert disk.take_deletes() == list(keys(2))  # on every rank
    assert disk.dir.statistics().pinned == 0
