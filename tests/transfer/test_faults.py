"""Failure injection: FaultyCopyEngine damages the jobs it picks, deterministically, and
the transfer actors report them as JobFailed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvferry.actors import ActorSystem
from kvferry.transfer import (
    CopyJob,
    FlushJobs,
    GroupBlocks,
    HostPool,
    JobFailed,
    KVBlockAccess,
    KVLayout,
    LoadActor,
    PollFinished,
    SubmitJob,
    copy_job,
    describe_kv_caches,
)
from kvferry.transfer import _testing as faults
from kvferry.transfer._testing import GARBAGE_BYTE, Fault, FaultyCopyEngine, InjectedFault

from .kvlayouts import NB, vllm_cpu


def job(job_id: int, direction: str, blocks: list[int], rows: list[int]) -> CopyJob:
    part = GroupBlocks(group=0, device_blocks=blocks, host_rows=rows)
    return CopyJob(job_id=job_id, direction=direction, parts=(part,))  # type: ignore[arg-type]


@pytest.fixture
def stored() -> Iterator[tuple[KVLayout, HostPool, KVBlockAccess, torch.Tensor]]:
    """Blocks 0..3 stored in rows 0..3; returns their bytes."""
    kv = vllm_cpu()
    layout = describe_kv_caches(kv.tensors, kv.groups, NB)
    pool = HostPool(num_slots=NB, blocks_per_chunk=1, row_bytes=layout.row_bytes)
    access = KVBlockAccess(layout)
    copy_job(layout, pool, job(0, "store", [0, 1, 2, 3], [0, 1, 2, 3]))
    yield layout, pool, access, access.read_blocks([0, 1, 2, 3])


def garbage(n: int, row_bytes: int) -> torch.Tensor:
    return torch.full((n, row_bytes), GARBAGE_BYTE, dtype=torch.uint8)


def test_every_second_load_fails_after_garbling_its_blocks(
    stored: tuple[KVLayout, HostPool, KVBlockAccess, torch.Tensor],
) -> None:
    layout, pool, access, want = stored
    engine = faults.fail_every_2nd_load(layout, pool)
    try:
        outcomes = []
        for i in range(4):
            c = engine.submit(job(10 + i, "load", [4 + i], [i]))
            c.synchronize()
            outcomes.append(c.exception())
        assert [e is None for e in outcomes] == [True, False, True, False]
        assert all(isinstance(e, InjectedFault) for e in outcomes[1::2])
        got = access.read_blocks([4, 5, 6, 7])
        assert torch.equal(got[0::2], want[0::2])
        assert torch.equal(got[1::2], garbage(2, access.row_bytes))
        assert isinstance(engine, FaultyCopyEngine) and engine.injected == [
            (11, "fail"),
            (13, "fail"),
        ]
    finally:
        engine.close()


def test_corrupt_mode_garbles_and_reports_success(
    stored: tuple[KVLayout, HostPool, KVBlockAccess, torch.Tensor],
) -> None:
    layout, pool, access, _ = stored
    engine = faults.corrupt_every_load(layout, pool)
    try:
        c = engine.submit(job(1, "load", [5, 6], [0, 1]))
        c.synchronize()
        assert c.exception() is None
        assert torch.equal(access.read_blocks([5, 6]), garbage(2, access.row_bytes))
    finally:
        engine.close()


def test_reject_mode_raises_at_submit(
    stored: tuple[KVLayout, HostPool, KVBlockAccess, torch.Tensor],
) -> None:
    layout, pool, _, _ = stored
    engine = faults.reject_every_2nd_load(layout, pool)
    try:
        engine.submit(job(1, "load", [5], [0])).synchronize()
        with pytest.raises(InjectedFault):
            engine.submit(job(2, "load", [6], [1]))
    finally:
        engine.close()


def test_a_failed_store_garbles_its_host_rows(
    stored: tuple[KVLayout, HostPool, KVBlockAccess, torch.Tensor],
) -> None:
    layout, pool, _, _ = stored
    engine = faults.fail_every_2nd_store(layout, pool)
    try:
        engine.submit(job(1, "store", [0], [5])).synchronize()
        failed = engine.submit(job(2, "store", [1], [6]))
        failed.synchronize()
        assert isinstance(failed.exception(), InjectedFault)
        assert bool((pool.rows[6] == GARBAGE_BYTE).all()) and not bool(
            (pool.rows[5] == GARBAGE_BYTE).all()
        )
    finally:
        engine.close()


def test_faults_count_each_direction_on_its_own(
    stored: tuple[KVLayout, HostPool, KVBlockAccess, torch.Tensor],
) -> None:
    layout, pool, _, _ = stored
    factory = faults.faulty_engine_factory(
        Fault(direction="load", every=2), Fault(direction="store", every=3)
    )
    engine = factory(layout, pool)
    try:
        for i, direction in enumerate(["store", "load", "store", "load", "store"]):
            engine.submit(job(i, direction, [i], [i])).synchronize()
        assert engine.injected == [(3, "fail"), (4, "fail")]
    finally:
        engine.close()


@pytest.mark.anyio
async def test_an_injected_load_failure_reaches_the_poll_as_job_failed(
    stored: tuple[KVLayout, HostPool, KVBlockAccess, torch.Tensor],
) -> None:
    layout, pool, _, _ = stored
    engine = faults.fail_every_load(layout, pool)
    try:
        async with ActorSystem() as system:
            load = await system.spawn(LoadActor(engine, job_timeout_s=60.0))
            await load.tell(SubmitJob(job=job(1, "load", [6, 5], [0, 1])))
            await load.ask(lambda r: FlushJobs(job_ids=(1,), timeout_s=30.0, reply=r))
            [result] = await load.ask(PollFinished)
        assert isinstance(result, JobFailed)
        assert (result.block_ids, result.reason) == ((5, 6), "copy")
        assert "injected" in result.error
    finally:
        engine.close()


def test_fault_every_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Fault(direction="load", every=0)
