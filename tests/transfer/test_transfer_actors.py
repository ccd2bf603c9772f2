"""Store/Load actors over the completion bridge, driven with fake CUDA events."""

from __future__ import annotations

import anyio
import pytest
import torch

from kvferry.actors import ActorSystem
from kvferry.testing import FakeCopyEngine, FakeCudaEvent, FakeStream, fake_use_stream
from kvferry.transfer import (
    CompletionBridge,
    CopyJob,
    GroupBlocks,
    HostPool,
    LoadActor,
    PollFinished,
    StoreActor,
    SubmitJob,
    describe_kv_caches,
)
from kvferry.transfer._cuda import CudaCopyEngine


def job(job_id: int, direction: str = "store") -> CopyJob:
    return CopyJob(job_id=job_id, direction=direction, parts=(GroupBlocks(group=0, device_blocks=[job_id], host_rows=[job_id]),))  # type: ignore[arg-type]


def test_bridge_reports_completions_out_of_order() -> None:
    bridge: CompletionBridge[int] = CompletionBridge()
    events = [FakeCudaEvent() for _ in range(3)]
    for i, e in enumerate(events):
        bridge.add(i, e)
    assert bridge.poll() == []
    events[2].fire()
    assert bridge.poll() == [(2, None)]
    err = RuntimeError("copy failed")
    events[0].fire(err)
    events[1].fire()
    assert bridge.poll() == [(0, err), (1, None)]
    assert len(bridge) == 0


@pytest.mark.anyio
async def test_a_store_ends_only_after_its_event_fires() -> None:
    engine = FakeCopyEngine()
    async with ActorSystem() as system:
        store = await system.spawn(StoreActor(engine))
        await store.tell(SubmitJob(job=job(1)))
        await store.tell(SubmitJob(job=job(2)))
        await anyio.wait_all_tasks_blocked()
        assert [j.job_id for j in engine.submitted] == [1, 2]
        assert await store.ask(PollFinished) == []
        engine.event_for(2).fire()
        results = await store.ask(PollFinished)
        assert [(r.job_id, r.ok) for r in results] == [(2, True)]
        engine.event_for(1).fire(RuntimeError("dma error"))
        results = await store.ask(PollFinished)
        assert [(r.job_id, r.ok) for r in results] == [(1, False)]
        assert "dma error" in (results[0].error or "")


@pytest.mark.anyio
async def test_a_failed_submission_is_reported_not_raised() -> None:
    engine = FakeCopyEngine(fail_submit=True)
    async with ActorSystem() as system:
        load = await system.spawn(LoadActor(engine))
        await load.tell(SubmitJob(job=job(7, "load")))
        results = await load.ask(PollFinished)
        assert [(r.job_id, r.ok, r.direction) for r in results] == [(7, False, "load")]


def test_cuda_path_orders_after_compute_and_ends_with_an_event() -> None:
    kv = {"l0": torch.arange(4 * 64, dtype=torch.float32).reshape(4, 64)}
    layout = describe_kv_caches(kv, [["l0"]], 4)
    pool = HostPool(num_slots=4, blocks_per_chunk=1, row_bytes=layout.row_bytes)
    compute = object()
    streams: list[FakeStream] = []
    events: list[FakeCudaEvent] = []

    def new_stream() -> FakeStream:
        streams.append(FakeStream())
        return streams[-1]

    def new_event() -> FakeCudaEvent:
        events.append(FakeCudaEvent())
        return events[-1]

    engine = CudaCopyEngine(
        layout, pool, stream_factory=new_stream, event_factory=new_event,
        current_stream=lambda: compute, use_stream=fake_use_stream,
    )
    completion = engine.submit(CopyJob(job_id=1, direction="store", parts=(GroupBlocks(group=0, device_blocks=[2], host_rows=[0]),)))
    store_stream = streams[0]
    assert store_stream.waited_on == [compute]  # ordered after the compute stream
    assert events[0].recorded_on is store_stream
    assert not completion.query()
    events[0].fire()
    assert completion.query()
    assert torch.equal(pool.rows[0].view(torch.float32), kv["l0"][2])
