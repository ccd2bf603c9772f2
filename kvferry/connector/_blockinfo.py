"""The book of planned stores: what a complete KV event needs per offload key.

The directory's event records carry keys only (:mod:`kvferry.cache._events`); vLLM's
``BlockStored`` also wants the parent hash, the tokens, the block size and the LoRA of
each block, which only the ``Request`` knows, and only while it lives. :class:`BlockBook`
copies them when the scheduler plans a store and hands them to
:func:`~kvferry.cache.to_vllm_events` as its ``describe``.

Who owns what: one book per :class:`~kvferry.connector._scheduler.SchedulerSide`, used
only on the thread that calls the scheduler side (vLLM's scheduler loop); no locks.

Lifetime of an entry (one per chunk, shared by the chunk's keys of every group):

1. :meth:`BlockBook.record_chunks` when stores of chunks are planned: one reference per
   key (``num_groups`` per chunk);
2. :meth:`BlockBook.retire` when a key's store ended (done, failed or never admitted):
   the reference goes; the directory has already recorded the store's event by then;
3. :meth:`BlockBook.drop_retired` after the next conversion of the events: a chunk no
   store references any more is dropped. Its event was taken and converted in between
   (``TakeEvents`` follows every earlier message to the directory), so it went out
   complete.

So the book holds the chunks of stores in flight, plus those that ended since the last
conversion. Past ``max_entries`` the oldest-recorded entry is dropped (a leak or a cap too
small; counted in ``entries_evicted``): its key's event then carries vLLM's placeholder
payload, as does every key the book does not know (counted in ``keys_without_info``).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from .._errors import InvariantError
from .._logging import get_logger
from ..cache import BlockInfo

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

_log = get_logger("kvferry.connector", role="scheduler")


class ChunkSource(Protocol):
    """What the book reads of a request: vLLM's ``Request`` is one."""

    @property
    def block_hashes(self) -> Sequence[bytes]: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def lora_request(self) -> Any: ...


@attrs.frozen(kw_only=True)
class GroupSpec:
    """A KV-cache group's kind as vLLM's offloading events announce it."""

    kind: str | None = None
    """``KVCacheSpecKind`` value (``"full_attention"``, ``"sliding_window"``, ...)."""
    sliding_window: int | None = None
    """In tokens; None for a group without a window."""


def group_specs(kv_cache_config: KVCacheConfig) -> tuple[GroupSpec, ...]:
    """Each KV-cache group's :class:`GroupSpec`, as vLLM computes it for its events."""
    from vllm.v1.kv_cache_interface import (
        get_kv_cache_spec_kind,
        get_kv_cache_spec_sliding_window,
    )

    return tuple(
        GroupSpec(
            kind=get_kv_cache_spec_kind(g.kv_cache_spec).value,
            sliding_window=get_kv_cache_spec_sliding_window(g.kv_cache_spec),
        )
        for g in kv_cache_config.kv_cache_groups
    )


@attrs.frozen(kw_only=True)
class BlockBookStatistics:
    entries: int
    """Chunks held now (stores in flight, and those ended since the last conversion)."""
    entries_evicted: int
    """Entries dropped at the ``max_entries`` cap, since the start."""
    keys_without_info: int
    """Stored keys described as unknown (announced with the placeholder payload)."""


@attrs.define(slots=True)
class _Chunk:
    parent: bytes | None
    tokens: array[int]
    lora_id: int | None
    lora_name: str | None
    refs: int


class BlockBook:
    """Per offload key, what vLLM's ``BlockStored`` needs, from store planning until the
    store's event is converted (see the module's docstring for the lifetime).

    ``chunk_tokens`` and ``hashes_per_chunk``: the scheduler's geometry (an offloaded
    block is ``hashes_per_chunk`` of vLLM's hash blocks; its key is the chained hash at
    its last one). ``groups``: one :class:`GroupSpec` per KV-cache group, in group order
    (:func:`group_specs`). ``max_entries``: the hard cap, in chunks; an entry costs about
    ``8 * chunk_tokens`` bytes plus ~200.
    """

    def __init__(
        self,
        *,
        chunk_tokens: int,
        hashes_per_chunk: int,
        groups: Sequence[GroupSpec] = (GroupSpec(),),
        max_entries: int = 1 << 16,
    ) -> None:
        if chunk_tokens <= 0 or hashes_per_chunk <= 0 or not groups or max_entries <= 0:
            raise ValueError(
                "BlockBook needs chunk_tokens, hashes_per_chunk and max_entries > 0 and a "
                f"group: got {chunk_tokens}, {hashes_per_chunk}, {max_entries}, {len(groups)}"
            )
        self.chunk_tokens = chunk_tokens
        self.hashes_per_chunk = hashes_per_chunk
        self.groups = tuple(groups)
        self.max_entries = max_entries
        # Chunk hash -> entry, oldest record first (the cap drops from the front).
        self._chunks: dict[bytes, _Chunk] = {}
        self._retired: set[bytes] = set()
        self.entries_evicted = 0
        self.keys_without_info = 0
        self.chunks_without_facts = 0
        """Chunks planned beyond the hashes or tokens their request holds (a bug: logged)."""

    def __len__(self) -> int:
        return len(self._chunks)

    def record_chunks(self, request: ChunkSource, first: int, upto: int) -> None:
        """Stores of chunks ``[first, upto)`` of ``request`` were planned: remember them,
        one reference per key (the chunk's keys of every group), until :meth:`retire`.

        Called by the scheduler with the plan, before the keys go to ``PrepareStore``;
        the request must hold the chunks' hashes and tokens (it computed them).
        """
        ct, hpc = self.chunk_tokens, self.hashes_per_chunk
        hashes, token_ids = request.block_hashes, request.all_token_ids
        held = min(len(hashes) // hpc, len(token_ids) // ct)
        if upto > held:
            # A bug in the caller's plan: the chunks the request does not hold are not
            # recorded (their events carry the placeholder), and the engine goes on.
            self.chunks_without_facts += upto - max(first, held)
            error = InvariantError("chunk_facts_missing", "not recorded")
            _log.error(
                "invariant_broken",
                invariant=error.invariant,
                error=str(error),
                upto=upto,
                held=held,
            )
            upto = held
        lora = request.lora_request
        refs = len(self.groups)
        for c in range(first, upto):
            h = bytes(hashes[(c + 1) * hpc - 1])
            entry = self._chunks.pop(h, None)
            if entry is None:
                entry = _Chunk(
                    parent=bytes(hashes[c * hpc - 1]) if c else None,
                    tokens=array("q", token_ids[c * ct : (c + 1) * ct]),
                    lora_id=None if lora is None else lora.adapter_id,
                    lora_name=None if lora is None else lora.name,
                    refs=0,
                )
            entry.refs += refs
            self._chunks[h] = entry  # the newest record goes last
            self._retired.discard(h)
        while len(self._chunks) > self.max_entries:
            oldest = next(iter(self._chunks))
            del self._chunks[oldest]
            self._retired.discard(oldest)
            self.entries_evicted += 1

    def retire(self, keys: Iterable[bytes]) -> None:
        """The stores of ``keys`` ended (done, failed, discarded, or never admitted):
        each gives back the reference :meth:`record_chunks` took. A chunk no store
        references any more stays until the next :meth:`drop_retired`.

        Called when a store job ends, after its ``CompleteStore`` went to the directory,
        and for planned keys that got no job. Keys the book does not hold are ignored.
        """
        for key in keys:
            h = key[:-4]
            entry = self._chunks.get(h)
            if entry is None or entry.refs == 0:
                continue
            entry.refs -= 1
            if entry.refs == 0:
                self._retired.add(h)

    def drop_retired(self) -> None:
        """Forget the chunks retired so far (their events were converted).

        Called right after converting the events taken with ``TakeEvents``: every store
        that ended before that ask had its event in them. A chunk recorded again since
        its retirement is kept.
        """
        for h in self._retired:
            entry = self._chunks.get(h)
            if entry is not None and entry.refs == 0:
                del self._chunks[h]
        self._retired.clear()

    def describe(self, key: bytes) -> BlockInfo | None:
        """``key``'s :class:`BlockInfo`, or None (counted) if the book does not hold it:
        the ``describe`` of :func:`~kvferry.cache.to_vllm_events`."""
        h = key[:-4]
        entry = self._chunks.get(h)
        if entry is None:
            self.keys_without_info += 1
            return None
        group = int.from_bytes(key[-4:], "big")
        spec = self.groups[group] if group < len(self.groups) else GroupSpec()
        return BlockInfo(
            block_hash=h,
            parent_block_hash=entry.parent,
            token_ids=entry.tokens,
            block_size=self.chunk_tokens,
            group_idx=group,
            lora_id=entry.lora_id,
            lora_name=entry.lora_name,
            kv_cache_spec_kind=spec.kind,
            kv_cache_spec_sliding_window=spec.sliding_window,
        )

    def statistics(self) -> BlockBookStatistics:
        return BlockBookStatistics(
            entries=len(self._chunks),
            entries_evicted=self.entries_evicted,
            keys_without_info=self.keys_without_info,
        )
