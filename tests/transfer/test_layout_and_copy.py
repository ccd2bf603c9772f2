"""KV layouts as byte runs, copy plans, and exact round trips through
every copy path (the batched kernels, the copy threads, the CUDA engine's logic on CPU
tensors) in every layout vLLM hands over."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvferry.testing import FakeCudaDevice
from kvferry.transfer import (
    CopyEngine,
    CopyJob,
    CudaCopyEngine,
    GroupBlocks,
    HostPool,
    KVBlockAccess,
    KVLayout,
    ThreadCopyEngine,
    copy_job,
    describe_kv_caches,
    layer_segments,
    new_copy_engine,
)
from kvferry.transfer._kernel import batch_kernel, jit_kernel
from kvferry.transfer._plan import plan_job, split_plan

from .kvlayouts import KV, LAYOUTS, NB, L, block_outermost, hnd_stored_nhd_viewed, vllm_cpu

ROWS = 12


def layout_of(kv: KV) -> KVLayout:
    return describe_kv_caches(kv.tensors, kv.groups, NB, kv.block_stride_bytes)


def job(job_id: int, direction: str, blocks: Any, rows: Any, group: int = 0) -> CopyJob:
    part = GroupBlocks(group=group, device_blocks=blocks, host_rows=rows)
    return CopyJob(job_id=job_id, direction=direction, parts=(part,))  # type: ignore[arg-type]


# ----------------------------------------------------------------- layouts


def test_joined_kv_is_one_segment_per_layer() -> None:
    t = vllm_cpu().tensors["l0"]
    segs = layer_segments(t, NB)
    assert len(segs) == 1 and segs[0].shape == (NB, t[0].numel() * 2)


def test_split_kv_is_two_segments_per_layer() -> None:
    t = LAYOUTS["per_layer_split_nhd"]().tensors["l0"]
    segs = layer_segments(t, NB)
    assert len(segs) == 2 and all(s.shape == (NB, t[0, 0].numel() * 4) for s in segs)


def test_a_permuted_view_of_a_dense_block_is_one_run() -> None:
    t = hnd_stored_nhd_viewed().tensors["l0"]
    assert len(layer_segments(t, NB)) == 1


def test_layers_sharing_an_allocation_are_one_region() -> None:
    group = layout_of(vllm_cpu()).groups[0]
    assert len(group.segments) == L
    (region,) = group.regions
    assert region.count == L and region.row_bytes == group.row_bytes


def test_block_outermost_is_one_run_per_block() -> None:
    group = layout_of(block_outermost()).groups[0]
    (region,) = group.regions
    assert region.count == 1 and region.nbytes == group.row_bytes == region.block_stride


def test_aliased_layers_are_kept_once() -> None:
    kv = vllm_cpu()
    kv.tensors["alias"] = kv.tensors["l0"]
    layout = describe_kv_caches(kv.tensors, [["l0", "alias"]], NB)
    assert len(layout.groups[0].segments) == 1


def test_a_tensor_without_a_block_dimension_is_refused() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        layer_segments(torch.zeros(3, 4), NB)


def test_a_broadcast_tensor_is_refused() -> None:
    with pytest.raises(ValueError, match="broadcast"):
        layer_segments(torch.zeros(NB, 1, 8).expand(NB, 4, 8), NB)


# ----------------------------------------------------------------- kernels and plans


@pytest.mark.parametrize(
    "kernel", ["jit", "jit-before", "jit-prefetch-1", "jit-prefetch-past-the-end", "memmove"]
)
def test_batch_kernel_copies_exactly_the_descriptors(kernel: str) -> None:
    if kernel.startswith("jit"):
        pytest.importorskip("llvmlite", reason="the JIT kernel needs llvmlite")
    ahead = {"jit-before": 0, "jit-prefetch-1": 1, "jit-prefetch-past-the-end": 1000}
    if kernel in ahead:
        pair_max_bytes = 0 if kernel == "jit-before" else 8192
        copy = jit_kernel(
            prefetch_ahead=ahead[kernel], prefetch_lines=3, pair_max_bytes=pair_max_bytes
        )
    else:
        _, copy = batch_kernel(kernel)
    rng = np.random.default_rng(0)
    src = torch.randint(
        0, 256, (1 << 21,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    dst = torch.zeros(1 << 21, dtype=torch.uint8)
    # Around every boundary of the kernel (streaming size, 64-byte lines, 8 KiB steps), then random.
    edges = [
        0,
        1,
        63,
        64,
        1023,
        1024,
        1025,
        4096,
        8191,
        8192,
        8192 + 64 + 63,
        16384,
        3 * 8192 + 100,
    ]
    sizes = np.concatenate((edges, rng.integers(0, 40_000, 40))).astype(np.int64)
    src_off = rng.integers(0, (1 << 20) - 40_000, len(sizes))
    dst_off = np.cumsum(np.concatenate(([5], sizes[:-1] + 3)))  # odd alignments, 3-byte gaps
    copy(
        (dst.data_ptr() + dst_off).astype(np.int64),
        (src.data_ptr() + src_off).astype(np.int64),
        sizes,
    )
    written = torch.zeros_like(dst, dtype=torch.bool)
    for d, s, n in zip(dst_off.tolist(), src_off.tolist(), sizes.tolist(), strict=True):
        assert torch.equal(dst[d : d + n], src[s : s + n])
        written[d : d + n] = True
    assert not dst[~written].any()


@pytest.mark.parametrize(("ahead", "pair_max_bytes"), [(0, 0), (0, 8192), (2, 8192), (2, 1 << 20)])
def test_jit_kernel_copies_runs_of_equal_aligned_descriptors_exactly(
    ahead: int, pair_max_bytes: int
) -> None:
    # Short descriptors of one size with 64-byte aligned destinations are copied two at
    # a time: runs of odd length, sizes around the limits of that path, and one
    # misaligned destination in the middle of a run.
    pytest.importorskip("llvmlite", reason="the JIT kernel needs llvmlite")
    copy = jit_kernel(prefetch_ahead=ahead, pair_max_bytes=pair_max_bytes)
    rng = np.random.default_rng(2)
    sizes = np.array(
        [256] * 5 + [512, 512] + [1024] * 3 + [2048, 2304] + [1280] * 4 + [7936] * 2 + [8192] * 3,
        dtype=np.int64,
    )
    src = torch.randint(
        0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2)
    )
    dst = torch.zeros(1 << 20, dtype=torch.uint8)
    base = -dst.data_ptr() % 64  # the first aligned offset
    dst_off = base + np.cumsum(np.concatenate(([0], sizes[:-1] + 64)))
    dst_off[14] += 8  # breaks the run of 1280s in two
    src_off = rng.integers(0, (1 << 19), len(sizes))  # unaligned sources
    copy(
        (dst.data_ptr() + dst_off).astype(np.int64),
        (src.data_ptr() + src_off).astype(np.int64),
        sizes,
    )
    written = torch.zeros_like(dst, dtype=torch.bool)
    for d, s, n in zip(dst_off.tolist(), src_off.tolist(), sizes.tolist(), strict=True):
        assert torch.equal(dst[d : d + n], src[s : s + n])
        written[d : d + n] = True
    assert not dst[~written].any()


def test_jit_kernel_refuses_a_negative_prefetch() -> None:
    pytest.importorskip("llvmlite", reason="the JIT kernel needs llvmlite")
    with pytest.raises(ValueError, match="prefetch_ahead"):
        jit_kernel(prefetch_ahead=-1)


def test_consecutive_blocks_of_a_block_outermost_layout_merge_into_one_copy() -> None:
    layout = layout_of(block_outermost())
    pool = HostPool(num_slots=ROWS, blocks_per_chunk=1, row_bytes=layout.row_bytes)
    plan = plan_job(
        layout, job(1, "store", [2, 3, 4, 5], [6, 7, 8, 9]), pool.rows.data_ptr(), layout.row_bytes
    )
    assert len(plan) == 1 and plan.nbytes == 4 * layout.row_bytes


def test_a_plan_splits_into_pieces_of_about_piece_bytes() -> None:
    layout = layout_of(block_outermost())
    pool = HostPool(num_slots=ROWS, blocks_per_chunk=1, row_bytes=layout.row_bytes)
    plan = plan_job(
        layout,
        job(1, "store", list(range(NB)), list(range(NB))),
        pool.rows.data_ptr(),
        layout.row_bytes,
    )
    pieces = split_plan(plan, 1000)
    assert sum(p.nbytes for p in pieces) == plan.nbytes
    assert all(p.nbytes <= 2000 for p in pieces) and len(pieces) >= plan.nbytes // 2000


# ----------------------------------------------------------------- round trips


def _fake_cuda(layout: KVLayout, pool: HostPool) -> CopyEngine:
    """The CUDA engine's logic on CPU tensors (the Triton kernel interpreted); a ring of
    two 1-row slots forces pieces and slot reuse."""
    return CudaCopyEngine(
        layout, pool, staging_bytes=2 * pool.row_bytes, ring_slots=2, ops=FakeCudaDevice()
    )


ENGINES: dict[str, Callable[[KVLayout, HostPool], CopyEngine | None]] = {
    "copy_job": lambda layout, pool: None,
    "threads": lambda layout, pool: ThreadCopyEngine(layout, pool, num_threads=2),
    "threads-memmove": lambda layout, pool: ThreadCopyEngine(layout, pool, kernel="memmove"),
    "threads-tiny-pieces": lambda layout, pool: ThreadCopyEngine(layout, pool, piece_bytes=100),
    "cuda-logic": _fake_cuda,
}


def run(engine: CopyEngine | None, layout: KVLayout, pool: HostPool, j: CopyJob) -> None:
    if engine is None:
        copy_job(layout, pool, j)
        return
    completion = engine.submit(j)
    completion.synchronize()
    assert completion.query() and completion.exception() is None


@pytest.fixture(params=list(ENGINES))
def engine_name(request: pytest.FixtureRequest) -> Iterator[str]:
    yield request.param


@pytest.mark.parametrize("make", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_store_then_load_round_trips_bit_exactly(make: Callable[[], KV], engine_name: str) -> None:
    kv = make()
    before = kv.snapshot()
    layout = layout_of(kv)
    pool = HostPool(num_slots=ROWS, blocks_per_chunk=1, row_bytes=layout.row_bytes)
    engine = ENGINES[engine_name](layout, pool)
    rng = np.random.default_rng(1)
    try:
        for g, layers in enumerate(kv.groups):
            src = rng.choice(NB, 5, replace=False)
            rows = rng.choice(ROWS, 5, replace=False)
            dst = rng.permutation(src)  # load into other blocks than it came from
            run(engine, layout, pool, job(1, "store", src, rows, group=g))
            run(engine, layout, pool, job(2, "load", dst, rows, group=g))
            for name in layers:
                for b in range(NB):
                    want = before[name][src[list(dst).index(b)]] if b in dst else before[name][b]
                    assert torch.equal(kv.block(name, b), want), (name, b)
                before[name] = [kv.block(name, b).clone() for b in range(NB)]
    finally:
        if engine is not None:
            engine.close()


@pytest.mark.parametrize("make", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_every_path_writes_the_same_host_rows(make: Callable[[], KV]) -> None:
    kv = make()
    layout = layout_of(kv)
    blocks = [7, 1, 4]
    rows_seen = []
    for name in ("copy_job", "threads", "cuda-logic"):
        pool = HostPool(num_slots=ROWS, blocks_per_chunk=1, row_bytes=layout.row_bytes)
        engine = ENGINES[name](layout, pool)
        run(engine, layout, pool, job(1, "store", blocks, [0, 1, 2]))
        if engine is not None:
            engine.close()
        rows_seen.append(pool.rows[:3, : layout.groups[0].row_bytes].clone())
    rows_seen.append(KVBlockAccess(layout).read_blocks(blocks))
    for other in rows_seen[1:]:
        assert torch.equal(rows_seen[0], other)


@pytest.mark.parametrize("make", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_raw_block_access_round_trips_exactly(make: Callable[[], KV]) -> None:
    kv = make()
    before = kv.snapshot()
    access = KVBlockAccess(layout_of(kv))
    data = access.read_blocks([2, 5])
    assert data.shape == (2, access.row_bytes) and data.dtype == torch.uint8
    access.write_blocks([8, 0], data)
    for name in kv.groups[0]:
        assert torch.equal(kv.block(name, 8), before[name][2])
        assert torch.equal(kv.block(name, 0), before[name][5])
        assert torch.equal(kv.block(name, 3), before[name][3])


def test_raw_write_refuses_rows_of_the_wrong_shape() -> None:
    access = KVBlockAccess(layout_of(vllm_cpu()))
    with pytest.raises(ValueError, match="uint8 of shape"):
        access.write_blocks([1], torch.zeros(1, access.row_bytes + 1, dtype=torch.uint8))


def test_copy_job_refuses_rows_outside_the_pool_before_copying() -> None:
    layout = layout_of(vllm_cpu())
    pool = HostPool(num_slots=2, blocks_per_chunk=1, row_bytes=layout.row_bytes)
    with pytest.raises(IndexError, match="host rows"):
        copy_job(layout, pool, job(1, "store", [0, 1], [1, 2]))
    assert not pool.rows.any()


def test_raw_access_to_a_group_that_does_not_exist_is_refused() -> None:
    with pytest.raises(IndexError, match="no KV-cache group"):
        KVBlockAccess(layout_of(vllm_cpu()), group=3)


@pytest.mark.parametrize("threads", [-1, 0, True])
def test_a_cpu_engine_without_a_copy_thread_is_refused(threads: int) -> None:
    # No copy thread would ever end a submitted job; 0 is refused rather than read as
    # "the default" (None says that).
    layout = layout_of(vllm_cpu())
    pool = HostPool(num_slots=2, blocks_per_chunk=1, row_bytes=layout.row_bytes)
    with pytest.raises(ValueError, match="num_threads must be a whole number >= 1"):
        new_copy_engine(layout, pool, num_threads=threads)


def test_new_copy_engine_passes_its_tuning_to_the_cpu_engine() -> None:
    layout = layout_of(vllm_cpu())
    pool = HostPool(num_slots=2, blocks_per_chunk=1, row_bytes=layout.row_bytes)
    engine = new_copy_engine(layout, pool, num_threads=3, piece_bytes=1 << 16)
    try:
        assert isinstance(engine, ThreadCopyEngine)
        assert (engine.num_threads, engine.piece_bytes) == (3, 1 << 16)
        assert engine.kernel_name == batch_kernel()[0]
    finally:
        engine.close()
