"""The job planner (connector/_planner.py): block ids, chunks and host slots -> the rows of
the copy jobs, driven with plain values (no scheduler, no vLLM objects)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from kvferry.connector._geometry import Geometry
from kvferry.connector._planner import (
    failed_load_parts,
    load_parts,
    plan_load,
    plan_store,
    storable_chunks,
)
from kvferry.transfer import GroupBlocks

BLOCK = 16


def geometry(*, blocks_per_chunk: int = 1, windows: tuple[int | None, ...] = (None,)) -> Geometry:
    return Geometry(
        engine_block_size=BLOCK,
        blocks_per_chunk=blocks_per_chunk,
        hashes_per_chunk=blocks_per_chunk,
        num_groups=len(windows),
        windows=windows,
        row_bytes=1024,
        num_slots=64,
    )


def slots(*rows: Sequence[int]) -> np.ndarray:
    """PrepareStore's answer as (chunks, groups)."""
    return np.array(rows, dtype=np.int64).reshape(len(rows), -1)


def keys(chunks: int, groups: int = 1, first: int = 0) -> list[bytes]:
    return [f"c{c}g{g}".encode() for c in range(first, first + chunks) for g in range(groups)]


def pairs(part: GroupBlocks) -> list[tuple[int, int]]:
    return list(zip(part.device_blocks.tolist(), part.host_rows.tolist(), strict=True))


# -- stores ------------------------------------------------------------------------------


def test_a_store_pairs_each_engine_block_with_a_row_of_its_chunks_slot() -> None:
    plan = plan_store(geometry(blocks_per_chunk=2), 0, [[5, 6, 7, 8]], slots([3], [1]), keys(2))
    (part,) = plan.parts
    assert part.group == 0
    assert pairs(part) == [(5, 6), (6, 7), (7, 2), (8, 3)]
    assert plan.slots.tolist() == [3, 1]
    assert plan.keys == (b"c0g0", b"c1g0")


def test_a_store_starts_at_its_first_chunk() -> None:
    plan = plan_store(geometry(blocks_per_chunk=2), 1, [[5, 6, 7, 8]], slots([4]), keys(1, first=1))
    assert pairs(plan.parts[0]) == [(7, 8), (8, 9)]
    assert plan.keys == (b"c1g0",)


def test_a_store_leaves_out_the_chunks_given_no_slot() -> None:
    plan = plan_store(geometry(), 0, [[5, 6, 7]], slots([2], [-1], [4]), keys(3))
    assert pairs(plan.parts[0]) == [(5, 2), (7, 4)]
    assert plan.slots.tolist() == [2, 4]
    assert plan.keys == (b"c0g0", b"c2g0")
    assert plan.dead == []


def test_a_store_of_which_no_chunk_got_a_slot_has_no_part() -> None:
    plan = plan_store(geometry(), 0, [[5, 6]], slots([-1], [-1]), keys(2))
    assert plan.parts == ()
    assert len(plan.slots) == 0
    assert plan.tokens == 0


def test_a_store_of_several_groups_has_a_part_per_group_and_its_slots_group_by_group() -> None:
    geo = geometry(windows=(None, None))
    plan = plan_store(geo, 0, [[5, 6], [9, 10]], slots([1, 2], [3, 4]), keys(2, groups=2))
    assert [p.group for p in plan.parts] == [0, 1]
    assert pairs(plan.parts[0]) == [(5, 1), (6, 3)]
    assert pairs(plan.parts[1]) == [(9, 2), (10, 4)]
    assert plan.slots.tolist() == [1, 3, 2, 4]
    assert plan.keys == (b"c0g0", b"c1g0", b"c0g1", b"c1g1")


def test_a_group_with_no_chunk_to_store_has_no_part() -> None:
    geo = geometry(windows=(None, None))
    plan = plan_store(geo, 0, [[5], [9]], slots([-1, 2]), keys(1, groups=2))
    assert [p.group for p in plan.parts] == [1]


def test_a_chunk_holding_a_null_block_is_not_stored_and_its_slot_is_given_back() -> None:
    geo = geometry(blocks_per_chunk=2, windows=(None, 1))
    block_ids = [[5, 6, 7, 8], [0, 0, 11, 12]]  # group 1's first chunk is outside its window
    plan = plan_store(geo, 0, block_ids, slots([1, 2], [3, 4]), keys(2, groups=2))
    assert plan.dead == [2]
    assert pairs(plan.parts[1]) == [(11, 8), (12, 9)]
    assert plan.keys == (b"c0g0", b"c1g0", b"c1g1")
    assert plan.slots.tolist() == [1, 3, 4]


def test_a_chunk_holding_one_null_block_among_others_is_not_stored() -> None:
    geo = geometry(blocks_per_chunk=2, windows=(1,))
    plan = plan_store(geo, 0, [[0, 6]], slots([3]), keys(1))
    assert plan.parts == ()
    assert plan.dead == [3]


def test_a_store_fences_the_sliding_window_blocks_it_reads_only() -> None:
    geo = geometry(windows=(None, 2))
    plan = plan_store(geo, 0, [[5, 6], [9, 10]], slots([1, 2], [3, 4]), keys(2, groups=2))
    assert plan.fenced == (9, 10)


def test_a_store_counts_the_tokens_of_its_chunks_once_over_the_groups() -> None:
    geo = geometry(blocks_per_chunk=2, windows=(None, None))
    plan = plan_store(geo, 0, [[5, 6, 7, 8], [9, 10, 11, 12]], slots([1, 2], [3, -1]), keys(2, 2))
    assert plan.tokens == 3 * 2 * BLOCK // 2


CHUNK = 2 * BLOCK


@pytest.mark.parametrize(
    ("computed", "keyed", "allocated", "expected"),
    [
        (10 * CHUNK, 3, 20, 3),  # block hashes known for 3 chunks only
        (3 * CHUNK + 5, 9, 20, 3),  # the 4th chunk is not all computed yet
        (10 * CHUNK, 9, 5, 2),  # 5 blocks allocated: 2 whole chunks
    ],
)
def test_storable_chunks_are_computed_keyed_and_allocated(
    computed: int, keyed: int, allocated: int, expected: int
) -> None:
    geo = geometry(blocks_per_chunk=2)
    assert storable_chunks(geo, computed, keyed, [list(range(1, allocated + 1))]) == expected


def test_storable_chunks_count_the_group_with_the_fewest_blocks() -> None:
    geo = geometry(windows=(None, None))
    assert storable_chunks(geo, 10 * BLOCK, 10, [[1, 2, 3, 4], [5, 6]]) == 2


# -- loads -------------------------------------------------------------------------------


def test_a_load_pairs_each_engine_block_with_a_row_of_its_chunks_slot() -> None:
    geo = geometry(blocks_per_chunk=2)
    plan = plan_load(geo, [[5, 6, 7, 8]], 0, 2)
    (part,) = load_parts(geo, plan, np.array([3, 1]))
    assert pairs(part) == [(5, 6), (6, 7), (7, 2), (8, 3)]


def test_a_load_may_start_mid_chunk() -> None:
    geo = geometry(blocks_per_chunk=4)
    plan = plan_load(geo, [[5, 6, 7, 8]], BLOCK, 1)  # the engine holds the first block
    assert plan.first_chunk == 0
    assert plan.wanted.shape == (1, 1)
    (part,) = load_parts(geo, plan, np.array([2]))
    assert pairs(part) == [(6, 9), (7, 10), (8, 11)]


def test_a_load_after_chunks_the_engine_holds_starts_at_the_next_chunk() -> None:
    geo = geometry(blocks_per_chunk=2)
    plan = plan_load(geo, [[5, 6, 7, 8, 9, 10]], 2 * 2 * BLOCK, 3)
    assert plan.first_chunk == 2
    (part,) = load_parts(geo, plan, np.array([7]))
    assert pairs(part) == [(9, 14), (10, 15)]


def test_a_load_of_several_groups_pairs_each_with_its_own_slots() -> None:
    geo = geometry(windows=(None, None))
    plan = plan_load(geo, [[5, 6], [9, 10]], 0, 2)
    parts = load_parts(geo, plan, np.array([1, 2, 3, 4]))  # (chunk, group) in order
    assert [pairs(p) for p in parts] == [[(5, 1), (6, 3)], [(9, 2), (10, 4)]]


def test_a_sliding_window_group_loads_only_the_chunks_vllm_allocated() -> None:
    geo = geometry(windows=(None, 1))
    plan = plan_load(geo, [[5, 6, 7], [0, 0, 11]], 0, 3)
    assert plan.wanted.tolist() == [[True, False], [True, False], [True, True]]
    assert plan.wanted_keys(keys(3, groups=2)) == [b"c0g0", b"c1g0", b"c2g0", b"c2g1"]
    parts = load_parts(geo, plan, np.array([1, 2, 3, 4]))
    assert [pairs(p) for p in parts] == [[(5, 1), (6, 2), (7, 3)], [(11, 4)]]


def test_a_sliding_window_chunk_with_one_block_allocated_is_loaded_for_that_block() -> None:
    geo = geometry(blocks_per_chunk=2, windows=(1,))
    plan = plan_load(geo, [[0, 0, 0, 8]], 0, 2)
    assert plan.wanted.tolist() == [[False], [True]]
    (part,) = load_parts(geo, plan, np.array([5]))
    assert pairs(part) == [(8, 11)]


def test_a_failed_load_names_every_allocated_block_but_the_null_ones_with_no_host_row() -> None:
    parts = failed_load_parts(([5, 6], [0, 9]))
    assert [(p.group, pairs(p)) for p in parts] == [
        (0, [(5, -1), (6, -1)]),
        (1, [(9, -1)]),
    ]


def test_a_failed_load_leaves_out_a_group_of_null_blocks_only() -> None:
    assert [p.group for p in failed_load_parts(([5], [0, 0]))] == [0]


# -- against a block-by-block reference ----------------------------------------------------


def random_request(
    rng: np.random.Generator,
) -> tuple[Geometry, list[list[int]], int, int]:
    """A geometry (1-3 groups, 1, 2 or 4 blocks a chunk, some groups sliding-window) and a
    request's block ids: a windowed group's leading blocks are vLLM's null block."""
    bpc = int(rng.choice([1, 2, 4]))
    windows = tuple(
        None if rng.random() < 0.6 else int(rng.integers(1, 4))
        for _ in range(int(rng.integers(1, 4)))
    )
    geo = geometry(blocks_per_chunk=bpc, windows=windows)
    chunks = int(rng.integers(1, 12))
    ids = []
    for w in windows:
        blocks = (rng.permutation(500)[: chunks * bpc] + 1).tolist()
        if w is not None:
            nulls = int(rng.integers(0, chunks * bpc + 1))
            blocks[:nulls] = [0] * nulls
        ids.append(blocks)
    first = int(rng.integers(0, chunks))
    return geo, ids, first, chunks


@pytest.mark.parametrize("seed", range(200))
def test_a_store_plan_equals_the_block_by_block_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    geo, ids, first, chunks = random_request(rng)
    G, bpc = geo.num_groups, geo.blocks_per_chunk
    n = chunks - first
    answer = rng.permutation(64)[: n * G].astype(np.int64)
    answer[rng.random(n * G) < 0.3] = -1  # present, not admitted, no room
    table = answer.reshape(n, G)
    names = keys(n, G, first)
    plan = plan_store(geo, first, ids, table, names)
    # The reference: each (chunk, group) given a slot, group by group, chunks in order.
    want_pairs: dict[int, list[tuple[int, int]]] = {}
    live, live_keys, dead, fenced = [], [], [], []
    for g in range(G):
        for i in range(n):
            slot = int(table[i, g])
            if slot < 0:
                continue
            blocks = ids[g][(first + i) * bpc : (first + i + 1) * bpc]
            if 0 in blocks:
                dead.append(slot)
                continue
            want_pairs.setdefault(g, []).extend((b, slot * bpc + j) for j, b in enumerate(blocks))
            live.append(slot)
            live_keys.append(names[i * G + g])
            if geo.windows[g] is not None:
                fenced.extend(blocks)
    assert {p.group: pairs(p) for p in plan.parts} == want_pairs
    assert [p.group for p in plan.parts] == sorted(want_pairs)
    assert plan.slots.tolist() == live
    assert plan.keys == tuple(live_keys)
    assert plan.dead == dead
    assert plan.fenced == tuple(fenced)
    assert plan.tokens == len(live) * geo.chunk_tokens // G


@pytest.mark.parametrize("seed", range(200))
def test_a_load_plan_equals_the_block_by_block_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    geo, ids, _, chunks = random_request(rng)
    G, bpc = geo.num_groups, geo.blocks_per_chunk
    first_blk = int(rng.integers(0, chunks * bpc))  # the engine holds the blocks before
    plan = plan_load(geo, ids, first_blk * BLOCK, chunks)
    first_chunk = first_blk // bpc
    # The reference: a (chunk, group) is wanted when one of its loaded blocks is not null.
    wanted = [
        (c, g)
        for c in range(first_chunk, chunks)
        for g in range(G)
        if any(ids[g][b] for b in range(max(c * bpc, first_blk), (c + 1) * bpc))
        or geo.windows[g] is None
    ]
    assert plan.wanted_keys(keys(chunks - first_chunk, G, first_chunk)) == [
        f"c{c}g{g}".encode() for c, g in wanted
    ]
    slot_of = {cg: 100 + i for i, cg in enumerate(wanted)}
    parts = load_parts(geo, plan, np.array([slot_of[cg] for cg in wanted], np.int64))
    want = {
        g: [
            (ids[g][b], slot_of[(b // bpc, g)] * bpc + b % bpc)
            for b in range(first_blk, chunks * bpc)
            if ids[g][b] or geo.windows[g] is None
        ]
        for g in range(G)
    }
    assert {p.group: pairs(p) for p in parts} == want
