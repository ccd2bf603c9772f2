"""KV events of the host tier: plain records, their per-step batching, and the conversion
to vLLM's ``vllm.distributed.kv_events`` types.

The directory records a fact for every change a consumer (a KV-aware router) can see:
:class:`BlocksStored` when stores complete (a block becomes a lookup hit),
:class:`BlocksRemoved` when visible blocks leave (eviction, clear), and
:class:`AllBlocksCleared` when the tier is reset, followed by the :class:`BlocksRemoved`
of every block it held (vLLM's AllBlocksCleared names no medium). Replaying the records
in order over an empty set gives exactly the set of keys that are lookup hits — the tests
hold that.

vLLM is imported only inside :func:`to_vllm_events`, so this module works without it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeAlias, assert_never

import attrs

if TYPE_CHECKING:
    from ._directory import Key

MEDIUM = "CPU"
"""The medium of every event of the host tier, as vLLM spells it."""


def _keys(keys: Iterable[bytes]) -> tuple[bytes, ...]:
    return tuple(keys)


@attrs.frozen(kw_only=True)
class BlocksStored:
    """These keys became lookup hits (their stores completed), in prefix order."""

    keys: tuple[bytes, ...] = attrs.field(converter=_keys, repr=lambda k: f"<{len(k)} keys>")
    medium: str = MEDIUM


@attrs.frozen(kw_only=True)
class BlocksRemoved:
    """These keys stopped being lookup hits (evicted or cleared)."""

    keys: tuple[bytes, ...] = attrs.field(converter=_keys, repr=lambda k: f"<{len(k)} keys>")
    medium: str = MEDIUM


@attrs.frozen(kw_only=True)
class AllBlocksCleared:
    """Every key of the tier stopped being a lookup hit (a reset)."""

    medium: str = MEDIUM


KVEvent: TypeAlias = BlocksStored | BlocksRemoved | AllBlocksCleared


def replay(events: Iterable[KVEvent], visible: set[Key] | None = None) -> set[Key]:
    """The set of visible keys after applying ``events`` to ``visible`` (empty by default)."""
    out = set() if visible is None else set(visible)
    for ev in events:
        match ev:
            case BlocksStored(keys=keys):
                out.update(keys)
            case BlocksRemoved(keys=keys):
                out.difference_update(keys)
            case AllBlocksCleared():
                out.clear()
            case _:
                assert_never(ev)
    return out


class EventBuffer:
    """Events waiting for the next ``take``: consecutive records of one kind are merged,
    and a clear makes every earlier record of the batch moot (it is dropped).

    A merge extends the last run's list of keys in place (the records are built once, by
    ``take``), so a step of many small events costs time linear in its keys.

    Bounded by ``max_keys``: past it the buffer collapses to one :class:`AllBlocksCleared`
    — a consumer then under-counts the tier (a routing miss), never over-counts it —
    and the drop is counted in ``keys_dropped``.
    """

    def __init__(self, *, max_keys: int = 1_000_000) -> None:
        self.max_keys = max_keys
        # Runs in order: a clear, or (record class, its medium, the keys merged so far).
        self._runs: list[
            AllBlocksCleared | tuple[type[BlocksStored | BlocksRemoved], str, list[bytes]]
        ]
        self._runs = []
        self._num_keys = 0
        self.keys_dropped = 0
        self.overflows = 0

    def __len__(self) -> int:
        return len(self._runs)

    def extend(self, events: Iterable[KVEvent]) -> None:
        for ev in events:
            self.append(ev)

    def append(self, ev: KVEvent) -> None:
        if isinstance(ev, AllBlocksCleared):
            self._runs = [ev]
            self._num_keys = 0
            return
        if not ev.keys:
            return
        last = self._runs[-1] if self._runs else None
        if isinstance(last, tuple) and last[0] is type(ev) and last[1] == ev.medium:
            last[2].extend(ev.keys)
        else:
            self._runs.append((type(ev), ev.medium, list(ev.keys)))
        self._num_keys += len(ev.keys)
        if self._num_keys > self.max_keys:
            self.keys_dropped += self._num_keys
            self.overflows += 1
            self._runs = [AllBlocksCleared()]
            self._num_keys = 0

    def take(self) -> list[KVEvent]:
        runs, self._runs, self._num_keys = self._runs, [], 0
        return [
            run if isinstance(run, AllBlocksCleared) else run[0](keys=run[2], medium=run[1])
            for run in runs
        ]


def to_vllm_events(events: Iterable[KVEvent]) -> list[Any]:
    """vLLM ``KVCacheEvent`` objects for ``events`` (imports vLLM; the connector calls it).

    Keys are vLLM offload keys (block hash + 4-byte big-endian group index). As vLLM's
    OffloadingConnector does by default, a stored block is one ``BlockStored`` with a
    placeholder payload (its hash, no parent, no tokens, ``block_size=0``, its
    ``group_idx``), and removals are one ``BlockRemoved`` per group, in order.
    """
    from vllm.distributed.kv_events import AllBlocksCleared as VAllBlocksCleared
    from vllm.distributed.kv_events import BlockRemoved as VBlockRemoved
    from vllm.distributed.kv_events import BlockStored as VBlockStored
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    out: list[Any] = []
    for ev in events:
        match ev:
            case BlocksStored(keys=keys, medium=medium):
                for key in keys:
                    out.append(
                        VBlockStored(
                            block_hashes=[maybe_convert_block_hash(BlockHash(key[:-4]))],
                            parent_block_hash=None,
                            token_ids=[],
                            block_size=0,
                            lora_id=None,
                            medium=medium,
                            lora_name=None,
                            group_idx=int.from_bytes(key[-4:], "big"),
                        )
                    )
            case BlocksRemoved(keys=keys, medium=medium):
                by_group: dict[int, list[Any]] = {}
                for key in keys:
                    group = int.from_bytes(key[-4:], "big")
                    hashed = maybe_convert_block_hash(BlockHash(key[:-4]))
                    by_group.setdefault(group, []).append(hashed)
                for group, hashes in by_group.items():
                    out.append(VBlockRemoved(block_hashes=hashes, medium=medium, group_idx=group))
            case AllBlocksCleared():
                out.append(VAllBlocksCleared())
            case _:
                assert_never(ev)
    return out
