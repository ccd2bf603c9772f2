"""KV events: batching per step, replay, and vLLM's types."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from kvferry.cache import AllBlocksCleared, BlocksRemoved, BlocksStored, EventBuffer, replay
from kvferry.cache._testing import key as k


def test_consecutive_events_of_one_kind_merge() -> None:
    buf = EventBuffer()
    buf.extend([BlocksStored(keys=[k(1)]), BlocksStored(keys=[k(2)]), BlocksRemoved(keys=[k(1)])])
    assert buf.take() == [BlocksStored(keys=[k(1), k(2)]), BlocksRemoved(keys=[k(1)])]
    assert buf.take() == []


def test_a_clear_makes_the_earlier_events_of_the_batch_moot() -> None:
    buf = EventBuffer()
    buf.extend([BlocksStored(keys=[k(1)]), AllBlocksCleared(), BlocksStored(keys=[k(2)])])
    events = buf.take()
    assert events == [AllBlocksCleared(), BlocksStored(keys=[k(2)])]
    assert replay(events, {k(7)}) == {k(2)}


def test_an_overflowing_buffer_collapses_to_a_clear_and_counts_the_drop() -> None:
    buf = EventBuffer(max_keys=2)
    buf.extend([BlocksStored(keys=[k(1), k(2)]), BlocksStored(keys=[k(3)])])
    assert buf.take() == [AllBlocksCleared()]
    assert buf.keys_dropped == 3 and buf.overflows == 1


def test_replay_applies_events_in_order() -> None:
    stored, removed = BlocksStored(keys=[k(1), k(2)]), BlocksRemoved(keys=[k(1)])
    events = [stored, removed, BlocksStored(keys=[k(1)])]
    assert replay(events) == {k(1), k(2)}


def test_conversion_to_vllm_events() -> None:
    pytest.importorskip("vllm")
    from vllm.distributed.kv_events import AllBlocksCleared as VCleared
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    from kvferry.cache import to_vllm_events

    h1, h2 = b"\x01" * 32, b"\x02" * 32
    x1, x2 = (maybe_convert_block_hash(BlockHash(h)) for h in (h1, h2))  # as vLLM publishes
    out = to_vllm_events(
        [
            BlocksStored(keys=[h1 + (0).to_bytes(4, "big"), h2 + (1).to_bytes(4, "big")]),
            BlocksRemoved(keys=[h1 + (0).to_bytes(4, "big"), h2 + (1).to_bytes(4, "big")]),
            AllBlocksCleared(),
        ]
    )
    stored = [e for e in out if isinstance(e, BlockStored)]
    assert [(e.block_hashes, e.group_idx, e.medium) for e in stored] == [
        ([x1], 0, "CPU"),
        ([x2], 1, "CPU"),
    ]
    removed = [e for e in out if isinstance(e, BlockRemoved)]
    assert [(e.block_hashes, e.group_idx, e.medium) for e in removed] == [
        ([x1], 0, "CPU"),
        ([x2], 1, "CPU"),
    ]
    assert isinstance(out[-1], VCleared)


def test_merging_costs_time_linear_in_the_keys_of_a_step() -> None:
    """One key at a time, a step's records are not rebuilt at every merge: the keys that
    pass through the records' constructors are those given plus those taken, not 1 + 2 +
    ... + n (quadratic)."""
    converted = [0]

    @attrs.frozen(kw_only=True)
    class CountedStored(BlocksStored):
        def __attrs_post_init__(self) -> None:
            converted[0] += len(self.keys)

    n = 2_000
    buf = EventBuffer()
    buf.extend(CountedStored(keys=[k(i)]) for i in range(n))
    [merged] = buf.take()
    assert merged == CountedStored(keys=[k(i) for i in range(n)])
    assert converted[0] <= 3 * n


# -- complete BlockStored payloads (a ``describe`` of the keys) ------------------------

CHUNK = 4


def chain(n: int, *, group: int = 0, start: int = 0, lora: str | None = None) -> dict[bytes, Any]:
    """Keys of ``n`` chained chunks (each one's parent the previous one's hash) with
    their BlockInfo; chunk ``i`` holds tokens ``4i .. 4i+3`` (offset by ``start``)."""
    from kvferry.cache import BlockInfo

    infos: dict[bytes, Any] = {}
    parent: bytes | None = None if start == 0 else bytes([start - 1, lora is not None]) * 16
    for i in range(start, start + n):
        h = bytes([i, lora is not None]) * 16
        infos[h + group.to_bytes(4, "big")] = BlockInfo(
            block_hash=h,
            parent_block_hash=parent,
            token_ids=list(range(CHUNK * i, CHUNK * (i + 1))),
            block_size=CHUNK,
            group_idx=group,
            lora_id=None if lora is None else 1,
            lora_name=lora,
            kv_cache_spec_kind="full_attention",
        )
        parent = h
    return infos


def x(block_hash: bytes) -> Any:
    """A hash as vLLM publishes it (an int unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."""
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    return maybe_convert_block_hash(BlockHash(block_hash))


def convert(events: list[Any], infos: dict[bytes, Any]) -> list[Any]:
    pytest.importorskip("vllm")
    from kvferry.cache import to_vllm_events

    return to_vllm_events(events, describe=infos.get)


def test_a_described_store_carries_every_field_of_vllms_blockstored() -> None:
    infos = chain(2, start=3)
    [e] = convert([BlocksStored(keys=list(infos), medium="DISK")], infos)
    h2, h3, h4 = (x(bytes([i, 0]) * 16) for i in (2, 3, 4))
    assert e.block_hashes == [h3, h4] and e.parent_block_hash == h2
    assert e.token_ids == list(range(12, 20)) and e.block_size == CHUNK
    assert (e.group_idx, e.medium, e.lora_id, e.lora_name) == (0, "DISK", None, None)
    assert e.kv_cache_spec_kind == "full_attention" and e.kv_cache_spec_sliding_window is None
    assert e.extra_keys is None and e.locality is None and e.ownership is None


def test_consecutive_keys_of_a_chain_merge_per_group() -> None:
    """Keys come chunk by chunk, all groups of a chunk together: each group's chain is
    one BlockStored, its tokens those of every block in order."""
    g0, g1 = chain(3, group=0), chain(3, group=1)
    keys = [k for pair in zip(g0, g1, strict=True) for k in pair]
    out = convert([BlocksStored(keys=keys)], g0 | g1)
    assert [(e.group_idx, len(e.block_hashes), e.parent_block_hash) for e in out] == [
        (0, 3, None),
        (1, 3, None),
    ]
    assert all(e.token_ids == list(range(12)) for e in out)


def test_a_broken_chain_or_another_lora_starts_a_new_event() -> None:
    first, second = chain(2), chain(2, start=3)  # chunk 2 is missing: 3's parent is not 1
    other = chain(1, start=5, lora="sql")  # continues 4's tokens, but under a LoRA
    infos = first | second | other
    out = convert([BlocksStored(keys=list(infos))], infos)
    assert [len(e.block_hashes) for e in out] == [2, 2, 1]
    assert [e.lora_name for e in out] == [None, None, "sql"]
    assert out[1].parent_block_hash == x(bytes([2, 0]) * 16)


def test_a_key_without_info_gets_the_placeholder_and_keeps_the_order() -> None:
    infos = chain(3)
    keys = list(infos)
    del infos[keys[1]]
    out = convert([BlocksStored(keys=keys)], infos)
    assert [(len(e.block_hashes), e.block_size, e.token_ids[:1]) for e in out] == [
        (1, CHUNK, [0]),
        (1, 0, []),  # the placeholder, after its parent's event
        (1, CHUNK, [8]),
    ]
    assert out[1].parent_block_hash is None and out[1].block_hashes == [x(keys[1][:-4])]


def test_removals_and_clears_need_no_info() -> None:
    infos = chain(2, group=1)
    out = convert([BlocksRemoved(keys=list(infos), medium="DISK"), AllBlocksCleared()], {})
    assert [(type(e).__name__, getattr(e, "group_idx", None)) for e in out] == [
        ("BlockRemoved", 1),
        ("AllBlocksCleared", None),
    ]
    # Removed under the hashes the stores announced: the keys' own.
    assert out[0].block_hashes == [x(k[:-4]) for k in infos] and out[0].medium == "DISK"
