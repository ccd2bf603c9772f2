"""The CUDA copy engine's logic on a CPU: :class:`~kvferry.testing.FakeCudaDevice` runs
every op when it is enqueued, the Triton page kernel in Triton's interpreter (the same
kernel a GPU compiles), records what each stream waited on, and counts what the engine
asked of the device."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest
import torch

from kvferry.actors import ActorSystem
from kvferry.testing import FakeCudaDevice, FakeCudaEvent, FakeStream
from kvferry.transfer import (
    CopyJob,
    CudaCopyEngine,
    DeviceFenced,
    Flushed,
    FlushJobs,
    GroupBlocks,
    HostPool,
    KVLayout,
    PollFinished,
    StoreActor,
    SubmitJobs,
    describe_kv_caches,
)
from kvferry.transfer._cuda import CopyPath, IssueMode
from kvferry.transfer._pages import element_bytes, plan_batch

from .kvlayouts import KV, LAYOUTS, NB, per_layer_split_hnd, per_layer_split_nhd, two_groups


def job(job_id: int, direction: str, blocks: object, rows: object, group: int = 0) -> CopyJob:
    part = GroupBlocks(group=group, device_blocks=blocks, host_rows=rows)  # type: ignore[arg-type]
    return CopyJob(job_id=job_id, direction=direction, parts=(part,))  # type: ignore[arg-type]


def setup(
    kv: KV,
    *,
    rows: int = 40,
    slot_rows: int = 64,
    ring: int = 2,
    fire: bool = True,
    path: CopyPath = "staged",
    row_programs: int = 1024,
    issue: IssueMode = "thread",
) -> tuple[KVLayout, HostPool, CudaCopyEngine, FakeCudaDevice]:
    layout = describe_kv_caches(kv.tensors, kv.groups, NB, kv.block_stride_bytes)
    pool = HostPool(num_slots=rows, blocks_per_chunk=1, row_bytes=layout.row_bytes)
    device = FakeCudaDevice(fire_events=fire)
    engine = CudaCopyEngine(
        layout,
        pool,
        path=path,
        staging_bytes=slot_rows * ring * pool.row_bytes,
        ring_slots=ring,
        row_programs=row_programs,
        issue=issue,
        ops=device,
    )
    assert engine.path == path
    return layout, pool, engine, device


def ended_ok(completions: list[Any]) -> None:
    for c in completions:
        c.synchronize()  # the issue thread enqueued it (the fakes' events fired then)
        assert c.query() and c.exception() is None


def expect_moved(
    kv: KV, before: dict[str, list[torch.Tensor]], src: list[int], dst: list[int], layers: list[str]
) -> None:
    for name in layers:
        for b in range(NB):
            want = before[name][src[dst.index(b)]] if b in dst else before[name][b]
            assert torch.equal(kv.block(name, b), want), (name, b)


# ----------------------------------------------------------------- bit-exact batches


@pytest.mark.parametrize("make", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_a_step_batch_bigger_than_the_ring_round_trips_bit_exactly(make: Callable[[], KV]) -> None:
    kv = make()
    before = kv.snapshot()
    # 2 slots of 2 rows: a batch of 3 jobs (7 blocks) is 4 pieces, each slot used twice
    _, pool, engine, device = setup(kv, slot_rows=2, ring=2)
    rng = np.random.default_rng(7)
    for g, layers in enumerate(kv.groups):
        src = [int(b) for b in rng.choice(NB, 7, replace=False)]
        rows = [int(r) for r in rng.choice(40, 7, replace=False)]
        dst = [int(b) for b in rng.permutation(src)]
        stores = [
            job(1, "store", src[:3], rows[:3], g),
            job(2, "store", src[3:4], rows[3:4], g),
            job(3, "store", src[4:], rows[4:], g),
        ]
        ended_ok(engine.submit_batch(stores))
        loads = [job(4, "load", dst[:5], rows[:5], g), job(5, "load", dst[5:], rows[5:], g)]
        ended_ok(engine.submit_batch(loads))
        expect_moved(kv, before, src, dst, layers)
        before = kv.snapshot()
    stats = engine.statistics()
    assert stats.pieces == stats.kernel_launches == device.kernel_launches
    assert stats.pieces == 4 * 2 * len(kv.groups)  # 7 rows in pieces of 2, both directions


@pytest.mark.parametrize("path", ["staged", "direct"])
@pytest.mark.parametrize("make", [per_layer_split_nhd, per_layer_split_hnd], ids=["nhd", "hnd"])
@pytest.mark.parametrize("count", [1, 3, 7])
def test_odd_block_counts_round_trip_in_nhd_and_hnd(
    make: Callable[[], KV], count: int, path: CopyPath
) -> None:
    kv = make()
    before = kv.snapshot()
    # direct: one program along the rows, which then loops over all of them
    _, _, engine, _ = setup(kv, slot_rows=3, ring=3, path=path, row_programs=1)
    src = list(range(NB - count, NB))
    rows = [5 + 2 * i for i in range(count)]  # no two consecutive: one DMA per row
    dst = list(range(count))
    ended_ok(engine.submit_batch([job(1, "store", src, rows)]))
    ended_ok(engine.submit_batch([job(2, "load", dst, rows)]))
    expect_moved(kv, before, src, dst, kv.groups[0])


@pytest.mark.parametrize("path", ["staged", "direct"])
def test_two_groups_in_one_batch_land_in_their_own_rows(path: CopyPath) -> None:
    kv = two_groups()
    before = kv.snapshot()
    _, pool, engine, _ = setup(kv, slot_rows=4, ring=2, path=path)
    part_a = GroupBlocks(group=0, device_blocks=[1, 2, 3], host_rows=[10, 11, 12])
    part_b = GroupBlocks(group=1, device_blocks=[4, 5], host_rows=[20, 21])
    ended_ok(engine.submit_batch([CopyJob(job_id=1, direction="store", parts=(part_a, part_b))]))
    back_a = GroupBlocks(group=0, device_blocks=[7, 8, 9], host_rows=[10, 11, 12])
    back_b = GroupBlocks(group=1, device_blocks=[0, 6], host_rows=[20, 21])
    ended_ok(engine.submit_batch([CopyJob(job_id=2, direction="load", parts=(back_a, back_b))]))
    expect_moved(kv, before, [1, 2, 3], [7, 8, 9], kv.groups[0])
    expect_moved(kv, before, [4, 5], [0, 6], kv.groups[1])


def test_consecutive_host_rows_go_as_one_dma_per_run() -> None:
    kv = per_layer_split_nhd()
    _, _, engine, device = setup(kv, slot_rows=64)
    # rows 3..6 in one job (given out of order), 9 alone, 10..11 in the next job
    engine.submit_batch(
        [
            job(1, "store", [0, 1, 2, 3], [5, 3, 6, 4]),
            job(2, "store", [4], [9]),
            job(3, "store", [5, 6], [10, 11]),
        ]
    )
    engine.wait_enqueued()
    assert device.memcpys == engine.statistics().dma_copies == 2  # [3..6], [9..11]


@pytest.mark.parametrize("batched", [True, False], ids=["one-call-a-piece", "run-by-run"])
def test_a_pieces_runs_go_in_one_batched_copy_where_the_device_has_one(batched: bool) -> None:
    kv = per_layer_split_nhd()
    before = kv.snapshot()
    layout = describe_kv_caches(kv.tensors, kv.groups, NB)
    pool = HostPool(num_slots=40, blocks_per_chunk=1, row_bytes=layout.row_bytes)
    device = FakeCudaDevice(batched_copies=batched)
    engine = CudaCopyEngine(
        layout, pool, staging_bytes=8 * pool.row_bytes, ring_slots=2, ops=device
    )
    src, rows, dst = [0, 1, 2, 3, 4, 5, 6], [30, 2, 17, 9, 3, 21, 11], [9, 8, 7, 6, 5, 4, 3]
    ended_ok(
        engine.submit_batch(
            [job(1, "store", src[:4], rows[:4]), job(2, "store", src[4:], rows[4:])]
        )
    )
    ended_ok(engine.submit_batch([job(3, "load", dst, rows)]))
    expect_moved(kv, before, src, dst, kv.groups[0])
    # 7 rows in pieces of 4, 2 pieces each way. Stores (a job's rows sorted): [2 9 17 30]
    # [3 11 21], 7 runs; the load: [2 3 9 11] [17 21 30], 6 runs ([2, 3] is one)
    assert device.memcpys == engine.statistics().dma_copies == 13
    assert device.memcpy_batches == (4 if batched else 0)


@pytest.mark.parametrize("issue", ["thread", "inline"])
def test_a_batch_of_both_directions_goes_out_a_piece_of_each_in_turn(issue: IssueMode) -> None:
    kv = per_layer_split_nhd()
    _, _, engine, device = setup(kv, slot_rows=2, ring=2, issue=issue)
    seen: list[tuple[bool, object]] = []
    real = device.copy_rows

    def logged(*args: Any) -> None:
        seen.append((args[7], device.current_stream()))  # to_device, the launch's stream
        real(*args)

    device.copy_rows = logged  # type: ignore[method-assign]
    both = [job(1, "store", [0, 1, 2, 3], [0, 1, 2, 3]), job(2, "load", [4, 5, 6, 7], [9, 8, 7, 6])]
    engine.submit_batch(both)
    engine.wait_enqueued()
    loads, stores = engine._lanes["load"].kernel, engine._lanes["store"].kernel
    # two pieces each way, a load's first: each launch on its own lane's kernel stream
    assert [(d, stream) for d, stream in seen] == [
        (True, loads),
        (False, stores),
        (True, loads),
        (False, stores),
    ]
    # the calling thread's current stream is left as it was (the issue thread's own is
    # set before each op that uses it)
    assert device.current_stream() is device.default_stream


def test_a_direction_that_fails_before_enqueuing_fails_alone() -> None:
    kv = per_layer_split_nhd()
    before = kv.snapshot()
    _, _, engine, device = setup(kv, slot_rows=2, ring=2)
    real = device.new_stream

    def no_store_lane(direction: str) -> Any:
        if direction == "store":
            raise RuntimeError("CUDA out of memory")
        return real(direction)

    device.new_stream = no_store_lane  # type: ignore[method-assign]
    [first] = engine.submit_batch([job(1, "store", [0, 1], [0, 1])])
    first.synchronize()
    assert first.query() and "out of memory" in repr(first.exception())  # no raise
    store, load = engine.submit_batch(
        [job(2, "store", [2], [2]), job(3, "load", [5, 6, 7], [0, 1, 2])]
    )
    store.synchronize()
    assert store.query() and "out of memory" in repr(store.exception())
    ended_ok([load])  # the loads went on: rows 0..2 (never written: zeros) in blocks 5..7
    for name in kv.groups[0]:
        for b in (5, 6, 7):
            assert before[name][b].any() and not kv.block(name, b).any()


# ----------------------------------------------------------------- launches per job


def layers_kv(num_layers: int) -> KV:
    """Flash-attention's layout: per layer (2, blocks, 4, 2, 8) fp16, K and V split."""
    g = torch.Generator().manual_seed(num_layers)
    ts = {f"l{i}": torch.randn(2, NB, 4, 2, 8, generator=g).half() for i in range(num_layers)}
    return KV(ts, [list(ts)], {n: 1 for n in ts})


@pytest.mark.parametrize("path", ["staged", "direct"])
@pytest.mark.parametrize("direction", ["store", "load"])
def test_device_launches_per_batch_do_not_grow_with_the_layer_count(
    direction: str, path: CopyPath
) -> None:
    counts = []
    for num_layers in (2, 64):
        kv = layers_kv(num_layers)
        layout, _, engine, device = setup(kv, slot_rows=64, path=path)
        assert len(layout.groups[0].segments) == 2 * num_layers  # K and V of every layer
        engine.submit_batch([job(i, direction, [i, i + 4], [2 * i, 2 * i + 1]) for i in range(4)])
        engine.submit(job(9, direction, [9], [30]))  # a single job, as external callers do
        engine.wait_enqueued()
        stats = engine.statistics()
        counts.append((device.kernel_launches, stats.table_uploads, device.memcpys, device.uploads))
    # per batch: one row table, one launch, and (staged) one DMA per run; the page
    # templates once. Direct: no DMA at all, the kernel reaches the host rows.
    assert counts[0] == counts[1] == ((2, 2, 2, 3) if path == "staged" else (2, 2, 0, 3))


def test_a_batch_is_planned_without_a_python_loop_per_block() -> None:
    jobs = [job(i, "store", np.arange(16) + i, np.arange(16) * 3 + 100 * i) for i in range(64)]
    plan = plan_batch(jobs, slot_rows=256)
    assert plan.num_rows == 1024 and plan.num_pieces == 4
    assert len(plan.runs_len) == 1024  # no two host rows adjacent
    assert plan.job_piece.tolist() == [i * 16 // 256 for i in range(64)]


def test_element_width_is_the_widest_that_divides_every_address_and_size() -> None:
    assert element_bytes(np.array([64, 128, 8], dtype=np.int64)) == 8
    assert element_bytes(np.array([64, 132, 8], dtype=np.int64)) == 4
    assert element_bytes(np.array([64, 128, 6], dtype=np.int64)) == 2
    assert element_bytes(np.array([65, 128, 8], dtype=np.int64)) == 1


# ----------------------------------------------------------------- ordering, failures


def test_a_batch_waits_on_the_compute_mark_and_each_job_ends_with_its_piece() -> None:
    kv = per_layer_split_nhd()
    _, pool, engine, device = setup(kv, slot_rows=2, ring=2, fire=False)
    compute = FakeStream(name="compute")
    with device.current(compute):
        mark = engine.capture_compute()  # on the engine's thread
    assert mark.event.recorded_on is compute
    a, b = engine.submit_batch(
        [job(1, "store", [0, 1], [0, 1]), job(2, "store", [2, 3], [2, 3])], mark
    )
    engine.wait_enqueued()
    kernel, dma = device.streams  # the store lane's two streams
    assert kernel.waited_events[0] is mark.event  # the gather reads after the forward
    assert not a.query() and not b.query()
    piece_ends = [e for e in device.events if e.recorded_on is dma]
    assert len(piece_ends) == 2
    piece_ends[0].fire()
    assert a.query() and not b.query()  # job 1 lies in the first piece only
    piece_ends[1].fire()
    assert b.query() and b.exception() is None


def test_a_slot_is_reused_only_after_its_last_dma_ended_without_a_cpu_wait() -> None:
    kv = per_layer_split_nhd()
    _, _, engine, device = setup(kv, slot_rows=1, ring=2, fire=False)
    engine.submit_batch([job(1, "store", [0, 1, 2], [0, 1, 2])])  # pieces 0,1,2 on slots 0,1,0
    engine.wait_enqueued()
    kernel, dma = device.streams
    dma_ends = [e for e in device.events if e.recorded_on is dma]
    assert dma_ends[0] in kernel.waited_events  # piece 2's gather waits for piece 0's DMA
    assert dma_ends[1] not in kernel.waited_events  # slot 1 was not reused yet


def test_a_load_is_ordered_after_compute_where_it_writes_the_engines_blocks() -> None:
    kv = per_layer_split_nhd()
    _, pool, engine, device = setup(kv, fire=False)
    compute = FakeStream(name="compute")
    with device.current(compute):
        mark = engine.capture_compute()
    engine.submit_batch([job(1, "load", [0], [0])], mark)
    engine.wait_enqueued()
    kernel, dma = device.streams
    assert mark.event in kernel.waited_events and mark.event not in dma.waited_events


def test_a_batch_failing_half_way_ends_only_after_what_it_enqueued() -> None:
    kv = per_layer_split_nhd()
    _, _, engine, device = setup(kv, slot_rows=1, ring=2, fire=False)
    launches = 0
    real = device.copy_rows

    def second_launch_fails(*args: object) -> None:
        nonlocal launches
        launches += 1
        if launches == 2:
            raise RuntimeError("CUDA error: launch failed")
        real(*args)  # type: ignore[arg-type]

    device.copy_rows = second_launch_fails  # type: ignore[method-assign]
    first, second = engine.submit_batch([job(1, "store", [0], [0]), job(2, "store", [1], [1])])
    engine.wait_enqueued()
    assert not first.query() and not second.query()
    for event in device.events[:-1]:
        event.fire()
    assert first.query() and first.exception() is None  # its piece was fully enqueued
    assert not second.query()  # ends with the event recorded after everything enqueued
    device.events[-1].fire()
    assert second.query() and "launch failed" in repr(second.exception())


def test_a_job_naming_blocks_that_do_not_exist_fails_alone() -> None:
    kv = per_layer_split_nhd()
    _, pool, engine, device = setup(kv)
    bad, good = engine.submit_batch([job(1, "load", [NB], [0]), job(2, "store", [1], [1])])
    bad.synchronize()  # checked on the issue thread: the calling thread only hands over
    assert bad.query() and isinstance(bad.exception(), IndexError)
    ended_ok([good])
    assert device.kernel_launches == 1
    with pytest.raises(IndexError):
        engine.submit(job(3, "load", [0], [999]))  # submit alone raises, enqueues nothing
    assert device.kernel_launches == 1


# ----------------------------------------------------------------- fencing in the actor


@pytest.mark.anyio
async def test_a_flush_fences_the_marks_compute_stream_and_does_not_wait() -> None:
    kv = per_layer_split_nhd()
    _, _, engine, device = setup(kv, fire=False)
    compute = FakeStream(name="compute")
    with device.current(compute):
        mark = engine.capture_compute()
    async with ActorSystem() as system:
        store = await system.spawn(StoreActor(engine))
        await store.tell(SubmitJobs(jobs=(job(1, "store", [1], [1]),), compute=mark))
        await store.tell(SubmitJobs(jobs=(job(2, "store", [2], [2]),), compute=mark))
        # the actor runs on this thread, whose current stream is the default one: the
        # fence must still go on the mark's compute stream
        flushed = await store.ask(
            lambda r: FlushJobs(job_ids=(1,), timeout_s=0.0, reply=r, compute=mark)
        )
        assert flushed == Flushed(device_fenced=(1,))
        job_end = [e for e in device.events if e.recorded_on is device.streams[1]][0]
        assert compute.waited_events == [job_end]
        assert device.default_stream.waited_events == []
        assert await store.ask(PollFinished) == []  # still in flight until its event fires
        engine.wait_enqueued()  # job 2's events exist once the issue thread enqueued it
        for e in device.events:
            e.fire()
        assert [r.job_id for r in await store.ask(PollFinished)] == [1, 2]


def test_fake_events_refuse_a_wait_that_would_hang() -> None:
    with pytest.raises(RuntimeError, match="would hang"):
        FakeCudaEvent().synchronize()


# ----------------------------------------------------------------- the direct path


@pytest.mark.parametrize("make", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_the_direct_path_round_trips_a_step_batch_bit_exactly(make: Callable[[], KV]) -> None:
    kv = make()
    before = kv.snapshot()
    _, pool, engine, device = setup(kv, path="direct", row_programs=2)
    rng = np.random.default_rng(11)
    for g, layers in enumerate(kv.groups):
        src = [int(b) for b in rng.choice(NB, 7, replace=False)]
        rows = [int(r) for r in rng.choice(40, 7, replace=False)]
        dst = [int(b) for b in rng.permutation(src)]
        stores = [job(1, "store", src[:3], rows[:3], g), job(2, "store", src[3:], rows[3:], g)]
        ended_ok(engine.submit_batch(stores))
        loads = [job(3, "load", dst[:5], rows[:5], g), job(4, "load", dst[5:], rows[5:], g)]
        ended_ok(engine.submit_batch(loads))
        expect_moved(kv, before, src, dst, layers)
        before = kv.snapshot()
    stats = engine.statistics()
    # a batch is one piece: one upload, one launch, no DMA and no staging memory
    assert stats.pieces == stats.kernel_launches == stats.table_uploads == 2 * len(kv.groups)
    assert stats.dma_copies == device.memcpys == 0
    assert device.launch_programs == [2] * (2 * len(kv.groups))
    assert all(not lane.slots for lane in engine._lanes.values())


def test_the_direct_path_orders_a_batch_after_the_mark_and_ends_every_job_with_it() -> None:
    kv = per_layer_split_nhd()
    _, _, engine, device = setup(kv, path="direct", fire=False)
    compute = FakeStream(name="compute")
    with device.current(compute):
        mark = engine.capture_compute()
    a, b = engine.submit_batch(
        [job(1, "store", [0, 1], [0, 1]), job(2, "store", [2, 3], [5, 9])], mark
    )
    engine.wait_enqueued()
    [stream] = device.streams  # one stream per direction: no DMA stream
    assert stream.waited_events == [mark.event]
    [end] = [e for e in device.events if e.recorded_on is stream]
    assert not a.query() and not b.query()
    end.fire()
    assert a.query() and b.query() and a.exception() is None and b.exception() is None
    load = engine.submit(job(3, "load", [4], [0]), mark)
    engine.wait_enqueued()
    assert len(device.streams) == 2 and device.streams[1].waited_events == [mark.event]
    assert not load.query()


def test_the_direct_path_fails_a_batch_whose_launch_fails_only_after_what_it_enqueued() -> None:
    kv = per_layer_split_nhd()
    _, _, engine, device = setup(kv, path="direct", fire=False)

    def launch_fails(*args: object) -> None:
        raise RuntimeError("CUDA error: launch failed")

    device.copy_rows = launch_fails  # type: ignore[method-assign]
    first, second = engine.submit_batch([job(1, "store", [0], [0]), job(2, "store", [1], [1])])
    engine.wait_enqueued()
    assert not first.query() and not second.query()  # the upload may still run
    device.events[-1].fire()
    for c in (first, second):
        assert c.query() and "launch failed" in repr(c.exception())


def test_copies_are_staged_by_default_and_direct_only_where_the_device_reaches_the_pool() -> None:
    kv = per_layer_split_nhd()
    layout = describe_kv_caches(kv.tensors, kv.groups, NB)
    pool = HostPool(num_slots=4, blocks_per_chunk=1, row_bytes=layout.row_bytes)
    assert CudaCopyEngine(layout, pool, ops=FakeCudaDevice()).path == "staged"
    assert CudaCopyEngine(layout, pool, path="direct", ops=FakeCudaDevice()).path == "direct"
    unreachable = FakeCudaDevice(reach_host=False)
    with pytest.raises(ValueError, match="path='direct' needs a host pool the device can reach"):
        CudaCopyEngine(layout, pool, path="direct", ops=unreachable)
    with pytest.raises(ValueError, match="path must be"):
        CudaCopyEngine(layout, pool, path="auto", ops=unreachable)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="row_programs must be >= 1"):
        CudaCopyEngine(layout, pool, row_programs=0, ops=unreachable)


# ----------------------------------------------------------------- the issue thread


@pytest.mark.parametrize("issue", ["thread", "inline"])
def test_the_device_is_driven_from_the_issue_thread_alone(issue: IssueMode) -> None:
    kv = per_layer_split_nhd()
    _, _, engine, device = setup(kv, slot_rows=2, ring=2, issue=issue)
    threads: set[str] = set()
    for name in ("copy_rows", "upload", "memcpy_batch", "new_stream"):
        real = getattr(device, name)

        def logged(*args: Any, _real: Any = real) -> Any:
            threads.add(threading.current_thread().name)
            return _real(*args)

        setattr(device, name, logged)
    ended_ok(engine.submit_batch([job(1, "store", [0, 1, 2], [0, 1, 2])]))
    ended_ok([engine.submit(job(2, "load", [3, 4], [0, 1]))])
    if issue == "thread":
        [name] = threads
        assert name.startswith("kvferry-cuda-issue")
        assert device.bound_threads == [name]  # the issue thread made the device current
        assert engine.statistics().issue_cpu_s > 0
    else:
        assert threads == {threading.current_thread().name}
        assert device.bound_threads == []
    engine.close()


def hold_launches(device: FakeCudaDevice) -> threading.Event:
    """Every launch on ``device`` waits (in the thread that enqueues) until the returned
    event is set."""
    held = threading.Event()
    real = device.copy_rows

    def held_launch(*args: Any) -> None:
        held.wait()
        real(*args)

    device.copy_rows = held_launch  # type: ignore[method-assign]
    return held


@attrs.define(eq=False)
class _Watching(FakeStream):
    """A compute stream noting, at each wait, the stream its event was recorded on."""

    recorded_at_wait: list[object] = attrs.field(factory=list)

    def wait_event(self, event: Any) -> None:
        self.recorded_at_wait.append(event.recorded_on)
        super().wait_event(event)


def test_a_fence_waits_until_its_job_is_enqueued() -> None:
    kv = per_layer_split_nhd()
    _, _, engine, device = setup(kv, fire=False)
    compute = _Watching(name="compute")
    with device.current(compute):
        mark = engine.capture_compute()
    held = hold_launches(device)
    try:
        [completion] = engine.submit_batch([job(1, "store", [0, 1], [0, 1])], mark)
        assert isinstance(completion, DeviceFenced)
        fence = threading.Thread(target=completion.order_before_compute, args=(mark,))
        fence.start()
        fence.join(timeout=0.2)
        # still waiting for the issue thread (held in the launch), and nothing fenced
        # yet: a stream waiting on an event not yet recorded would wait for nothing
        assert fence.is_alive() and compute.recorded_at_wait == []
    finally:
        held.set()
    fence.join()
    dma = device.streams[1]  # the store lane's DMA stream: the job ends there
    assert compute.recorded_at_wait == [dma]  # the job's event, recorded before the wait
    assert not completion.query()  # the fence did not wait on the device
    engine.close()


def test_close_returns_once_what_was_handed_is_enqueued_and_takes_no_more() -> None:
    kv = per_layer_split_nhd()
    before = kv.snapshot()
    _, _, engine, device = setup(kv, slot_rows=1, ring=2)
    done = [engine.submit(job(i, "store", [i], [i])) for i in range(6)]
    engine.close()
    assert engine.statistics().pieces == 6
    ended_ok(done)
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(job(9, "load", [0], [0]))
    assert all(torch.equal(kv.block(n, b), before[n][b]) for n in kv.groups[0] for b in range(NB))


@attrs.define(eq=False)
class _Synced(FakeStream):
    """A stream counting the waits for all its work (``synchronize``)."""

    synchronized: int = 0

    def synchronize(self) -> None:
        self.synchronized += 1


class _SyncedDevice(FakeCudaDevice):
    def new_stream(self, direction: str) -> FakeStream:
        stream = _Synced(name=f"{direction}#{len(self.streams)}")
        self.streams.append(stream)
        return stream


def test_an_engine_dropped_without_close_enqueues_what_it_was_handed_then_goes() -> None:
    """The issue thread holds its engine only through the batches it has yet to enqueue:
    an engine dropped right after a submit still copies, and is then collected; its
    issue thread ends, after its lanes' streams' work (the staging memory goes then)."""
    kv = per_layer_split_nhd()
    layout = describe_kv_caches(kv.tensors, kv.groups, NB, kv.block_stride_bytes)
    pool = HostPool(num_slots=40, blocks_per_chunk=1, row_bytes=layout.row_bytes)
    device = _SyncedDevice()
    engine = CudaCopyEngine(layout, pool, staging_bytes=128 * pool.row_bytes, ops=device)
    held = hold_launches(device)
    first = engine.submit(job(1, "store", [0], [0]))  # the issue thread waits in its launch
    second = engine.submit(job(2, "store", [1], [1]))  # queued behind it
    collected = weakref.ref(engine)
    thread = engine._issuer
    assert thread is not None
    del engine
    gc.collect()
    assert collected() is not None  # its batches are not enqueued yet
    held.set()
    ended_ok([first, second])
    gc.collect()
    thread.join(timeout=30)
    assert collected() is None and not thread.is_alive()
    assert device.streams and all(s.synchronized for s in device.streams)  # type: ignore[attr-defined]


def test_a_defect_in_the_issue_thread_fails_its_jobs_after_what_was_enqueued() -> None:
    kv = per_layer_split_nhd()
    _, _, engine, device = setup(kv, fire=False)
    ended_ok_later = engine.submit(job(1, "store", [0], [0]))
    engine.wait_enqueued()

    def broken(*args: object) -> None:
        raise AssertionError("a defect")

    engine._enqueue = broken  # type: ignore[method-assign]
    failed = engine.submit(job(2, "load", [1], [1]))
    engine.wait_enqueued()
    assert not failed.query()  # ends after what the store lane holds
    for event in device.events:
        event.fire()
    assert ended_ok_later.query() and ended_ok_later.exception() is None
    assert failed.query() and "a defect" in repr(failed.exception())
    engine.close()


EXITING = """
import threading
from kvferry.testing import FakeCudaDevice
from kvferry.transfer import CopyJob, CudaCopyEngine, GroupBlocks, HostPool, describe_kv_caches
from tests.transfer.kvlayouts import NB, per_layer_split_nhd

kv = per_layer_split_nhd()
layout = describe_kv_caches(kv.tensors, kv.groups, NB)
pool = HostPool(num_slots=4, blocks_per_chunk=1, row_bytes=layout.row_bytes)
device = FakeCudaDevice()
entered, leave = threading.Event(), threading.Event()
real = device.copy_rows

def launch(*args):
    entered.set()
    leave.wait()
    real(*args)
    print("enqueued", flush=True)

device.copy_rows = launch
engine = CudaCopyEngine(layout, pool, ops=device)
part = GroupBlocks(group=0, device_blocks=[1], host_rows=[2])
engine.submit_batch([CopyJob(job_id=1, direction="store", parts=(part,))])
entered.wait()  # the issue thread is inside the launch
leave.set()  # and the interpreter exits now, the engine still open
"""


def test_an_interpreter_exiting_with_an_engine_open_lets_its_issue_thread_finish() -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", EXITING], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["enqueued"]
