"""Store/Load actors over the completion bridge, driven with completions fired by hand
(the CUDA engine's own logic: test_cuda_engine.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
import pytest
import torch

from kvferry.actors import ActorSystem, Reply
from kvferry.testing import FakeCopyEngine, FakeCudaEvent, Faulty
from kvferry.transfer import (
    CompletionBridge,
    CopyJob,
    Flushed,
    FlushJobs,
    GetStatistics,
    GroupBlocks,
    HostPool,
    JobFailed,
    JobResult,
    KVLayout,
    LoadActor,
    PollFinished,
    StoreActor,
    SubmitJob,
    SubmitJobs,
    ThreadCopyEngine,
    TransferMsg,
    describe_kv_caches,
)
from kvferry.transfer._kernel import batch_kernel
from kvferry.transfer._testing import ManualCompletion, ManualCopyEngine


def job(
    job_id: int,
    direction: str = "store",
    blocks: tuple[int, ...] | None = None,
    timeout_s: float | None = None,
) -> CopyJob:
    blocks = blocks or (job_id,)
    part = GroupBlocks(group=0, device_blocks=list(blocks), host_rows=list(blocks))
    return CopyJob(job_id=job_id, direction=direction, parts=(part,), timeout_s=timeout_s)  # type: ignore[arg-type]


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ----------------------------------------------------------------- the bridge


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


def test_bridge_treats_a_query_that_raises_as_a_failed_end() -> None:
    class Broken(FakeCudaEvent):
        def query(self) -> bool:
            raise RuntimeError("CUDA error: an illegal memory access")

    bridge: CompletionBridge[int] = CompletionBridge()
    bridge.add(1, Broken())
    [(token, error)] = bridge.poll()
    assert token == 1 and "illegal memory access" in str(error)


def test_bridge_refuses_a_token_already_pending() -> None:
    bridge: CompletionBridge[int] = CompletionBridge()
    bridge.add(1, FakeCudaEvent())
    with pytest.raises(KeyError):
        bridge.add(1, FakeCudaEvent())


@pytest.mark.anyio
async def test_bridge_waiter_thread_returns_when_the_completion_ends() -> None:
    bridge: CompletionBridge[int] = CompletionBridge()
    first, second = ManualCompletion(), ManualCompletion()
    bridge.add(1, first)
    bridge.add(2, second)
    done: list[int] = []

    async def waiter(token: int) -> None:
        await bridge.wait(token)
        done.append(token)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter, 1)
        tg.start_soon(waiter, 2)
        await anyio.wait_all_tasks_blocked()
        assert done == []
        second.fire()  # out of order, from this thread: the waiter thread wakes
        first.fire(RuntimeError("dma"))
    assert sorted(done) == [1, 2]
    assert [t for t, _ in bridge.poll()] == [1, 2]  # waiting consumed nothing


@pytest.mark.anyio
async def test_bridge_waiter_thread_times_out() -> None:
    bridge: CompletionBridge[int] = CompletionBridge()
    completion = ManualCompletion()
    bridge.add(1, completion)
    with pytest.raises(TimeoutError), anyio.fail_after(0):
        await bridge.wait(1)
    completion.fire()  # lets the abandoned thread end


# ----------------------------------------------------------------- the actors


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
        [failed] = await store.ask(PollFinished)
        assert isinstance(failed, JobFailed) and failed.job_id == 1 and not failed.ok
        assert "dma error" in failed.error and failed.reason == "copy" and failed.block_ids == (1,)


@pytest.mark.anyio
async def test_an_engine_that_raises_while_a_job_is_collected_fails_that_job_only() -> None:
    class Unaccountable(FakeCopyEngine):
        def job_bytes(self, job: CopyJob) -> int:
            if job.job_id == 2:
                raise RuntimeError("cannot count")
            return super().job_bytes(job)

    engine = Unaccountable()
    async with ActorSystem() as system:
        load = await system.spawn(LoadActor(engine))
        for i in (1, 2, 3):
            await load.tell(SubmitJob(job=job(i, "load", blocks=(i,))))
        await anyio.wait_all_tasks_blocked()
        for i in (1, 2, 3):
            engine.event_for(i).fire()
        results = {r.job_id: r for r in await load.ask(PollFinished)}
        assert sorted(results) == [1, 2, 3]
        assert results[1].ok and results[3].ok
        failed = results[2]
        assert isinstance(failed, JobFailed) and failed.reason == "engine"
        assert "cannot count" in failed.error and failed.block_ids == (2,)
        # The actor did not crash (no restart dropped a message) and goes on.
        assert load.statistics().restarts == 0
        await load.tell(SubmitJob(job=job(4, "load")))
        await anyio.wait_all_tasks_blocked()
        engine.event_for(4).fire()
        assert [(r.job_id, r.ok) for r in await load.ask(PollFinished)] == [(4, True)]


@pytest.mark.anyio
async def test_a_failed_submission_is_reported_with_its_blocks() -> None:
    engine = FakeCopyEngine(fail_submit=True)
    async with ActorSystem() as system:
        load = await system.spawn(LoadActor(engine))
        await load.tell(SubmitJob(job=job(7, "load", blocks=(5, 3, 5))))
        [result] = await load.ask(PollFinished)
        assert isinstance(result, JobFailed) and isinstance(result, JobResult)
        assert (result.job_id, result.direction, result.reason) == (7, "load", "submit")
        assert result.block_ids == (3, 5)


@pytest.mark.anyio
async def test_a_job_of_the_other_direction_is_rejected_not_asserted() -> None:
    engine = FakeCopyEngine()
    async with ActorSystem() as system:
        load = await system.spawn(LoadActor(engine))
        await load.tell(SubmitJob(job=job(1, "store")))
        [result] = await load.ask(PollFinished)
        assert isinstance(result, JobFailed) and result.reason == "rejected"
        assert engine.submitted == []


@pytest.mark.anyio
async def test_a_job_id_already_in_flight_is_rejected() -> None:
    engine = FakeCopyEngine()
    async with ActorSystem() as system:
        store = await system.spawn(StoreActor(engine))
        await store.tell(SubmitJob(job=job(1)))
        await store.tell(SubmitJob(job=job(1)))
        [result] = await store.ask(PollFinished)
        assert isinstance(result, JobFailed) and result.reason == "rejected"
        engine.event_for(1).fire()
        [done] = await store.ask(PollFinished)
        assert done.ok


@pytest.mark.anyio
async def test_past_its_deadline_a_job_is_cancelled_and_reported_failed_once_it_stopped() -> None:
    engine, clock = ManualCopyEngine(), Clock()
    async with ActorSystem() as system:
        load = await system.spawn(LoadActor(engine, job_timeout_s=5.0, clock=clock))
        await load.tell(SubmitJob(job=job(1, "load", blocks=(4, 2))))
        await load.tell(SubmitJob(job=job(2, "load", timeout_s=60.0)))
        await anyio.wait_all_tasks_blocked()  # submitted at clock.now
        clock.now += 6.0
        assert await load.ask(PollFinished) == []  # cancelled, but a piece still copies
        assert engine.completions[1].cancelled and not engine.completions[2].cancelled
        stats = await load.ask(GetStatistics)
        assert (stats.in_flight, stats.overdue) == (2, 1)
        engine.completions[1].fire(RuntimeError("dropped pieces"))  # the running piece ended
        [failed] = await load.ask(PollFinished)
        assert isinstance(failed, JobFailed)
        assert (failed.job_id, failed.reason, failed.block_ids) == (1, "deadline", (2, 4))


@pytest.mark.anyio
async def test_a_job_that_cannot_be_cancelled_stays_in_flight_until_it_really_ends() -> None:
    engine, clock = FakeCopyEngine(), Clock()  # CUDA-like: events cannot be cancelled
    async with ActorSystem() as system:
        load = await system.spawn(LoadActor(engine, job_timeout_s=1.0, clock=clock))
        await load.tell(SubmitJob(job=job(1, "load")))
        await anyio.wait_all_tasks_blocked()
        clock.now += 10.0
        assert await load.ask(PollFinished) == []
        assert (await load.ask(GetStatistics)).overdue == 1
        engine.event_for(1).fire()
        [late] = await load.ask(PollFinished)
        assert late.ok  # its copy finished: the blocks are valid
        stats = await load.ask(GetStatistics)
        assert (stats.in_flight, stats.overdue, stats.done) == (0, 0, 1)


@pytest.mark.anyio
async def test_flush_waits_for_the_jobs_and_leaves_them_to_the_poll() -> None:
    engine = ManualCopyEngine()
    async with ActorSystem() as system:
        store = await system.spawn(StoreActor(engine))
        await store.tell(SubmitJob(job=job(1)))
        replies: list[Flushed] = []

        async def flush() -> None:
            replies.append(
                await store.ask(lambda r: FlushJobs(job_ids=(1, 99), timeout_s=30.0, reply=r))
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(flush)
            await anyio.wait_all_tasks_blocked()
            assert replies == []
            engine.completions[1].fire()
        assert replies == [Flushed(cpu_waited=(1,), already_ended=(99,))]
        [result] = await store.ask(PollFinished)
        assert result.job_id == 1 and result.ok


@pytest.mark.anyio
async def test_flush_fails_with_a_timeout_when_a_job_does_not_end() -> None:
    engine = ManualCopyEngine()
    async with ActorSystem() as system:
        store = await system.spawn(StoreActor(engine))
        await store.tell(SubmitJob(job=job(1)))
        with pytest.raises(TimeoutError):
            await store.ask(lambda r: FlushJobs(job_ids=(1,), timeout_s=0.0, reply=r))
        engine.completions[1].fire()


@pytest.mark.anyio
async def test_a_flush_cancels_a_job_that_outlives_its_timeout_and_the_job_ends_failed() -> None:
    engine = ManualCopyEngine(cancel_ends=True)
    async with ActorSystem() as system:
        store = await system.spawn(StoreActor(engine))
        await store.tell(SubmitJob(job=job(1)))
        flushed = await store.ask(lambda r: FlushJobs(job_ids=(1,), timeout_s=0.0, reply=r))
        assert flushed == Flushed(cancelled=(1,))
        assert engine.completions[1].cancelled
        [result] = await store.ask(PollFinished)
        assert isinstance(result, JobFailed) and result.job_id == 1
        assert result.reason == "deadline"


@pytest.mark.anyio
async def test_a_factory_made_actor_restarted_by_its_supervisor_watches_its_jobs_again() -> None:
    engine = ManualCopyEngine()

    def make() -> Faulty[TransferMsg]:  # a batch makes each fresh instance fail once
        return Faulty(StoreActor(engine), when=lambda m: isinstance(m, SubmitJobs))

    async with ActorSystem() as system:
        store = await system.spawn(make, name="store")
        first: Reply[JobResult] = Reply()
        await store.tell(SubmitJob(job=job(1), notify=first))  # starts the watcher
        await store.tell(SubmitJobs(jobs=()))  # fails: restarted from a fresh instance
        engine.completions[1].fire()  # the first instance's on_stop waits for this copy
        with anyio.fail_after(5.0):
            ended = await first.wait()  # answered by the first instance, its copy ended
        assert (ended.job_id, ended.ok) == (1, True)
        second: Reply[JobResult] = Reply()
        await store.tell(SubmitJob(job=job(2), notify=second))  # needs a watcher again
        try:
            with anyio.fail_after(5.0):
                await store.ask(GetStatistics)  # submitted
        finally:
            engine.completions[2].fire()  # a failure must not leave on_stop waiting
        with anyio.fail_after(5.0):
            result = await second.wait()
        assert (result.job_id, result.ok) == (2, True)
        assert store.statistics().restarts == 1


def _small_kv() -> tuple[dict[str, torch.Tensor], HostPool, KVLayout]:
    kv = {"l0": torch.arange(4 * 64, dtype=torch.float32).reshape(4, 64)}
    layout = describe_kv_caches(kv, [["l0"]], 4)
    pool = HostPool(num_slots=4, blocks_per_chunk=1, row_bytes=layout.row_bytes)
    return kv, pool, layout


async def assert_flush_waits_until(store: Any, end_job: Callable[[], None]) -> None:
    """A flush of job 1 waits on the CPU until ``end_job`` ends the job, then says so."""
    replies: list[Flushed] = []

    async def flush() -> None:
        replies.append(await store.ask(lambda r: FlushJobs(job_ids=(1,), timeout_s=30.0, reply=r)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(flush)
        await anyio.wait_all_tasks_blocked()
        assert replies == []  # waiting on the CPU: the job has not ended
        end_job()
    assert replies == [Flushed(cpu_waited=(1,))]


@pytest.mark.anyio
async def test_flush_of_a_thread_engine_job_waits_until_it_ended() -> None:
    kv, pool, layout = _small_kv()
    gate = threading.Event()
    _, copy = batch_kernel("memmove")

    def gated(
        dsts: npt.NDArray[np.int64], srcs: npt.NDArray[np.int64], sizes: npt.NDArray[np.int64]
    ) -> None:
        gate.wait()  # the copy thread holds the piece until the test opens the gate
        copy(dsts, srcs, sizes)

    engine = ThreadCopyEngine(layout, pool, num_threads=1, kernel=gated)  # type: ignore[arg-type]
    try:
        async with ActorSystem() as system:
            store = await system.spawn(StoreActor(engine))
            await store.tell(SubmitJob(job=job(1, blocks=(2,))))
            await assert_flush_waits_until(store, gate.set)
            [result] = await store.ask(PollFinished)
            assert (result.job_id, result.ok) == (1, True)
        assert torch.equal(pool.rows[2].view(torch.float32), kv["l0"][2])
    finally:
        gate.set()
        engine.close()


@pytest.mark.anyio
async def test_flush_waits_on_the_cpu_when_the_device_fence_fails() -> None:
    class FenceFails(ManualCompletion):
        def order_before_compute(self, mark: object = None) -> None:
            raise RuntimeError("CUDA error: an illegal memory access")

    class Engine(ManualCopyEngine):
        def submit(self, job: CopyJob) -> ManualCompletion:
            completion = self.completions[job.job_id] = FenceFails()
            return completion

    engine = Engine()
    async with ActorSystem() as system:
        store = await system.spawn(StoreActor(engine))
        await store.tell(SubmitJob(job=job(1)))
        await assert_flush_waits_until(store, lambda: engine.completions[1].fire())


# ----------------------------------------------------------------- CUDA ordering
