"""The job planner: a request's chunks and engine block ids -> the copy jobs' rows.

Who owns what: pure functions of their arguments (no state, no vLLM, no actor), called by
:class:`~kvferry.connector._scheduler.SchedulerSide` on vLLM's engine thread, which owns
the requests and the jobs and asks the directory for the host slots first.

An offloaded block (a *chunk*) is ``blocks_per_chunk`` engine blocks; host slot ``s``
holds them in rows ``s * blocks_per_chunk ..``, so engine block ``b`` of a request pairs
with host row ``slot * blocks_per_chunk + b % blocks_per_chunk``. Block id 0 is vLLM's
null block: a sliding-window group's blocks outside its window, never copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt

from ..transfer import GroupBlocks
from ._geometry import Geometry

NULL_BLOCK = 0
"""vLLM's null block id: a sliding-window group's block outside its window."""


def storable_chunks(
    geo: Geometry, computed_tokens: int, keyed_chunks: int, block_ids: Sequence[Sequence[int]]
) -> int:
    """How many leading chunks of a request can be stored: computed, keyed (their block
    hash known) and allocated in every group."""
    return min(
        computed_tokens // geo.chunk_tokens,
        keyed_chunks,
        min((len(b) for b in block_ids), default=0) // geo.blocks_per_chunk,
    )


@attrs.frozen(kw_only=True)
class StorePlan:
    """One request's store job, from the host slots ``PrepareStore`` answered."""

    parts: tuple[GroupBlocks, ...]
    """Per group with something to copy: its engine blocks and their host rows."""
    slots: npt.NDArray[np.int64] = attrs.field(eq=False)
    """The host slots the job fills (group by group, chunks in order)."""
    keys: tuple[bytes, ...]
    """Their keys, in the same order."""
    dead: list[int]
    """Slots taken for a chunk holding a null block: nothing to store, given back."""
    fenced: tuple[int, ...]
    """The sliding-window engine blocks the job reads (vLLM may free them before it ends)."""
    tokens: int
    """Tokens the job stores (summed over groups, per group)."""


def plan_store(
    geo: Geometry,
    first: int,
    block_ids: Sequence[Sequence[int]],
    slots: npt.NDArray[np.int64],
    keys: Sequence[bytes],
) -> StorePlan:
    """The store job of chunks ``first ..`` of a request.

    ``slots`` is ``PrepareStore``'s answer as (chunks, groups): -1 for a chunk not stored
    (present already, not admitted, no room); ``keys`` the same chunks' keys, all groups of
    a chunk together; ``block_ids`` the request's engine block ids per group.
    """
    G, bpc = geo.num_groups, geo.blocks_per_chunk
    parts = []
    live: list[int] = []
    live_keys: list[bytes] = []
    dead: list[int] = []
    fenced: list[int] = []
    # Python ints throughout (a numpy scalar read per chunk cost more than the rest).
    for g, col in enumerate(slots.T.tolist()):
        ids = block_ids[g]
        chosen = [i for i, s in enumerate(col) if s >= 0]
        if not chosen:
            continue
        if bpc == 1:
            dev_rows = [ids[first + i] for i in chosen]
            if NULL_BLOCK not in dev_rows:  # the common case: every chunk is stored
                host_rows = [col[i] for i in chosen]
                live.extend(host_rows)
                live_keys.extend([keys[i * G + g] for i in chosen])
                parts.append(GroupBlocks(group=g, device_blocks=dev_rows, host_rows=host_rows))
                if geo.windows[g] is not None:
                    fenced.extend(dev_rows)
                continue
        dev_rows, host_rows = [], []
        for i in chosen:
            slot = col[i]
            c = first + i
            dev = ids[c * bpc : (c + 1) * bpc]
            if NULL_BLOCK in dev:  # outside a sliding window: nothing to store
                dead.append(slot)
                continue
            dev_rows.extend(dev)
            host_rows.extend(range(slot * bpc, (slot + 1) * bpc))
            live.append(slot)
            live_keys.append(keys[i * G + g])
        if dev_rows:
            parts.append(GroupBlocks(group=g, device_blocks=dev_rows, host_rows=host_rows))
            if geo.windows[g] is not None:
                fenced.extend(dev_rows)
    return StorePlan(
        parts=tuple(parts),
        slots=np.array(live, dtype=np.int64),
        keys=tuple(live_keys),
        dead=dead,
        fenced=tuple(fenced),
        tokens=len(live) * geo.chunk_tokens // G if G else 0,
    )


@attrs.frozen(kw_only=True)
class LoadPlan:
    """The engine blocks a load fills, before the directory is asked for host slots."""

    first_chunk: int
    blocks: npt.NDArray[np.int64] = attrs.field(eq=False)
    """The request's block indices the load covers (the first may be mid-chunk)."""
    device_blocks: tuple[npt.NDArray[np.int64], ...] = attrs.field(eq=False)
    """Per group, the engine block ids at those indices (0: vLLM's null block)."""
    wanted: npt.NDArray[np.bool_] = attrs.field(eq=False)
    """(chunks, groups): the chunks of each group the load fills."""

    def wanted_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """Of the keys of every (chunk, group) of the load, those it fills."""
        return [k for k, w in zip(keys, self.wanted.ravel().tolist(), strict=True) if w]


def plan_load(
    geo: Geometry, block_ids: Sequence[Sequence[int]], first_token: int, end_chunk: int
) -> LoadPlan:
    """A load of the tokens ``first_token`` .. chunk ``end_chunk``: the engine's own cache
    holds those before ``first_token`` (a block boundary, maybe mid-chunk).

    A full-attention group fills every chunk; a sliding-window group only those vLLM
    allocated a block of (the ones before its window are the null block).
    """
    bs, bpc, G = geo.engine_block_size, geo.blocks_per_chunk, geo.num_groups
    first_chunk = first_token // geo.chunk_tokens
    first_blk, end_blk = first_token // bs, end_chunk * bpc
    blk = np.arange(first_blk, end_blk)
    devs = tuple(np.asarray(block_ids[g][first_blk:end_blk], dtype=np.int64) for g in range(G))
    wanted = np.ones((end_chunk - first_chunk, G), dtype=np.bool_)
    for g in range(G):
        if geo.windows[g] is not None:
            live = devs[g] != NULL_BLOCK
            wanted[:, g] = False
            wanted[np.unique(blk[live] // bpc - first_chunk), g] = True
    return LoadPlan(first_chunk=first_chunk, blocks=blk, device_blocks=devs, wanted=wanted)


def load_parts(
    geo: Geometry, plan: LoadPlan, slots: npt.NDArray[np.int64]
) -> tuple[GroupBlocks, ...]:
    """The load job's parts: ``slots`` holds the host slot of each wanted (chunk, group),
    in ``plan.wanted``'s order; engine block ``b`` pairs with host row
    ``slot * blocks_per_chunk + b % blocks_per_chunk``. Null blocks are left out."""
    G, bpc = geo.num_groups, geo.blocks_per_chunk
    if not geo.hybrid:  # every group fills every chunk: no null block, no mask
        slot_of = np.asarray(slots, np.int64).reshape(-1, G)
        if bpc == 1:  # a chunk is a block: its host row is its slot
            return tuple(
                GroupBlocks(group=g, device_blocks=plan.device_blocks[g], host_rows=slot_of[:, g])
                for g in range(G)
            )
        chunk = plan.blocks // bpc - plan.first_chunk
        within = plan.blocks % bpc
        return tuple(
            GroupBlocks(
                group=g,
                device_blocks=plan.device_blocks[g],
                host_rows=slot_of[chunk, g] * bpc + within,
            )
            for g in range(G)
        )
    full = np.full(plan.wanted.size, -1, dtype=np.int64)
    full[plan.wanted.ravel()] = slots
    slot_of = full.reshape(-1, G)
    parts = []
    for g in range(G):
        dev = plan.device_blocks[g]
        keep = dev != NULL_BLOCK if geo.windows[g] is not None else slice(None)
        b = plan.blocks[keep]
        rows = slot_of[b // bpc - plan.first_chunk, g] * bpc + b % bpc
        parts.append(GroupBlocks(group=g, device_blocks=dev[keep], host_rows=rows))
    return tuple(parts)


def failed_load_parts(block_ids: Sequence[Sequence[int]]) -> tuple[GroupBlocks, ...]:
    """A load that copies nothing (planned failed): every block vLLM allocated for the
    request but its null blocks, with no host row (-1), so the workers report them."""
    parts = []
    for g, ids in enumerate(block_ids):
        dev = [b for b in ids if b != NULL_BLOCK]
        if dev:
            parts.append(GroupBlocks(group=g, device_blocks=dev, host_rows=[-1] * len(dev)))
    return tuple(parts)
