"""The worker half orders copies after the compute stream of the thread vLLM calls it on,
whichever thread runs the actors (vLLM 0.32 runs each model thread on its own compute
stream). The actors run on a loop thread here (``runtime: "thread"``), whose current
stream is the device's default one; the engine's thread has its own compute stream.
The CUDA engine's logic runs on :class:`~kvferry.testing.FakeCudaDevice`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvferry.testing import FakeCudaDevice, FakeStream
from kvferry.transfer import CopyJob, CudaCopyEngine, GroupBlocks, HostPool, KVLayout

from ._workers import fake_cuda_worker

DEVICE = FakeCudaDevice(fire_events=False)
ENGINES: list[CudaCopyEngine] = []


def fake_cuda_engine(layout: KVLayout, pool: HostPool) -> CudaCopyEngine:
    """A ``copy_engine`` factory: the CUDA engine on the shared fake device."""
    ENGINES.append(CudaCopyEngine(layout, pool, ops=DEVICE))
    return ENGINES[-1]


@pytest.fixture
def worker(make_vllm_config: Callable[..., Any], kv_cache_config: Any) -> Iterator[Any]:
    extra = {
        "cpu_bytes_to_use": 8 << 20,
        "runtime": "thread",
        "copy_engine": f"{__name__}:fake_cuda_engine",
    }
    with fake_cuda_worker(make_vllm_config, kv_cache_config, extra, DEVICE) as side:
        yield side


def store_meta(job_id: int) -> Any:
    from kvferry.connector._metadata import JobSpec, KVFerryMetadata

    part = GroupBlocks(group=0, device_blocks=[3, 4], host_rows=[0, 1])
    copy = CopyJob(job_id=job_id, direction="store", parts=(part,))
    return KVFerryMetadata(stores=[JobSpec(req_id="r", copy=copy)])


def test_a_store_waits_for_the_engine_threads_compute_stream(worker: Any) -> None:
    compute = FakeStream(name="compute")
    with DEVICE.current(compute):  # vLLM's model thread, inside its forward context
        worker.wait_for_save(store_meta(1))
    worker.get_finished()  # a poll: the store actor has handled the batch before it
    ENGINES[-1].wait_enqueued()  # and the engine's issue thread has enqueued it
    kernel = ENGINES[-1]._lanes["store"].kernel  # the stream that gathers the blocks
    [waited] = kernel.waited_events
    assert waited.recorded_on is compute  # not the actors' thread's default stream


def test_a_flush_fences_the_engine_threads_compute_stream(worker: Any) -> None:
    from kvferry.connector._metadata import KVFerryMetadata

    compute = FakeStream(name="compute")
    with DEVICE.current(compute):
        worker.wait_for_save(store_meta(2))
        worker.handle_preemptions(KVFerryMetadata(flush_job_ids=[2]))
    last = ENGINES[-1]._lanes["store"].dma  # the stream a store ends on (direct: the only)
    job_end = [e for e in DEVICE.events if e.recorded_on is last][-1]
    assert compute.waited_events == [job_end]  # the forward waits for the store's reads
    assert DEVICE.default_stream.waited_events == []
