"""RedisIOActor against a real redis-server: jobs between host slots and Redis, the
bounded write queue, deadlines."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
import pytest

from kvferry._config import RedisTierConfig
from kvferry.actors import ActorSystem, Reply
from kvferry.tiers import (
    CircuitBreaker,
    DiskJobResult,
    GetRedisStatistics,
    Outcome,
    PollDiskJobs,
    ReadChunks,
    RedisIOActor,
    RedisStore,
    WriteChunks,
    keys_array,
)

from .conftest import FP, key
from .redis_servers import RedisServer

SLOT_BYTES = 64 << 10


def pool(num_slots: int = 16) -> npt.NDArray[np.uint8]:
    rng = np.random.default_rng(7)
    return rng.integers(0, 256, (num_slots, SLOT_BYTES), dtype=np.uint8)


async def ask_notify(ref: Any, msg_type: type, **fields: Any) -> DiskJobResult:
    reply: Reply[DiskJobResult] = Reply()
    await ref.tell(msg_type(notify=reply, **fields))
    return await reply.wait()


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[RedisStore]:
    s = RedisStore(url=redis_url, fingerprint=FP)
    await s.connect()
    yield s
    await s.aclose()


@pytest.mark.anyio
async def test_chunks_written_from_slots_are_read_back_into_other_slots(store: RedisStore) -> None:
    slots = pool()
    async with ActorSystem() as system:
        ref = await system.spawn(RedisIOActor(store, slots, batch_bytes=2 * SLOT_BYTES))
        keys = keys_array([key(i) for i in range(5)])
        wrote = await ask_notify(ref, WriteChunks, job_id=1, keys=keys, slots=[0, 1, 2, 3, 4])
        assert wrote.ok and wrote.kind == "write" and wrote.nbytes == 5 * SLOT_BYTES
        await ref.tell(ReadChunks(job_id=2, keys=keys, slots=[8, 9, 10, 11, 12]))
        results: list[DiskJobResult] = []
        with anyio.fail_after(10):
            while not results:
                results = await ref.ask(PollDiskJobs)
                if not results:
                    await anyio.wait_all_tasks_blocked()
        [read] = results
        assert read.job_id == 2 and read.ok and read.nbytes == 5 * SLOT_BYTES
        assert np.array_equal(slots[8:13], slots[0:5])
        stats = await ref.ask(GetRedisStatistics)
        assert stats.jobs_ended == 2 and stats.store.reads == 5


@pytest.mark.anyio
async def test_a_missing_chunk_is_reported_per_chunk(store: RedisStore) -> None:
    slots = pool()
    async with ActorSystem() as system:
        ref = await system.spawn(RedisIOActor(store, slots))
        await ask_notify(ref, WriteChunks, job_id=1, keys=keys_array([key(0)]), slots=[0])
        keys = keys_array([key(0), key(1)])
        read = await ask_notify(ref, ReadChunks, job_id=2, keys=keys, slots=[4, 5])
        assert list(read.outcomes) == [Outcome.OK, Outcome.ABSENT] and read.nbytes == SLOT_BYTES


@pytest.mark.anyio
async def test_a_full_write_queue_drops_stores_but_never_reads(store: RedisStore) -> None:
    slots = pool()
    async with ActorSystem() as system:
        ref = await system.spawn(RedisIOActor(store, slots, max_queued_writes=2))
        keys = keys_array([key(i) for i in range(5)])
        wrote = await ask_notify(ref, WriteChunks, job_id=1, keys=keys, slots=[0, 1, 2, 3, 4])
        assert list(wrote.outcomes) == [Outcome.OK] * 2 + [Outcome.DROPPED] * 3
        read = await ask_notify(ref, ReadChunks, job_id=2, keys=keys, slots=[8, 9, 10, 11, 12])
        assert list(read.outcomes) == [Outcome.OK] * 2 + [Outcome.ABSENT] * 3
        assert (await ref.ask(GetRedisStatistics)).writes_dropped == 3


@pytest.mark.anyio
async def test_every_job_ends_within_its_deadline_when_redis_stops_answering(
    tmp_path: Path,
) -> None:
    server = RedisServer(tmp_path / "frozen")
    server.start()
    store = RedisStore(
        url=server.url,
        fingerprint=FP,
        op_timeout_s=5.0,
        breaker=CircuitBreaker(threshold=100),
    )
    await store.connect()
    slots = pool()
    assert server.proc is not None
    try:
        async with ActorSystem() as system:
            ref = await system.spawn(
                RedisIOActor(store, slots, io_depth=1, batch_bytes=SLOT_BYTES, job_timeout_s=0.5)
            )
            keys = keys_array([key(i) for i in range(6)])
            await ask_notify(ref, WriteChunks, job_id=1, keys=keys, slots=range(6))
            os.kill(server.proc.pid, signal.SIGSTOP)  # alive, but answers nothing
            try:
                start = anyio.current_time()
                with anyio.fail_after(5):
                    read = await ask_notify(
                        ref, ReadChunks, job_id=2, keys=keys, slots=range(8, 14)
                    )
                took = anyio.current_time() - start
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            assert 0.4 < took < 1.5
            # the batch in flight timed out; the chunks still queued expired at the deadline
            assert set(read.outcomes.tolist()) == {Outcome.TIMEOUT}
            assert (await ref.ask(GetRedisStatistics)).jobs_timed_out == 1
    finally:
        await store.aclose()
        server.kill()


@pytest.mark.anyio
async def test_a_tiers_store_has_a_connection_for_every_batch_in_flight(redis_url: str) -> None:
    """``io_depth`` batches at once on a healthy server are all answered: the store the
    connector makes for a tier has a connection for each (a pool smaller than
    ``io_depth`` failed the batches beyond it, as errors counted by the breaker)."""
    # The connector's (it imports vLLM): run by the main suite, not the floor venv's.
    make_store = pytest.importorskip("kvferry.connector._redis_tier").make_store
    io_depth = 24
    tier = RedisTierConfig(index=0, url=redis_url, io_depth=io_depth)
    store = make_store(tier, FP)
    await store.connect()
    slots = pool(io_depth)
    try:
        async with ActorSystem() as system:
            ref = await system.spawn(
                RedisIOActor(store, slots, io_depth=tier.io_depth, batch_bytes=SLOT_BYTES)
            )
            keys = keys_array([key(i) for i in range(io_depth)])
            # one chunk a batch: every runner sends one at once
            read = await ask_notify(ref, ReadChunks, job_id=1, keys=keys, slots=range(io_depth))
            assert read.outcomes.tolist() == [Outcome.ABSENT] * io_depth
            assert store.statistics().errors == 0
    finally:
        await store.aclose()
