"""Hybrid models at the scheduler: a full-attention group beside a sliding-window group.

A sliding-window group needs only its trailing window for a hit, loads only the blocks
vLLM allocated for it, and a store still reading a sliding-window block that vLLM hands
to another request is fenced. (tests/e2e/test_hybrid.py runs the same on real vLLM.)
"""

from __future__ import annotations

import logging
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


def _prefill_stored(scheduler: Any) -> tuple[Any, Any]:
    """Request a's prompt computed in one step, its store planned: sliding blocks 6-9."""
    a = request("a", 4 * BLOCK + 8, seed=1)
    scheduler.on_new_request(a)
    assert scheduler.get_num_new_matched_tokens(a, 0) == (0, False)
    meta = scheduler.build_connector_meta(
        step({"a": ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])}, {"a": a.num_tokens})
    )
    [store] = meta.stores
    return a, store


def test_a_sliding_block_handed_to_a_load_fences_the_store_reading_it(scheduler: Any) -> None:
    """A request whose hit loads asynchronously is in none of the step's scheduled lists:
    the blocks vLLM allocated for its load (update_state_after_alloc) are checked against
    the fences too."""
    a, store = _prefill_stored(scheduler)
    a.num_computed_tokens = a.num_tokens

    # vLLM freed a's first sliding blocks; c has a hit and is given block 7 for its load.
    c = request("c", 3 * BLOCK + 8, seed=3)
    store_keys(scheduler, [key(c, ch, g) for ch in range(3) for g in (FULL, SLIDING)])
    scheduler.on_new_request(c)
    assert scheduler.get_num_new_matched_tokens(c, 0) == (3 * BLOCK, True)
    scheduler.update_state_after_alloc(c, allocated([30, 31, 32], [0, 7, 33]), 3 * BLOCK)
    meta = scheduler.build_connector_meta(step({}, {"a": 1}))
    [load] = meta.loads
    assert 7 in {b for p in load.copy.parts for b in p.device_blocks.tolist()}
    assert meta.flush_job_ids == [store.copy.job_id]
    # Once the step is built, that allocation is not counted again.
    assert scheduler.build_connector_meta(step({}, {"a": 1})).flush_job_ids == []


def test_a_reset_does_not_store_sliding_blocks_the_request_passed(scheduler: Any) -> None:
    """After a reset, a running request's chunks are offered for store again from the
    first; its sliding-window blocks of the chunks it passed may be another request's by
    now (vLLM freed them out of the window): they are not read, the full-attention group's
    blocks are stored again."""
    a, store = _prefill_stored(scheduler)
    scheduler.update_connector_output(acked(store.copy.job_id))
    a.num_computed_tokens = a.num_tokens
    # vLLM freed a's sliding blocks 6 and 7 (out of its window); c is given block 7.
    c = request("c", 2 * BLOCK, seed=3)
    scheduler.on_new_request(c)
    scheduler.build_connector_meta(step({"c": ([30, 31], [7, 32])}, {"a": 1, "c": 0}))
    a.num_computed_tokens += 1

    assert scheduler.reset()
    meta = scheduler.build_connector_meta(step({}, {"a": 1}))
    parts = {
        p.group: p.device_blocks.tolist()
        for s in meta.stores
        if s.req_id == "a"
        for p in s.copy.parts
    }
    assert parts == {FULL: [1, 2, 3, 4]}


@pytest.mark.parametrize("store_decoded", [True, False])
def test_an_rswa_model_stores_its_prompt_blocks_only(
    make_vllm_config: Any, caplog: pytest.LogCaptureFixture, store_decoded: bool
) -> None:
    """R-SWA (vLLM's RSWASpec, full attention to the planner) frees a running request's
    decoded blocks between its prompt and its window: a store of decoded blocks could read
    blocks handed to another request, so only prompt blocks are stored, and a
    ``store_decoded: true`` that is not followed is logged."""
    import torch
    from vllm.v1.kv_cache_interface import RSWASpec

    spec = RSWASpec(
        block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, rswa_window=WINDOW
    )
    caplog.set_level(logging.WARNING, logger="kvferry.connector")
    with scheduler_side(
        make_vllm_config, kv_cache_config(spec), store_decoded=store_decoded
    ) as side:
        a = request("a", 2 * BLOCK + 8)  # a prompt of 2 full blocks and 8 tokens
        side.on_new_request(a)
        assert side.get_num_new_matched_tokens(a, 0) == (0, False)
        new = step({"a": ([1, 2, 3], [4, 5, 6])}, {"a": a.num_tokens})
        [store] = side.build_connector_meta(new).stores
        assert {p.group: p.device_blocks.tolist() for p in store.copy.parts} == {
            FULL: [1, 2],
            SLIDING: [4, 5],
        }
        # Decoding filled the third block: it has a hash, and its last token runs now.
        a.num_computed_tokens, a.num_tokens = 3 * BLOCK - 1, 3 * BLOCK
        a.block_hashes.append(b"decoded-block-hash".ljust(32, b"."))
        assert side.build_connector_meta(step({}, {"a": 1})).stores == []
    warned = [r for r in caplog.records if getattr(r, "kvferry_event", None) == "store_decoded_off"]
    assert len(warned) == (1 if store_decoded else 0)


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
