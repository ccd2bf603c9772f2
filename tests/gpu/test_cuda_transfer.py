"""The CUDA copy engine on a real device: bit-exact round trips of random KV through
pinned host memory in every layout, ordering after the compute stream, a flush that
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
    _torchcopy,
    describe_kv_caches,
    new_copy_engine,
)
from tests.transfer.kvlayouts import KV, LAYOUTS, NB, vllm_cpu

pytestmark = pytest.mark.gpu
ROWS = 12


def job(job_id: int, direction: str, blocks: object, rows: object, group: int = 0) -> CopyJob:
    part = GroupBlocks(group=group, device_blocks=blocks, host_rows=rows)  # type: ignore[arg-type]
    return CopyJob(job_id=job_id, direction=direction, parts=(part,))  # type: ignore[arg-type]


@pytest.mark.parametrize("make", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.parametrize("staging_rows", [2, 64], ids=["pieces", "one-piece"])
def test_cuda_store_then_load_round_trips_bit_exactly(
    make: Callable[..., KV], staging_rows: int
) -> None:
    kv = make("cuda")
    before = kv.snapshot()
    layout = describe_kv_caches(kv.tensors, kv.groups, NB, kv.block_stride_bytes)
    pool = HostPool(num_slots=ROWS, blocks_per_chunk=1, row_bytes=layout.row_bytes, pin=True)
    assert pool.rows.is_pinned()
    engine = CudaCopyEngine(layout, pool, staging_bytes=staging_rows * layout.row_bytes)
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
async def test_a_flushed_store_reads_its_blocks_before_the_compute_stream_overwrites_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kv = vllm_cpu("cuda")
    layout = describe_kv_caches(kv.tensors, kv.groups, NB)
    pool = HostPool(num_slots=ROWS, blocks_per_chunk=1, row_bytes=layout.row_bytes, pin=True)
    blocks, rows = [2, 5, 7], [0, 1, 2]
    old = KVBlockAccess(layout).read_blocks(blocks)
    gather = _torchcopy.gather_rows

    def late_gather(*args: Any) -> None:
        # Hold the store stream (~0.1 s) just before it reads the blocks (after submit's
        # uploads, so the CPU never waits on it): without the fence, the overwrite below
        # would run first and the host would get the new contents.
        torch.cuda._sleep(200_000_000)
        gather(*args)

    monkeypatch.setattr(_torchcopy, "gather_rows", late_gather)
    engine = CudaCopyEngine(layout, pool)
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
