"""The CUDA copy engine on a real device: bit-exact round trips of random KV through
pinned host memory in every layout, step batches bigger than the staging ring, stores
and loads at once, ordering after the compute stream of another thread, a flush that
fences the compute stream on a store's event, and raw block access. Marked ``gpu``:
skipped where there is no CUDA (``pytest -m gpu`` on a GPU)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvferry.actors import ActorSystem
from kvferry.transfer import (
    CopyJob,
    CudaCopyEngine,
    Flushed,
    FlushJobs,
    GroupBlocks,
    HostPool,
    KVBlockAccess,
    PollFinished,
    StoreActor,
    SubmitJob,
    describe_kv_caches,
    new_copy_engine,
)
from kvferry.transfer._cuda import CopyPath, IssueMode, TorchCudaOps
from tests.transfer.kvlayouts import KV, LAYOUTS, NB, vllm_cpu

pytestmark = pytest.mark.gpu
ROWS = 12


def job(job_id: int, direction: str, blocks: object, rows: object, group: int = 0) -> CopyJob:
    part = GroupBlocks(group=group, device_blocks=blocks, host_rows=rows)  # type: ignore[arg-type]
    return CopyJob(job_id=job_id, direction=direction, parts=(part,))  # type: ignore[arg-type]


@pytest.mark.parametrize("make", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.parametrize(
    ("path", "staging_rows", "row_programs"),
    [("direct", 0, 1024), ("direct", 0, 2), ("staged", 2, 1024), ("staged", 64, 1024)],
    ids=["direct", "direct-2-programs", "staged-pieces", "staged-one-piece"],
)
def test_cuda_store_then_load_round_trips_bit_exactly(
    make: Callable[..., KV], path: CopyPath, staging_rows: int, row_programs: int
) -> None:
    kv = make("cuda")
    before = kv.snapshot()
    layout = describe_kv_caches(kv.tensors, kv.groups, NB, kv.block_stride_bytes)
    pool = HostPool(num_slots=ROWS, blocks_per_chunk=1, row_bytes=layout.row_bytes, pin=True)
    assert pool.rows.is_pinned()
    engine = CudaCopyEngine(
        layout,
        pool,
        path=path,
        staging_bytes=max(staging_rows, 1) * layout.row_bytes,
        row_programs=row_programs,
    )
    assert engine.path == path
    rng = np.random.default_rng(3)
    try:
        for g, layers in enumerate(kv.groups):
            src = rng.choice(NB, 5, replace=False)
            rows = rng.choice(ROWS, 5, replace=False)
            dst = rng.permutation(src)
            engine.submit(job(1, "store", src, rows, group=g)).synchronize()
            done = engine.submit(job(2, "load", dst, rows, group=g))
            done.synchronize()
            assert done.query() and done.exception() is None
            torch.cuda.synchronize()
            for name in layers:
                for b in range(NB):
                    want = before[name][src[list(dst).index(b)]] if b in dst else before[name][b]
                    assert torch.equal(kv.block(name, b), want), (name, b)
                before[name] = [kv.block(name, b).clone() for b in range(NB)]
    finally:
        engine.close()


def test_a_store_sees_what_the_compute_stream_wrote_just_before() -> None:
    kv = vllm_cpu("cuda")
    layout = describe_kv_caches(kv.tensors, kv.groups, NB)
    pool = HostPool(num_slots=ROWS, blocks_per_chunk=1, row_bytes=layout.row_bytes, pin=True)
    engine = new_copy_engine(layout, pool)
    try:
        # A long kernel on the compute stream, then the write the store must see.
        torch.cuda._sleep(50_000_000)
        for t in kv.tensors.values():
            t[4].fill_(1.5)
        engine.submit(job(1, "store", [4], [0])).synchronize()
        want = (
            torch.full_like(kv.tensors["l0"][4], 1.5)
            .contiguous()
            .view(torch.uint8)
            .reshape(-1)
            .cpu()
        )
        assert torch.equal(pool.rows[0, : want.numel()], want)
    finally:
        engine.close()


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["direct", "staged"])
async def test_a_flushed_store_reads_its_blocks_before_the_compute_stream_overwrites_them(
    path: CopyPath,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kv = vllm_cpu("cuda")
    layout = describe_kv_caches(kv.tensors, kv.groups, NB)
    pool = HostPool(num_slots=ROWS, blocks_per_chunk=1, row_bytes=layout.row_bytes, pin=True)
    blocks, rows = [2, 5, 7], [0, 1, 2]
    old = KVBlockAccess(layout).read_blocks(blocks)

    class LateOps(TorchCudaOps):
        def copy_rows(self, *args: Any) -> None:
            # Hold the store's kernel stream (~0.1 s) just before the gather reads the
            # blocks (the CPU never waits on it): without the fence, the overwrite below
            # would run first and the host would get the new contents.
            torch.cuda._sleep(200_000_000)
            super().copy_rows(*args)

    engine = CudaCopyEngine(layout, pool, path=path, ops=LateOps(layout.device))
    try:
        async with ActorSystem() as system:
            store = await system.spawn(StoreActor(engine))
            await store.tell(SubmitJob(job=job(1, "store", blocks, rows)))
            flushed = await store.ask(lambda r: FlushJobs(job_ids=(1,), timeout_s=0.0, reply=r))
            assert flushed == Flushed(device_fenced=(1,))
            assert await store.ask(PollFinished) == []  # the flush did not wait for it
            for t in kv.tensors.values():  # the "forward", on the compute stream
                for b in blocks:
                    t[b].fill_(-3.0)
            torch.cuda.synchronize()
            [done] = await store.ask(PollFinished)
            assert done.job_id == 1 and done.ok
        assert torch.equal(pool.rows[rows, : old.shape[1]], old)  # the old contents
        new = torch.full_like(kv.tensors["l0"][0], -3.0).contiguous().view(torch.uint8)
        for name in kv.tensors:
            for b in blocks:
                assert torch.equal(kv.block(name, b), new.reshape(-1).cpu())
    finally:
        engine.close()


def test_raw_block_access_on_cuda_round_trips_exactly() -> None:
    kv = vllm_cpu("cuda")
    before = kv.snapshot()
    access = KVBlockAccess(describe_kv_caches(kv.tensors, kv.groups, NB))
    data = access.read_blocks([2, 5])
    assert data.device.type == "cpu"
    access.write_blocks([8, 0], data)
    torch.cuda.synchronize()
    for name in kv.groups[0]:
        assert torch.equal(kv.block(name, 8), before[name][2])
        assert torch.equal(kv.block(name, 0), before[name][5])


def test_a_step_batch_bigger_than_the_ring_round_trips_bit_exactly() -> None:
    kv = vllm_cpu("cuda")
    before = kv.snapshot()
    layout = describe_kv_caches(kv.tensors, kv.groups, NB)
    pool = HostPool(num_slots=ROWS, blocks_per_chunk=1, row_bytes=layout.row_bytes, pin=True)
    # 2 slots of 2 rows: 9 blocks are 5 pieces, each slot reused while the other copies
    engine = CudaCopyEngine(
        layout, pool, path="staged", staging_bytes=4 * layout.row_bytes, ring_slots=2
    )
    src, rows = [0, 1, 2, 3, 4, 5, 6, 7, 8], [11, 3, 4, 5, 0, 9, 8, 1, 2]
    dst = [9, 8, 7, 6, 5, 4, 3, 2, 1]
    try:
        stores = [job(1, "store", src[:4], rows[:4]), job(2, "store", src[4:], rows[4:])]
        for c in engine.submit_batch(stores):
            c.synchronize()
            assert c.exception() is None
        loads = [job(3, "load", dst[:2], rows[:2]), job(4, "load", dst[2:], rows[2:])]
        for c in engine.submit_batch(loads):
            c.synchronize()
            assert c.exception() is None
        torch.cuda.synchronize()
        for name in kv.tensors:
            for s_, d in zip(src, dst, strict=True):
                assert torch.equal(kv.block(name, d), before[name][s_]), (name, d)
        assert engine.statistics().kernel_launches == engine.statistics().pieces == 10
    finally:
        engine.close()


@pytest.mark.parametrize("issue", ["thread", "inline"])
@pytest.mark.parametrize("path", ["direct", "staged"])
def test_stores_and_loads_at_once_each_round_trip(path: CopyPath, issue: IssueMode) -> None:
    kv = vllm_cpu("cuda")
    before = kv.snapshot()
    layout = describe_kv_caches(kv.tensors, kv.groups, NB)
    pool = HostPool(num_slots=ROWS, blocks_per_chunk=1, row_bytes=layout.row_bytes, pin=True)
    engine = CudaCopyEngine(layout, pool, path=path, issue=issue)
    try:
        [seed] = engine.submit_batch([job(1, "store", [0, 1, 2], [6, 7, 8])])  # type: ignore[attr-defined]
        seed.synchronize()
        # a load of rows 6..8 into blocks 7..9 while blocks 3..5 are stored to rows 0..2
        both = engine.submit_batch(  # type: ignore[attr-defined]
            [job(2, "store", [3, 4, 5], [0, 1, 2]), job(3, "load", [7, 8, 9], [6, 7, 8])]
        )
        for c in both:
            c.synchronize()
            assert c.exception() is None
        torch.cuda.synchronize()
        for name in kv.tensors:
            for s_, d in ((0, 7), (1, 8), (2, 9)):
                assert torch.equal(kv.block(name, d), before[name][s_])
        got = KVBlockAccess(layout).read_blocks([3, 4, 5])
        assert torch.equal(pool.rows[[0, 1, 2], : got.shape[1]], got)
    finally:
        engine.close()


def test_a_store_follows_the_compute_stream_of_the_thread_that_handed_it_over() -> None:
    import threading

    kv = vllm_cpu("cuda")
    layout = describe_kv_caches(kv.tensors, kv.groups, NB)
    pool = HostPool(num_slots=ROWS, blocks_per_chunk=1, row_bytes=layout.row_bytes, pin=True)
    engine = CudaCopyEngine(layout, pool)
    compute = torch.cuda.Stream()
    try:
        with torch.cuda.stream(compute):  # the engine's model thread, on its own stream
            torch.cuda._sleep(50_000_000)
            for t in kv.tensors.values():
                t[4].fill_(2.5)
            mark = engine.capture_compute()
        done: list[Any] = []
        # the actors' thread: its current stream is the default one
        worker = threading.Thread(
            target=lambda: done.extend(engine.submit_batch([job(1, "store", [4], [0])], mark))
        )
        worker.start()
        worker.join()
        done[0].synchronize()
        want = torch.full_like(kv.tensors["l0"][4], 2.5).contiguous().view(torch.uint8)
        assert torch.equal(pool.rows[0, : want.numel()], want.reshape(-1).cpu())
    finally:
        engine.close()


@pytest.mark.anyio
async def test_ferry_on_cuda_round_trips_with_many_concurrent_callers() -> None:
    import anyio

    from kvferry import Ferry

    kv = vllm_cpu("cuda")
    names = list(kv.tensors)
    async with Ferry(
        {n: kv.tensors[n] for n in names}, num_blocks=NB, cpu_bytes_to_use=64 << 20
    ) as ferry:
        keys = [bytes([i]) * 8 for i in range(NB)]
        async with anyio.create_task_group() as tg:
            for i in range(NB):
                tg.start_soon(ferry.store, [keys[i]], [i])
        before = {n: [kv.block(n, b).clone() for b in range(NB)] for n in names}
        for t in kv.tensors.values():
            t.zero_()
        async with anyio.create_task_group() as tg:
            for i in range(NB):
                tg.start_soon(ferry.load, [keys[i]], [NB - 1 - i])
        torch.cuda.synchronize()
        for n in names:
            for i in range(NB):
                assert torch.equal(kv.block(n, NB - 1 - i), before[n][i])


def test_the_direct_and_staged_paths_write_the_same_host_rows_of_a_large_batch() -> None:
    """A step batch of 48 jobs over a realistic page size (flash-attention, 8 KV heads of
    128: 32 KiB pages), stored by both paths into separate rows: the rows are equal byte
    for byte, and loading them back by the direct path restores every block."""
    blocks, layers = 256, 4
    g = torch.Generator(device="cuda").manual_seed(17)
    kv = {
        f"l{i}": torch.randn((2, blocks, 16, 8, 128), generator=g, device="cuda").to(torch.bfloat16)
        for i in range(layers)
    }
    layout = describe_kv_caches(kv, [list(kv)], blocks)
    pool = HostPool(num_slots=2 * blocks, blocks_per_chunk=1, row_bytes=layout.row_bytes, pin=True)
    direct = CudaCopyEngine(layout, pool, path="direct")
    staged = CudaCopyEngine(layout, pool, path="staged", staging_bytes=8 * layout.row_bytes)
    rng = np.random.default_rng(23)
    src = rng.choice(blocks, 192, replace=False)
    rows = rng.permutation(2 * blocks)
    a, b = rows[:192], rows[192:384]
    try:
        for engine, host in ((direct, a), (staged, b)):
            jobs = [
                job(j, "store", src[4 * j : 4 * j + 4], host[4 * j : 4 * j + 4]) for j in range(48)
            ]
            for c in engine.submit_batch(jobs):
                c.synchronize()
                assert c.exception() is None
        assert torch.equal(pool.rows[torch.from_numpy(a)], pool.rows[torch.from_numpy(b)])
        want = {n: t[:, torch.from_numpy(src).cuda()].clone() for n, t in kv.items()}
        for t in kv.values():
            t.zero_()
        dst = rng.permutation(blocks)[:192]
        jobs = [job(j, "load", dst[4 * j : 4 * j + 4], a[4 * j : 4 * j + 4]) for j in range(48)]
        for c in direct.submit_batch(jobs):
            c.synchronize()
            assert c.exception() is None
        for n, t in kv.items():
            assert torch.equal(t[:, torch.from_numpy(dst).cuda()], want[n]), n
    finally:
        direct.close()
        staged.close()
