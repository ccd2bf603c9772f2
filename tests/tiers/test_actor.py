"""DiskIOActor on a real temporary directory: batches in and out of host slots, reads
served before queued writes, a full write queue drops stores (never reads)."""

from __future__ import annotations

import os
import threading
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import numpy.typing as npt
import pytest

from kvferry import ActorStopped
from kvferry.actors import ActorSystem, Reply
from kvferry.tiers import (
    DeleteChunks,
    DiskIOActor,
    DiskJobResult,
    FileOps,
    GetDiskStatistics,
    Outcome,
    PollDiskJobs,
    ReadChunks,
    ScanDisk,
    WriteChunks,
    aligned_buffer,
    keys_array,
)

from .conftest import key

SLOT_BYTES = 3 * 4096 + 512


def pool(num_slots: int = 16) -> npt.NDArray[np.uint8]:
    rows = aligned_buffer(num_slots * SLOT_BYTES).reshape(num_slots, SLOT_BYTES)
    rows[:] = np.random.default_rng(7).integers(0, 256, rows.shape, dtype=np.uint8)
    return rows


class Gated(FileOps):
    """Holds the write of ``key(gate_key)`` until ``gate`` is set, and records the order in
    which chunks start (one thread at a time with io_depth=1)."""

    def __init__(self, gate_key: bytes) -> None:
        self.gate_name = gate_key.hex()
        self.gate = threading.Event()
        self.blocked = threading.Event()
        self.order: list[tuple[str, bytes]] = []

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        fd = super().open(path, flags, mode)  # recorded once it opened (not on ENOENT)
        name = os.path.basename(path)
        if name.endswith(".kvc") or (name.endswith(".tmp") and not name.startswith(".")):
            kind = "write" if flags & os.O_CREAT else "read"
            self.order.append((kind, bytes.fromhex(name.split(".")[0])))
            if kind == "write" and name.startswith(self.gate_name):
                self.blocked.set()
                if not self.gate.wait(timeout=30):
                    raise TimeoutError("the test never opened the gate")
        return fd


async def ask_notify(ref: Any, msg_type: type, **fields: Any) -> DiskJobResult:
    reply: Reply[DiskJobResult] = Reply()
    await ref.tell(msg_type(notify=reply, **fields))
    return await reply.wait()


@pytest.mark.anyio
async def test_chunks_written_from_slots_are_read_back_into_other_slots(make_store: Any) -> None:
    slots = pool()
    store = make_store()
    async with ActorSystem() as system:
        disk = await system.spawn(DiskIOActor(store, slots))
        keys = keys_array([key(i) for i in range(4)])
        wrote = await ask_notify(disk, WriteChunks, job_id=1, keys=keys, slots=[0, 1, 2, 3])
        assert wrote.ok and wrote.kind == "write" and wrote.nbytes == 4 * SLOT_BYTES
        await disk.tell(ReadChunks(job_id=2, keys=keys, slots=[8, 9, 10, 11]))
        results: list[DiskJobResult] = []
        with anyio.fail_after(10):
            while not results:
                results = await disk.ask(PollDiskJobs)
                if not results:
                    await anyio.wait_all_tasks_blocked()
        [read] = results
        assert read.job_id == 2 and read.ok and read.nbytes == 4 * SLOT_BYTES
        assert np.array_equal(slots[8:12], slots[0:4])


@pytest.mark.anyio
async def test_a_missing_chunk_is_reported_per_chunk(make_store: Any) -> None:
    slots = pool()
    store = make_store()
    async with ActorSystem() as system:
        disk = await system.spawn(DiskIOActor(store, slots))
        await ask_notify(disk, WriteChunks, job_id=1, keys=keys_array([key(0)]), slots=[0])
        keys = keys_array([key(0), key(1)])
        read = await ask_notify(disk, ReadChunks, job_id=2, keys=keys, slots=[4, 5])
        assert list(read.outcomes) == [Outcome.OK, Outcome.ABSENT] and not read.ok
        assert read.nbytes == SLOT_BYTES


@pytest.mark.anyio
async def test_reads_are_served_before_queued_writes(make_store: Any) -> None:
    ops = Gated(key(100))
    slots = pool()
    store = make_store(ops=ops)
    for i in (0, 1):  # two chunks on disk to read
        store.write(key(i), slots[i])
    ops.order.clear()
    async with ActorSystem() as system:
        disk = await system.spawn(DiskIOActor(store, slots, io_depth=1))
        first: Reply[DiskJobResult] = Reply()
        queued: Reply[DiskJobResult] = Reply()
        read: Reply[DiskJobResult] = Reply()
        await disk.tell(WriteChunks(job_id=1, keys=keys_array([key(100)]), slots=[2], notify=first))
        await anyio.to_thread.run_sync(ops.blocked.wait)  # the first write has started
        writes = keys_array([key(101), key(102), key(103)])
        await disk.tell(WriteChunks(job_id=2, keys=writes, slots=[3, 4, 5], notify=queued))
        reads = keys_array([key(0), key(1)])
        await disk.tell(ReadChunks(job_id=3, keys=reads, slots=[10, 11], notify=read))
        await anyio.wait_all_tasks_blocked()
        stats = await disk.ask(GetDiskStatistics)
        assert (stats.reads_queued, stats.writes_queued, stats.in_flight) == (2, 3, 1)
        ops.gate.set()
        results = [await r.wait() for r in (first, queued, read)]
    assert all(r.ok for r in results)
    assert ops.order == [
        ("write", key(100)),
        ("read", key(0)),
        ("read", key(1)),
        ("write", key(101)),
        ("write", key(102)),
        ("write", key(103)),
    ]
    assert np.array_equal(slots[10:12], slots[0:2])


@pytest.mark.anyio
async def test_a_running_write_batch_yields_to_reads_after_its_current_chunk(
    make_store: Any,
) -> None:
    ops = Gated(key(100))
    slots = pool()
    store = make_store(ops=ops)
    for i in (0, 1):
        store.write(key(i), slots[i])
    ops.order.clear()
    async with ActorSystem() as system:
        disk = await system.spawn(DiskIOActor(store, slots, io_depth=1, batch_bytes=1 << 30))
        write: Reply[DiskJobResult] = Reply()
        writes = keys_array([key(100 + i) for i in range(4)])
        await disk.tell(WriteChunks(job_id=1, keys=writes, slots=[2, 3, 4, 5], notify=write))
        await anyio.to_thread.run_sync(ops.blocked.wait)  # one batch of 4 has started
        read: Reply[DiskJobResult] = Reply()
        reads = keys_array([key(0), key(1)])
        await disk.tell(ReadChunks(job_id=2, keys=reads, slots=[10, 11], notify=read))
        await anyio.wait_all_tasks_blocked()
        ops.gate.set()
        assert (await write.wait()).ok and (await read.wait()).ok
    assert ops.order == [
        ("write", key(100)),
        ("read", key(0)),
        ("read", key(1)),
        ("write", key(101)),
        ("write", key(102)),
        ("write", key(103)),
    ]


@pytest.mark.anyio
async def test_a_full_write_queue_drops_stores_but_never_reads(make_store: Any) -> None:
    ops = Gated(key(100))
    slots = pool()
    store = make_store(ops=ops)
    for i in range(6):
        store.write(key(i), slots[i])
    async with ActorSystem() as system:
        disk = await system.spawn(DiskIOActor(store, slots, io_depth=1, max_queued_writes=2))
        first: Reply[DiskJobResult] = Reply()
        await disk.tell(WriteChunks(job_id=1, keys=keys_array([key(100)]), slots=[6], notify=first))
        await anyio.to_thread.run_sync(ops.blocked.wait)
        writes = keys_array([key(101 + i) for i in range(4)])
        dropped: Reply[DiskJobResult] = Reply()
        await disk.tell(WriteChunks(job_id=2, keys=writes, slots=[7, 8, 9, 10], notify=dropped))
        read: Reply[DiskJobResult] = Reply()
        reads = keys_array([key(i) for i in range(6)])
        await disk.tell(ReadChunks(job_id=3, keys=reads, slots=range(10, 16), notify=read))
        await anyio.wait_all_tasks_blocked()
        ops.gate.set()
        wrote, got = await dropped.wait(), await read.wait()
        stats = await disk.ask(GetDiskStatistics)
    assert list(wrote.outcomes) == [Outcome.OK, Outcome.OK, Outcome.DROPPED, Outcome.DROPPED]
    assert got.ok and stats.writes_dropped == 2
    assert key(103) not in store and key(102) in store


@pytest.mark.anyio
async def test_scan_through_the_actor_finds_the_chunks_of_a_previous_run(make_store: Any) -> None:
    slots = pool()
    old = make_store()
    old.write(key(5), slots[5])
    old.close()  # its engine stopped: the next one takes its namespace
    async with ActorSystem() as system:
        disk = await system.spawn(DiskIOActor(make_store(), slots))
        report = await disk.ask(ScanDisk)
        assert report.chunks == 1
        read = await ask_notify(disk, ReadChunks, job_id=1, keys=keys_array([key(5)]), slots=[0])
    assert read.ok and np.array_equal(slots[0], slots[5])


@pytest.mark.anyio
async def test_a_job_still_queued_when_the_actor_stops_fails_its_asker(make_store: Any) -> None:
    ops = Gated(key(100))
    slots = pool()
    async with ActorSystem() as system:
        disk = await system.spawn(DiskIOActor(make_store(ops=ops), slots, io_depth=1))
        first: Reply[DiskJobResult] = Reply()
        await disk.tell(WriteChunks(job_id=1, keys=keys_array([key(100)]), slots=[0], notify=first))
        await anyio.to_thread.run_sync(ops.blocked.wait)
        queued: Reply[DiskJobResult] = Reply()
        await disk.tell(WriteChunks(job_id=2, keys=keys_array([key(1)]), slots=[1], notify=queued))
        await anyio.wait_all_tasks_blocked()
        ops.gate.set()
        await disk.stop(drain=False)
        await disk.wait_stopped()
    with pytest.raises(ActorStopped):
        await queued.wait()


def test_messages_refuse_keys_and_slots_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="keys"):
        ReadChunks(job_id=1, keys=keys_array([key(0), key(1)]), slots=[0])


@pytest.mark.anyio
async def test_a_job_naming_a_slot_outside_the_pool_ends_aborted(make_store: Any) -> None:
    async with ActorSystem() as system:
        disk = await system.spawn(DiskIOActor(make_store(), pool(4)))
        keys = keys_array([key(0), key(1)])
        result = await ask_notify(disk, WriteChunks, job_id=1, keys=keys, slots=[0, 4])
    assert list(result.outcomes) == [Outcome.ABORTED, Outcome.ABORTED]


@pytest.mark.anyio
async def test_deleted_chunks_are_gone_from_disk_and_index(make_store: Any) -> None:
    slots = pool()
    store = make_store()
    for i in range(3):
        store.write(key(i), slots[i])
    async with ActorSystem() as system:
        disk = await system.spawn(DiskIOActor(store, slots))
        keys = keys_array([key(0), key(2), key(9)])
        deleted = await disk.ask(lambda r: DeleteChunks(keys=keys, reply=r))
        read = await ask_notify(disk, ReadChunks, job_id=1, keys=keys_array([key(0)]), slots=[5])
    assert deleted == 2 and store.keys() == [key(1)]
    assert not store.path_of(key(0)).exists() and list(read.outcomes) == [Outcome.ABSENT]
