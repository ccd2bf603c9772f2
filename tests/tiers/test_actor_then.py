"""``then``: the next step of a disk job, run in the disk actor's task once the job ended
(the worker chains a load's copy after its reads this way)."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import numpy.typing as npt
import pytest

from kvferry import ActorStopped
from kvferry.actors import ActorSystem, Reply
from kvferry.testing import Probe, assert_no_task_left
from kvferry.tiers import (
    DiskIOActor,
    DiskJobResult,
    PollDiskJobs,
    ReadChunks,
    WriteChunks,
    aligned_buffer,
    keys_array,
)

from .conftest import key

SLOT_BYTES = 4096 + 512


def pool(num_slots: int = 8) -> npt.NDArray[np.uint8]:
    rows = aligned_buffer(num_slots * SLOT_BYTES).reshape(num_slots, SLOT_BYTES)
    rows[:] = np.random.default_rng(3).integers(0, 256, rows.shape, dtype=np.uint8)
    return rows


@pytest.mark.anyio
async def test_then_runs_with_the_result_after_a_poll_can_see_it(make_store: Any) -> None:
    slots = pool()
    async with ActorSystem() as system:
        actor = DiskIOActor(make_store(), slots)
        disk = await system.spawn(actor)
        probe = Probe()
        received = await system.spawn(probe)
        polled: list[DiskJobResult] = []

        async def then(result: DiskJobResult) -> None:
            # Run in the disk actor's task, once the result is queued for polls.
            polled.extend(actor._ended)
            await received.tell(result)

        keys = keys_array([key(0), key(1)])
        await disk.tell(WriteChunks(job_id=1, keys=keys, slots=[0, 1], then=then))
        wrote = await probe.expect(DiskJobResult)
        assert wrote.job_id == 1 and wrote.ok and wrote.kind == "write"
        assert [r.job_id for r in polled] == [1]
        missing = keys_array([key(1), key(7)])
        await disk.tell(ReadChunks(job_id=2, keys=missing, slots=[4, 5], then=then))
        read = await probe.expect(DiskJobResult)
        assert read.job_id == 2 and not read.ok
        results = await disk.ask(PollDiskJobs)
        assert [r.job_id for r in results] == [1, 2]  # reported once each, by the poll too
        assert np.array_equal(slots[4], slots[1])


@pytest.mark.anyio
async def test_a_then_whose_receiver_stopped_is_dropped_and_the_actor_goes_on(
    make_store: Any,
) -> None:
    async with ActorSystem() as system:
        disk = await system.spawn(DiskIOActor(make_store(), pool()))

        async def gone(result: DiskJobResult) -> None:
            raise ActorStopped("the load actor has stopped")

        await disk.tell(WriteChunks(job_id=1, keys=keys_array([key(0)]), slots=[0], then=gone))
        with anyio.fail_after(10):
            while not (results := await disk.ask(PollDiskJobs)):
                await anyio.wait_all_tasks_blocked()
        assert [r.job_id for r in results] == [1]
        assert disk.statistics().failures == 0


@pytest.mark.anyio
@pytest.mark.parametrize("checkpoints", range(6))
async def test_a_first_job_arriving_as_the_system_stops_ends_and_leaves_no_task(
    make_store: Any, checkpoints: int
) -> None:
    """The runners start with the first job; one whose start overlaps the system's
    shutdown must not be left running (the shutdown would wait for it forever)."""
    reply: Reply[DiskJobResult] = Reply()
    with anyio.fail_after(30):
        async with assert_no_task_left():
            async with ActorSystem() as system:
                disk = await system.spawn(DiskIOActor(make_store(), pool()))
                keys = keys_array([key(0)])
                await disk.tell(WriteChunks(job_id=1, keys=keys, slots=[0], notify=reply))
                for _ in range(checkpoints):  # the job handled at another point of the stop
                    await anyio.lowlevel.checkpoint()
    assert system.shutdown_report is not None and system.shutdown_report.clean
    assert reply.done  # written, or failed with ActorStopped: ended either way
    assert disk.statistics().failures == 0
