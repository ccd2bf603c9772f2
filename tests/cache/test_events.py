"""KV events: batching per step, replay, and vLLM's types."""

from __future__ import annotations

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
