"""The book of planned stores: what a complete BlockStored needs per offload key, kept
from store planning until the store's event is converted, in bounded memory."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvferry.cache import AllBlocksCleared, BlocksRemoved, BlocksStored, to_vllm_events
from kvferry.connector._blockinfo import BlockBook, GroupSpec, group_specs

CHUNK, HPC = 4, 2  # 4 tokens a chunk, 2 hash blocks of 2 tokens each


def fake_request(n_chunks: int, *, seed: int = 0, lora: Any = None) -> Any:
    """What the book reads of vLLM's Request: hashes (one per hash block), tokens, LoRA."""
    return SimpleNamespace(
        block_hashes=[bytes([seed, i]) * 16 for i in range(n_chunks * HPC)],
        all_token_ids=[1000 * seed + t for t in range(n_chunks * CHUNK + 3)],  # + a partial
        lora_request=lora,
    )


def key(request: Any, chunk: int, group: int = 0) -> bytes:
    """The scheduler's key: the hash at the chunk's last hash block, then the group."""
    return bytes(request.block_hashes[(chunk + 1) * HPC - 1]) + group.to_bytes(4, "big")


def book(**kw: Any) -> BlockBook:
    return BlockBook(chunk_tokens=CHUNK, hashes_per_chunk=HPC, **kw)


def test_a_recorded_chunk_is_described_completely() -> None:
    req = fake_request(3)
    b = book(
        groups=[
            GroupSpec(kind="full_attention"),
            GroupSpec(kind="sliding_window", sliding_window=8),
        ]
    )
    b.record_chunks(req, 0, 3)
    first, second = b.describe(key(req, 0)), b.describe(key(req, 1, group=1))
    assert first is not None and second is not None
    assert first.block_hash == key(req, 0)[:-4] and first.parent_block_hash is None
    assert list(first.token_ids) == [0, 1, 2, 3] and first.block_size == CHUNK
    assert (first.group_idx, first.kv_cache_spec_kind) == (0, "full_attention")
    # The parent is the previous chunk's key hash: the hash at its last hash block.
    assert second.parent_block_hash == key(req, 0)[:-4]
    assert list(second.token_ids) == [4, 5, 6, 7]
    assert (second.group_idx, second.kv_cache_spec_kind) == (1, "sliding_window")
    assert second.kv_cache_spec_sliding_window == 8
    assert first.lora_id is None and first.lora_name is None
    assert len(b) == 3  # one entry per chunk, whatever the number of groups


def test_a_request_with_lora_gives_its_id_and_name() -> None:
    req = fake_request(1, lora=SimpleNamespace(adapter_id=7, name="sql"))
    b = book()
    b.record_chunks(req, 0, 1)
    info = b.describe(key(req, 0))
    assert info is not None and (info.lora_id, info.lora_name) == (7, "sql")


def test_an_unknown_key_is_described_as_none_and_counted() -> None:
    b = book()
    assert b.describe(b"\x09" * 32 + bytes(4)) is None
    assert b.statistics().keys_without_info == 1


def test_a_retired_chunk_stays_until_the_next_conversion() -> None:
    req = fake_request(2)
    b = book()
    b.record_chunks(req, 0, 2)
    b.retire([key(req, 0)])
    assert b.describe(key(req, 0)) is not None  # its event is not converted yet
    b.drop_retired()
    assert b.describe(key(req, 0)) is None and b.describe(key(req, 1)) is not None
    assert len(b) == 1


def test_a_chunk_leaves_when_the_keys_of_every_group_retired() -> None:
    req = fake_request(1)
    b = book(groups=[GroupSpec(), GroupSpec()])
    b.record_chunks(req, 0, 1)
    b.retire([key(req, 0, group=0)])
    b.drop_retired()
    assert len(b) == 1  # group 1's store still runs
    b.retire([key(req, 0, group=1)])
    b.drop_retired()
    assert len(b) == 0


def test_a_chunk_two_stores_planned_stays_until_both_retired() -> None:
    a, again = fake_request(1), fake_request(1)  # two requests with the same prefix
    b = book()
    b.record_chunks(a, 0, 1)
    b.record_chunks(again, 0, 1)
    b.retire([key(a, 0)])
    b.drop_retired()
    assert b.describe(key(a, 0)) is not None
    b.retire([key(a, 0)])
    b.retire([key(a, 0)])  # one too many: ignored
    b.drop_retired()
    assert len(b) == 0


def test_a_chunk_recorded_again_after_retiring_is_kept() -> None:
    req = fake_request(1)
    b = book()
    b.record_chunks(req, 0, 1)
    b.retire([key(req, 0)])
    b.record_chunks(req, 0, 1)
    b.drop_retired()
    assert b.describe(key(req, 0)) is not None


def test_the_cap_drops_the_oldest_record_and_counts_it() -> None:
    req = fake_request(4)
    b = book(max_entries=2)
    b.record_chunks(req, 0, 2)
    b.record_chunks(req, 0, 1)  # chunk 0 recorded again: now the newest
    b.record_chunks(req, 2, 4)
    assert len(b) == 2 and b.statistics().entries_evicted == 2
    assert [b.describe(key(req, c)) is not None for c in range(4)] == [False, False, True, True]
    b.retire([key(req, 0)])  # an evicted entry's store ending is harmless
    assert b.statistics().keys_without_info == 2


def test_memory_holds_only_stores_in_flight() -> None:
    """Many requests' stores, each retired when its job ends and converted each step:
    the book never holds more than the stores in flight plus one step's ended ones."""
    b = book(max_entries=1_000)
    in_flight: list[list[bytes]] = []
    high = 0
    for step in range(200):
        req = fake_request(3, seed=step % 256)
        b.record_chunks(req, 0, 3)
        in_flight.append([key(req, c) for c in range(3)])
        if len(in_flight) > 4:  # the oldest job ends
            b.retire(in_flight.pop(0))
        high = max(high, len(b))
        b.drop_retired()
    assert high <= 3 * 5 and b.statistics().entries_evicted == 0
    for keys in in_flight:
        b.retire(keys)
    b.drop_retired()
    assert len(b) == 0


def test_events_of_stores_retired_before_the_conversion_are_complete() -> None:
    """The scheduler's order: the store ends (CompleteStore, then retire), the step's
    events are taken and converted, then the retired entries are dropped."""
    pytest.importorskip("vllm")
    from vllm.distributed.kv_events import BlockStored

    req = fake_request(2)
    b = book()
    b.record_chunks(req, 0, 2)
    keys = [key(req, 0), key(req, 1)]
    b.retire(keys)  # the job ended; its event waits in the directory
    [event] = to_vllm_events([BlocksStored(keys=keys)], describe=b.describe)
    b.drop_retired()
    assert isinstance(event, BlockStored)
    assert event.token_ids == list(range(2 * CHUNK)) and event.block_size == CHUNK
    assert event.parent_block_hash is None and len(event.block_hashes) == 2
    assert len(b) == 0 and b.statistics().keys_without_info == 0
    # Events that came later (an eviction, a clear) need no entry.
    later = to_vllm_events([BlocksRemoved(keys=keys), AllBlocksCleared()], describe=b.describe)
    assert len(later) == 2 and b.statistics().keys_without_info == 0


def test_group_specs_are_vllms() -> None:
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    shape = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
    config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["a"], FullAttentionSpec(**shape)),
            KVCacheGroupSpec(["b"], SlidingWindowSpec(**shape, sliding_window=64)),
        ],
    )
    assert group_specs(config) == (
        GroupSpec(kind="full_attention", sliding_window=None),
        GroupSpec(kind="sliding_window", sliding_window=64),
    )


def test_chunks_beyond_what_the_request_holds_are_not_recorded_and_counted() -> None:
    b = book()
    r = fake_request(2)
    b.record_chunks(r, 0, 4)  # a bug in the plan: the request holds 2 chunks
    assert b.chunks_without_facts == 2 and len(b) == 2
    assert b.describe(key(r, 1)) is not None


def test_a_book_without_groups_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="BlockBook needs"):
        BlockBook(chunk_tokens=128, hashes_per_chunk=1, groups=())
