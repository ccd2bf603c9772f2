"""KV events of the host tier: plain records, their per-step batching, and the conversion
to vLLM's ``vllm.distributed.kv_events`` types.

The directory records a fact for every change a consumer (a KV-aware router) can see:
:class:`BlocksStored` when stores complete (a block becomes a lookup hit),
:class:`BlocksRemoved` when visible blocks leave (eviction, clear, and a reset: every
block it held, by name). :class:`AllBlocksCleared` only stands for records an
:class:`EventBuffer` had to drop (vLLM's AllBlocksCleared names no medium: a router
forgets every medium's blocks of the engine, an under-count, never an over-count); a
tier's reset keeps to its own medium. Replaying the records in order over an empty set
gives exactly the set of keys that are lookup hits — the tests hold that.

The records carry keys only. What a complete ``BlockStored`` needs besides (the parent
hash, the tokens, the block size, LoRA) comes at conversion from a ``describe`` callable
returning a :class:`BlockInfo` per key; the connector's book of planned stores
(``kvferry.connector._blockinfo``) is one.

vLLM is imported only inside :func:`to_vllm_events`, so this module works without it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
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
    """Forget every key announced so far: the records of a batch that overflowed its
    :class:`EventBuffer` were dropped (a consumer under-counts until the keys come again)."""

    medium: str = MEDIUM


KVEvent: TypeAlias = BlocksStored | BlocksRemoved | AllBlocksCleared


@attrs.frozen(kw_only=True)
class BlockInfo:
    """What vLLM's ``BlockStored`` says of one stored key besides its hash and medium.

    An offloaded block (a chunk of ``block_size`` tokens) is announced as one retrievable
    unit under its key's hash — the hash vLLM computed at the chunk's last token — with
    the previous chunk's hash as its parent, so a consumer that rebuilds keys from the
    tokens sees exactly what a lookup can hit (vLLM issue #57159).
    """

    block_hash: bytes
    """The key's block hash (the key without its group suffix)."""
    parent_block_hash: bytes | None
    """The previous chunk's block hash; None for the first chunk of a sequence."""
    token_ids: Sequence[int] = attrs.field(eq=False, repr=lambda t: f"<{len(t)} tokens>")
    """The chunk's ``block_size`` tokens (shared with the book: never mutated)."""
    block_size: int
    group_idx: int
    lora_id: int | None = None
    lora_name: str | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


Describe: TypeAlias = Callable[[bytes], BlockInfo | None]
"""Key -> its :class:`BlockInfo`, or None when nothing is known of it."""


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


def to_vllm_events(events: Iterable[KVEvent], describe: Describe | None = None) -> list[Any]:
    """vLLM ``KVCacheEvent`` objects for ``events`` (imports vLLM; the connector calls it).

    Keys are vLLM offload keys (block hash + 4-byte big-endian group index).

    Stores: with ``describe``, a stored key is announced with everything vLLM's
    ``BlockStored`` carries (:class:`BlockInfo`): consecutive keys of one group that
    form a chain (each key's parent is the previous key's hash, same LoRA) make one
    ``BlockStored`` of several hashes, as vLLM's block pool announces its blocks; the
    runs of one group keep their order, so a parent is announced before its children. A
    key ``describe`` knows nothing of — and every key when ``describe`` is None — gets
    the placeholder payload of vLLM's OffloadingConnector (its hash, no parent, no
    tokens, ``block_size=0``, its ``group_idx``).

    Removals are one ``BlockRemoved`` per group, in order, under the same hashes as the
    stores announced; a clear is vLLM's ``AllBlocksCleared`` (which names no medium).
    """
    from vllm.distributed.kv_events import AllBlocksCleared as VAllBlocksCleared
    from vllm.distributed.kv_events import BlockRemoved as VBlockRemoved
    from vllm.distributed.kv_events import BlockStored as VBlockStored
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    def external(block_hash: bytes) -> Any:
        return maybe_convert_block_hash(BlockHash(block_hash))

    def placeholder(key: bytes, medium: str) -> Any:
        return VBlockStored(
            block_hashes=[external(key[:-4])],
            parent_block_hash=None,
            token_ids=[],
            block_size=0,
            lora_id=None,
            medium=medium,
            lora_name=None,
            group_idx=int.from_bytes(key[-4:], "big"),
        )

    def complete(run: list[BlockInfo], medium: str) -> Any:
        first = run[0]
        tokens: list[int] = []
        for info in run:
            tokens.extend(info.token_ids)
        return VBlockStored(
            block_hashes=[external(info.block_hash) for info in run],
            parent_block_hash=(
                None if first.parent_block_hash is None else external(first.parent_block_hash)
            ),
            token_ids=tokens,
            block_size=first.block_size,
            lora_id=first.lora_id,
            medium=medium,
            lora_name=first.lora_name,
            group_idx=first.group_idx,
            kv_cache_spec_kind=first.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=first.kv_cache_spec_sliding_window,
        )

    def stored(keys: Sequence[bytes], medium: str, describe: Describe) -> Iterable[Any]:
        # One open run per group: a group's runs leave in the order they started.
        runs: dict[int, list[BlockInfo]] = {}
        for key in keys:
            info = describe(key)
            group = int.from_bytes(key[-4:], "big") if info is None else info.group_idx
            run = runs.get(group)
            if run is not None and info is not None and _extends(run[-1], info):
                run.append(info)
                continue
            if run is not None:
                yield complete(runs.pop(group), medium)
            if info is None:
                yield placeholder(key, medium)
            else:
                runs[group] = [info]
        for run in runs.values():
            yield complete(run, medium)

    out: list[Any] = []
    for ev in events:
        match ev:
            case BlocksStored(keys=keys, medium=medium):
                if describe is None:
                    out.extend(placeholder(key, medium) for key in keys)
                else:
                    out.extend(stored(keys, medium, describe))
            case BlocksRemoved(keys=keys, medium=medium):
                by_group: dict[int, list[Any]] = {}
                for key in keys:
                    group = int.from_bytes(key[-4:], "big")
                    by_group.setdefault(group, []).append(external(key[:-4]))
                for group, hashes in by_group.items():
                    out.append(VBlockRemoved(block_hashes=hashes, medium=medium, group_idx=group))
            case AllBlocksCleared():
                out.append(VAllBlocksCleared())
            case _:
                assert_never(ev)
    return out


def _extends(last: BlockInfo, info: BlockInfo) -> bool:
    """Whether ``info`` continues the chain that ends at ``last`` in one ``BlockStored``."""
    return (
        info.parent_block_hash == last.block_hash
        and info.group_idx == last.group_idx
        and info.block_size == last.block_size
        and info.lora_id == last.lora_id
        and info.lora_name == last.lora_name
    )
