"""The CPU copy engine's scheduling: loads before stores, no starvation, cancellation,
closing; and the transfer actors on top of it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import pytest

from kvferry.actors import ActorSystem
from kvferry.transfer import (
    CopyJob,
    FlushJobs,
    GroupBlocks,
    HostPool,
    JobCancelled,
    KVBlockAccess,
    KVLayout,
    LoadActor,
    PollFinished,
    StoreActor,
    SubmitJob,
    ThreadCopyEngine,
    describe_kv_caches,
)
from kvferry.transfer._kernel import memmove_kernel
from kvferry.transfer._threads import LOAD_BURST

from .kvlayouts import NB, vllm_cpu

I64 = npt.NDArray[np.int64]


def job(job_id: int, direction: str, blocks: list[int], rows: list[int]) -> CopyJob:
    part = GroupBlocks(group=0, device_blocks=blocks, host_rows=rows)
    return CopyJob(job_id=job_id, direction=direction, parts=(part,))  # type: ignore[arg-type]


class Gate:
    """A kernel that copies, records which host row each piece touched, and holds the
    first piece until :meth:`open` (so the test can queue work behind it)."""

    def __init__(self, pool: HostPool) -> None:
        self.pool = pool
        self.entered = threading.Event()
        self.released = threading.Event()
        self.rows: list[int] = []
        self._first = True

    def __call__(self, dsts: I64, srcs: I64, sizes: I64) -> None:
        base, end = self.pool.rows.data_ptr(), self.pool.rows.data_ptr() + self.pool.nbytes
        host = int(dsts[0]) if base <= int(dsts[0]) < end else int(srcs[0])
        self.rows.append((host - base) // self.pool.row_bytes)
        if self._first:
            self._first = False
            self.entered.set()
            self.released.wait()
        memmove_kernel(dsts, srcs, sizes)

    def open(self) -> None:
        self.released.set()


@pytest.fixture
def setup() -> Iterator[tuple[KVLayout, HostPool, Gate, ThreadCopyEngine]]:
    kv = vllm_cpu()
    layout = describe_kv_caches(kv.tensors, kv.groups, NB)
    pool = HostPool(num_slots=NB, blocks_per_chunk=1, row_bytes=layout.row_bytes)
    gate = Gate(pool)
    engine = ThreadCopyEngine(layout, pool, num_threads=1, kernel=gate)
    yield layout, pool, gate, engine
    gate.open()
    engine.close()


def test_loads_are_served_before_stores(
    setup: tuple[KVLayout, HostPool, Gate, ThreadCopyEngine],
) -> None:
    _, _, gate, engine = setup
    first = engine.submit(job(0, "store", [0], [0]))
    gate.entered.wait()
    later = [
        engine.submit(job(1, "store", [1], [1])),
        engine.submit(job(2, "store", [2], [2])),
        engine.submit(job(3, "load", [3], [3])),
        engine.submit(job(4, "load", [4], [4])),
    ]
    gate.open()
    for c in [first, *later]:
        c.synchronize()
    assert gate.rows == [0, 3, 4, 1, 2]


def test_a_stream_of_loads_does_not_starve_stores(
    setup: tuple[KVLayout, HostPool, Gate, ThreadCopyEngine],
) -> None:
    _, _, gate, engine = setup
    engine.submit(job(0, "store", [0], [0]))
    gate.entered.wait()
    store = engine.submit(job(1, "store", [1], [1]))
    loads = [engine.submit(job(10 + i, "load", [2 + i], [2 + i])) for i in range(LOAD_BURST + 2)]
    gate.open()
    for c in [store, *loads]:
        c.synchronize()
    load_rows = [2 + i for i in range(LOAD_BURST + 2)]
    assert gate.rows == [0, *load_rows[:LOAD_BURST], 1, *load_rows[LOAD_BURST:]]


def test_cancel_drops_queued_pieces_and_ends_after_the_running_one(
    setup: tuple[KVLayout, HostPool, Gate, ThreadCopyEngine],
) -> None:
    layout, pool, gate, _ = setup
    engine = ThreadCopyEngine(
        layout, pool, num_threads=1, kernel=gate, piece_bytes=layout.row_bytes // 3
    )
    try:
        completion = engine.submit(job(1, "load", [0, 1, 2], [0, 1, 2]))
        gate.entered.wait()
        assert engine.pending_pieces() > 0
        completion.cancel()
        assert engine.pending_pieces() == 0
        assert not completion.query()  # the first piece still copies
        gate.open()
        completion.synchronize()
        assert isinstance(completion.exception(), JobCancelled)
    finally:
        gate.open()
        engine.close()


def test_a_cancelled_job_whose_pieces_all_ran_ends_done(
    setup: tuple[KVLayout, HostPool, Gate, ThreadCopyEngine],
) -> None:
    _, _, gate, engine = setup
    gate.open()
    completion = engine.submit(job(1, "store", [0], [0]))
    completion.synchronize()
    completion.cancel()
    assert completion.exception() is None


def test_close_ends_queued_jobs_cancelled(
    setup: tuple[KVLayout, HostPool, Gate, ThreadCopyEngine],
) -> None:
    _, _, gate, engine = setup
    running = engine.submit(job(0, "store", [0], [0]))
    gate.entered.wait()
    queued = engine.submit(job(1, "store", [1], [1]))
    closer = threading.Thread(target=engine.close)
    closer.start()
    queued.synchronize()  # dropped at once, while the first piece still runs
    assert isinstance(queued.exception(), JobCancelled)
    gate.open()
    closer.join()
    assert running.query() and running.exception() is None
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(job(2, "store", [2], [2]))


def test_submit_of_a_bad_job_raises_and_queues_nothing(
    setup: tuple[KVLayout, HostPool, Gate, ThreadCopyEngine],
) -> None:
    _, _, _, engine = setup
    with pytest.raises(IndexError, match="host rows"):
        engine.submit(job(1, "store", [0], [NB + 5]))
    with pytest.raises(IndexError, match="engine blocks"):
        engine.submit(job(2, "load", [-1], [0]))
    assert engine.pending_pieces() == 0


@pytest.mark.anyio
async def test_actors_on_the_thread_engine_move_the_bytes_and_report_them() -> None:
    kv = vllm_cpu()
    layout = describe_kv_caches(kv.tensors, kv.groups, NB)
    pool = HostPool(num_slots=NB, blocks_per_chunk=1, row_bytes=layout.row_bytes)
    access = KVBlockAccess(layout)
    want = access.read_blocks([1, 2, 3])
    engine = ThreadCopyEngine(layout, pool, piece_bytes=layout.row_bytes)
    try:
        async with ActorSystem() as system:
            store = await system.spawn(StoreActor(engine, job_timeout_s=60.0))
            load = await system.spawn(LoadActor(engine, job_timeout_s=60.0))
            for i, b in enumerate([1, 2, 3]):
                await store.tell(SubmitJob(job=job(i, "store", [b], [5 + i])))
            await store.ask(lambda r: FlushJobs(job_ids=(0, 1, 2), timeout_s=30.0, reply=r))
            stored = await store.ask(PollFinished)
            assert sorted((r.job_id, r.ok, r.nbytes) for r in stored) == [
                (i, True, layout.row_bytes) for i in range(3)
            ]
            await load.tell(SubmitJob(job=job(10, "load", [7, 8, 9], [5, 6, 7])))
            await load.ask(lambda r: FlushJobs(job_ids=(10,), timeout_s=30.0, reply=r))
            [loaded] = await load.ask(PollFinished)
            assert loaded.ok and loaded.num_blocks == 3
        assert bool((access.read_blocks([7, 8, 9]) == want).all())
    finally:
        engine.close()
