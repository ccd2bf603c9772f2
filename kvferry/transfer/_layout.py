"""KV layouts: what ``register_kv_caches`` hands over, described as byte segments.

Whatever the engine's layout (per-layer tensors with K and V joined or split, layers
sharing one allocation, NHD or HND inside a block), every layer tensor has one *block
dimension*. Moving it to the front, the bytes of one block of one layer form one or more
contiguous runs; each run, over all blocks, is a :class:`Segment`: a ``(num_blocks,
nbytes)`` uint8 view. A host row holds one engine block of one KV-cache group: all its
segments back to back, so a block moves in a few large copies.

Layers that alias the same bytes (KV-cache groups overlaying one allocation) are kept
once.
"""

from __future__ import annotations

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
class GroupLayout:
    segments: tuple[Segment, ...]
    row_bytes: int


@attrs.frozen(kw_only=True)
class KVLayout:
    """Segments per KV-cache group, and the bytes of a host row (the largest group's)."""

    groups: tuple[GroupLayout, ...]
    num_blocks: int
    device: torch.device

    @property
    def row_bytes(self) -> int:
        return max(g.row_bytes for g in self.groups)


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
    """The ``(num_blocks, nbytes)`` uint8 views that cover one layer's KV tensor."""
    bd = _block_dim(t, num_blocks, block_stride_bytes)
    tb = t.movedim(bd, 0)
    shape, stride = list(tb.shape[1:]), list(tb.stride()[1:])
    # The longest suffix of dims that is contiguous within a block.
    j = len(shape)
    expected = 1
    while j > 0 and (shape[j - 1] == 1 or stride[j - 1] == expected):
        expected *= shape[j - 1]
        j -= 1
    outer = shape[:j]
    views: list[torch.Tensor] = []

    def emit(index: tuple[int, ...]) -> None:
        sub = tb[(slice(None), *index)]
        sub = sub.reshape(num_blocks, -1) if sub.dim() != 2 else sub
        if sub.stride(1) != 1 and sub.shape[1] > 1:
            raise ValueError(f"cannot express KV tensor {tuple(t.shape)} as contiguous runs")
        views.append(sub.view(torch.uint8) if sub.dtype != torch.uint8 else sub)

    def walk(prefix: tuple[int, ...]) -> None:
        if len(prefix) == len(outer):
            emit(prefix)
            return
        for i in range(outer[len(prefix)]):
            walk((*prefix, i))

    walk(())
    return views


def describe_kv_caches(
    kv_caches: Mapping[str, torch.Tensor],
    group_layers: Sequence[Sequence[str]],
    num_blocks: int,
    block_stride_bytes: int | None = None,
) -> KVLayout:
    """Describe ``kv_caches`` (layer name → tensor) for the given KV-cache groups."""
    groups: list[GroupLayout] = []
    device: torch.device | None = None
    for layers in group_layers:
        seen: set[tuple[int, int, int]] = set()
        segments: list[Segment] = []
        offset = 0
        for name in layers:
            if name not in kv_caches:
                continue  # layers without KV (e.g. cross-attention) are not offloaded
            t = kv_caches[name]
            device = t.device
            for view in layer_segments(t, num_blocks, block_stride_bytes):
                ident = (view.data_ptr(), view.stride(0), view.shape[1])
                if ident in seen:
                    continue
                seen.add(ident)
                segments.append(Segment(view=view, offset=offset))
                offset += int(view.shape[1])
        groups.append(GroupLayout(segments=tuple(segments), row_bytes=offset))
    if device is None:
        raise ValueError("no KV cache tensor matches the KV-cache groups' layer names")
    return KVLayout(groups=tuple(groups), num_blocks=num_blocks, device=device)
