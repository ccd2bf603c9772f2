"""A load that no worker acknowledges ends at its deadline (``job_timeout_s``, on the
scheduler's injected clock): it counts as failed, its host slots are unpinned, requests
waiting on its blocks look them up again, and the workers report its blocks invalid
whenever the copy ends."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvferry import FerryConfig
from kvferry.cache import GetStatistics
from kvferry.testing import FakeCudaDevice
from kvferry.transfer import CopyJob, CudaCopyEngine, GroupBlocks, HostPool, KVLayout

from ._steps import BLOCK, acked, allocated, key, request, step, store_keys
from ._workers import fake_cuda_worker

TIMEOUT_S = 5.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def scheduler(make_vllm_config: Any, kv_cache_config: Any, clock: Clock) -> Iterator[Any]:
    from kvferry.connector._scheduler import SchedulerSide

    extra = {"cpu_bytes_to_use": 64 << 20, "job_timeout_s": TIMEOUT_S}
    side = SchedulerSide(
        make_vllm_config(extra), kv_cache_config, FerryConfig.from_dict(extra), clock=clock
    )
    try:
        yield side
    finally:
        side.shutdown()


def pinned(side: Any) -> int:
    return int(side._ask(GetStatistics).pinned)


def test_a_load_never_acknowledged_ends_failed_at_its_deadline(
    scheduler: Any, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = request("a", 4 * BLOCK + 8), request("b", 4 * BLOCK + 8)  # the same prompt
    store_keys(scheduler, [key(a, c) for c in range(4)])
    for r in (a, b):
        scheduler.on_new_request(r)
    assert scheduler.get_num_new_matched_tokens(a, 0) == (4 * BLOCK, True)
    scheduler.update_state_after_alloc(a, allocated([1, 2, 3, 4]), 4 * BLOCK)
    meta = scheduler.build_connector_meta(step({}, {}))
    [load] = meta.loads
    job_id = load.copy.job_id

    clock.now += TIMEOUT_S - 0.1
    assert scheduler.get_num_new_matched_tokens(b, 0) == (None, False)  # waits for a's load
    assert scheduler.build_connector_meta(step({}, {})).failed_load_job_ids == []
    assert pinned(scheduler) == 4

    clock.now += 0.1
    meta = scheduler.build_connector_meta(step({}, {}))
    assert meta.failed_load_job_ids == [job_id]  # the workers report its blocks invalid
    stats = scheduler.statistics()
    assert (stats.loads_failed, stats.loads_failed_deadline, stats.loads_failed_copy) == (1, 1, 0)
    assert pinned(scheduler) == 0
    assert "load_deadline_exceeded" in caplog.text
    # The request that waited on it is held back no longer.
    assert scheduler.get_num_new_matched_tokens(b, 0) == (4 * BLOCK, True)
    assert scheduler.build_connector_meta(step({}, {})).failed_load_job_ids == []  # told once

    # vLLM still waits for a's finished_recving (only a copy that ended sends it), and
    # keeps an aborted a's blocks until then.
    assert scheduler.request_finished(a, ([1, 2, 3, 4],))[0] is True
    # The late report is taken quietly: nothing counted twice, nothing unpinned twice.
    caplog.clear()
    late = acked(job_id)
    late.finished_recving = {"a"}
    scheduler.update_connector_output(late)
    assert "ack_for_unknown_job" not in caplog.text
    stats = scheduler.statistics()
    assert (stats.loads_failed, stats.loads_done, stats.jobs_in_flight) == (1, 0, 0)
    assert stats.loads_failed_deadline == 1 and stats.loads_failed_copy == 0
    assert "a" not in scheduler._reqs
    assert scheduler._expired == {}


def test_a_load_acknowledged_in_time_is_not_expired(scheduler: Any, clock: Clock) -> None:
    a = request("a", 2 * BLOCK + 8)
    store_keys(scheduler, [key(a, 0), key(a, 1)])
    scheduler.on_new_request(a)
    assert scheduler.get_num_new_matched_tokens(a, 0) == (2 * BLOCK, True)
    scheduler.update_state_after_alloc(a, allocated([1, 2]), 2 * BLOCK)
    [load] = scheduler.build_connector_meta(step({}, {})).loads
    scheduler.update_connector_output(acked(load.copy.job_id))
    clock.now += 10 * TIMEOUT_S
    assert scheduler.build_connector_meta(step({}, {})).failed_load_job_ids == []
    assert scheduler.statistics().loads_done == 1


# -- the worker half ----------------------------------------------------------------------

DEVICE = FakeCudaDevice(fire_events=False)


def fake_cuda_engine(layout: KVLayout, pool: HostPool) -> CudaCopyEngine:
    """A ``copy_engine`` factory: the CUDA engine on a fake device whose events fire when
    the test says."""
    ENGINES.append(CudaCopyEngine(layout, pool, ops=DEVICE))
    return ENGINES[-1]


ENGINES: list[CudaCopyEngine] = []


@pytest.fixture
def worker(make_vllm_config: Callable[..., Any], kv_cache_config: Any) -> Iterator[Any]:
    extra = {"cpu_bytes_to_use": 8 << 20, "copy_engine": f"{__name__}:fake_cuda_engine"}
    with fake_cuda_worker(make_vllm_config, kv_cache_config, extra, DEVICE) as side:
        yield side


def test_a_worker_reports_a_load_the_scheduler_ended_as_failed_when_it_ends(worker: Any) -> None:
    """The copy succeeds, but its host slots were unpinned at the deadline and may have
    been overwritten while it read them: its blocks are reported invalid."""
    from kvferry.connector._metadata import JobSpec, KVFerryMetadata

    part = GroupBlocks(group=0, device_blocks=[3, 4], host_rows=[0, 1])
    copy = CopyJob(job_id=7, direction="load", parts=(part,))
    worker.start_load_kv(KVFerryMetadata(loads=[JobSpec(req_id="r", copy=copy)]))
    assert worker.get_finished() == (None, None)  # in flight
    worker.start_load_kv(KVFerryMetadata(failed_load_job_ids=[7, 99]))  # 99: not in flight
    ENGINES[-1].wait_enqueued()  # the load's events exist once it is enqueued
    for event in DEVICE.events:
        event.fire()
    assert worker.get_finished() == (None, {"r"})
    assert worker.get_block_ids_with_load_errors() == {3, 4}
    assert worker.build_worker_meta().acks == {7: [1, 1]}


def test_a_load_planned_failed_is_not_copied_and_its_blocks_are_reported_invalid(
    worker: Any,
) -> None:
    from kvferry.connector._metadata import JobSpec, KVFerryMetadata

    part = GroupBlocks(group=0, device_blocks=[5, 6], host_rows=[-1, -1])
    copy = CopyJob(job_id=8, direction="load", parts=(part,))
    launched = len(DEVICE.events)
    worker.start_load_kv(
        KVFerryMetadata(loads=[JobSpec(req_id="q", copy=copy)], failed_load_job_ids=[8])
    )
    assert worker.get_finished() == (None, {"q"})
    assert worker.get_block_ids_with_load_errors() == {5, 6}
    assert worker.build_worker_meta().acks == {8: [1, 1]}
    assert len(DEVICE.events) == launched  # nothing was enqueued


def test_with_several_kv_cache_groups_a_failed_load_is_reported_per_request(
    make_vllm_config: Callable[..., Any],
) -> None:
    """vLLM takes invalid block ids only for a model of one KV-cache group (block ids are
    per group; it raises otherwise): a hybrid model's failed load is reported whole, in
    ``failed_recving``, and vLLM recomputes the request."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvferry.connector._metadata import JobSpec, KVFerryMetadata
    from kvferry.connector._worker import WorkerSide

    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    config = KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([layers[0]], spec), KVCacheGroupSpec([layers[1]], spec)],
    )
    extra = {"cpu_bytes_to_use": 8 << 20, "copy_engine": f"{__name__}:fake_cuda_engine"}
    side = WorkerSide(make_vllm_config(extra), config, FerryConfig.from_dict(extra))
    side.register_kv_caches({n: torch.randn(2, 16, 128, 2, 64).bfloat16() for n in layers})
    try:
        parts = tuple(GroupBlocks(group=g, device_blocks=[5], host_rows=[-1]) for g in range(2))
        copy = CopyJob(job_id=3, direction="load", parts=parts)
        side.start_load_kv(
            KVFerryMetadata(loads=[JobSpec(req_id="h", copy=copy)], failed_load_job_ids=[3])
        )
        assert side.get_finished() == (None, {"h"})
        assert side.get_block_ids_with_load_errors() == set()
        assert side.take_failed_recving() == {"h"}
        assert side.take_failed_recving() == set()
    finally:
        side.shutdown()
