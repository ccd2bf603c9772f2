"""Hybrid models at the scheduler: a full-attention group beside a sliding-window group.

A sliding-window group needs only its trailing window for a hit, loads only the blocks
vLLM allocated for it, and a store still reading a sliding-window block that vLLM hands
to another request is fenced. (tests/e2e/test_hybrid.py runs the same on real vLLM.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvferry import ConfigError
from kvferry.connector._geometry import windowed_hit

from ._steps import BLOCK, acked, allocated, key, request, scheduler_side, step, store_keys

WINDOW = 256  # the window spans 2 offloaded blocks
FULL, SLIDING = 0, 1
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def kv_cache_config(sliding_spec: Any = None) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    shape = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
    sliding = sliding_spec or SlidingWindowSpec(**shape, sliding_window=WINDOW)
    return KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([LAYERS[1]], FullAttentionSpec(**shape)),
            KVCacheGroupSpec([LAYERS[0]], sliding),
        ],
    )


@pytest.fixture
def scheduler(make_vllm_config: Any) -> Iterator[Any]:
    with scheduler_side(make_vllm_config, kv_cache_config()) as side:
        yield side


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        ([[1, 1], [1, 1], [1, 1]], 3),
        ([[1, 0], [1, 0], [1, 1], [1, 1]], 4),  # blocks before the window may be missing
        ([[1, 1], [1, 0], [1, 1]], 1),  # a hole inside every later window
        ([[1, 1], [0, 1], [1, 1]], 1),  # full attention stops at its first miss
        ([[1, 0], [1, 0], [1, 1]], 0),  # no window of 2 ends anywhere
        ([[1, 1], [1, 1], [1, 0], [1, 1], [1, 1]], 5),
        ([[1, 1], [1, 1], [1, 1], [1, 0], [1, 1]], 3),  # the last window with no hole
    ],
)
def test_windowed_hit(rows: list[list[int]], expected: int) -> None:
    assert windowed_hit(np.array(rows, dtype=bool), (None, 2)) == expected


def test_windowed_hit_without_a_full_attention_group() -> None:
    ready = np.array([[0], [1], [1]], dtype=bool)
    assert windowed_hit(ready, (2,)) == 3
    assert windowed_hit(ready[:2], (2,)) == 0
    assert windowed_hit(ready[1:2], (2,)) == 1  # the rest of its window is on the device


def test_sliding_window_group_hits_with_only_its_window(scheduler: Any) -> None:
    req = request("a", 1008)  # 7 offloaded blocks, the last 8 tokens in none
    scheduler.on_new_request(req)
    # Full attention: every block; the sliding window: only the last two.
    full = [key(req, c, FULL) for c in range(7)]
    store_keys(scheduler, full + [key(req, c, SLIDING) for c in (5, 6)])
    assert scheduler.get_num_new_matched_tokens(req, 0) == (7 * BLOCK, True)

    # vLLM allocates the window's blocks and pads the rest of the group with its null block.
    full_ids, sliding_ids = list(range(1, 8)), [0, 0, 0, 0, 0, 11, 12]
    scheduler.update_state_after_alloc(req, allocated(full_ids, sliding_ids), 7 * BLOCK)
    [load] = scheduler._pending_loads
    parts = {p.group: p for p in load.copy.parts}
    assert parts[FULL].device_blocks.tolist() == full_ids
    assert parts[SLIDING].device_blocks.tolist() == [11, 12]
    # Only the keys it loads are pinned: 7 + 2.
    assert len(scheduler._jobs[load.copy.job_id].slots) == 9
    assert scheduler.statistics().directory.pinned == 9


def test_a_hole_in_the_window_shortens_the_hit(scheduler: Any) -> None:
    req = request("a", 1008)
    scheduler.on_new_request(req)
    full = [key(req, c, FULL) for c in range(7)]
    store_keys(scheduler, full + [key(req, c, SLIDING) for c in (0, 1, 2, 3, 6)])
    # A hit of 7 needs sliding blocks 5 and 6; of 6, 4 and 5; of 5, 3 and 4; of 4, 2 and 3.
    assert scheduler.get_num_new_matched_tokens(req, 0) == (4 * BLOCK, True)


def test_the_last_prompt_token_is_recomputed(scheduler: Any) -> None:
    req = request("a", 7 * BLOCK)  # a prompt of exactly 7 offloaded blocks
    scheduler.on_new_request(req)
    store_keys(scheduler, [key(req, c, g) for c in range(7) for g in (FULL, SLIDING)])
    assert scheduler.get_num_new_matched_tokens(req, 0) == (6 * BLOCK, True)


def test_a_store_reading_a_reused_sliding_block_is_fenced(scheduler: Any) -> None:
    a = request("a", 4 * BLOCK + 8, seed=1)
    a_blocks = ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    scheduler.on_new_request(a)
    assert scheduler.get_num_new_matched_tokens(a, 0) == (0, False)
    meta = scheduler.build_connector_meta(step({"a": a_blocks}, {"a": a.num_tokens}))
    [store] = meta.stores
    parts = {p.group: p.device_blocks.tolist() for p in store.copy.parts}
    assert parts == {FULL: [1, 2, 3, 4], SLIDING: [6, 7, 8, 9]}
    assert meta.flush_job_ids == []

    # Next step: vLLM freed a's first sliding blocks; b gets fresh blocks -> no fence.
    b = request("b", 2 * BLOCK, seed=2)
    scheduler.on_new_request(b)
    a.num_computed_tokens = a.num_tokens
    meta = scheduler.build_connector_meta(step({"b": ([20, 21], [22, 23])}, {"a": 1, "b": 0}))
    assert meta.flush_job_ids == []
    # c gets block 7, which a's store still reads: the store is fenced before the forward.
    c = request("c", 2 * BLOCK, seed=3)
    scheduler.on_new_request(c)
    meta = scheduler.build_connector_meta(step({"c": ([30, 31], [7, 32])}, {"a": 1, "c": 0}))
    assert meta.flush_job_ids == [store.copy.job_id]
    assert scheduler.statistics().stores_fenced == 1

    # Once the store ended, reusing its blocks needs no fence.
    scheduler.update_connector_output(acked(store.copy.job_id))
    d = request("d", 2 * BLOCK, seed=4)
    scheduler.on_new_request(d)
    meta = scheduler.build_connector_meta(step({"d": ([8, 9], [6, 40])}, {"a": 1, "d": 0}))
    assert meta.flush_job_ids == []


def test_a_group_kvferry_cannot_offload_is_named(make_vllm_config: Any) -> None:
    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    from kvferry import FerryConfig
    from kvferry.connector._scheduler import SchedulerSide

    spec = ChunkedLocalAttentionSpec(
        block_size=BLOCK,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.bfloat16,
        attention_chunk_size=256,
    )
    extra = {"cpu_bytes_to_use": 64 << 20}
    with pytest.raises(ConfigError, match="group 1 is ChunkedLocalAttentionSpec"):
        SchedulerSide(make_vllm_config(extra), kv_cache_config(spec), FerryConfig.from_dict(extra))
