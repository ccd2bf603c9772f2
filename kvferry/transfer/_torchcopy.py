"""Blocks gathered into rows and scattered back with torch ops (``index_select`` /
``index_copy_`` per region), on the current stream, for raw block access on devices
whose memory Python cannot address (:class:`~kvferry.transfer.KVBlockAccess` on CUDA).
Not a hot path: the CUDA copy engine uses one Triton launch per piece instead
(:mod:`._triton`).
"""

from __future__ import annotations

import torch

from ._layout import GroupLayout, Region

# Widest element a region can be viewed as: index kernels move one element per thread.
_WIDE = (torch.int64, torch.int32, torch.int16)


def _wide(t: torch.Tensor, *others: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``t`` (and ``others``, laid out alike) viewed with the widest element that divides
    every stride, size and offset; uint8 otherwise."""
    ts = (t, *others)
    for dtype in _WIDE:
        size = torch.empty(0, dtype=dtype).element_size()
        if all(
            x.shape[-1] % size == 0
            and x.storage_offset() % size == 0
            and all(s % size == 0 for s in x.stride()[:-1])
            for x in ts
        ):
            try:
                return tuple(x.view(dtype) for x in ts)
            except RuntimeError:
                break
    return ts


def _slice(rows: torch.Tensor, r: Region) -> torch.Tensor:
    return rows[:, r.offset : r.offset + r.row_bytes].view(rows.shape[0], r.count, r.nbytes)


def gather_rows(group: GroupLayout, blocks: torch.Tensor, rows: torch.Tensor) -> None:
    """``rows[i]`` ← engine block ``blocks[i]`` of ``group`` (all on one device)."""
    for r in group.regions:
        src, dst = _wide(r.view, _slice(rows, r))
        torch.index_select(src, 0, blocks, out=dst)


def scatter_rows(group: GroupLayout, blocks: torch.Tensor, rows: torch.Tensor) -> None:
    """Engine block ``blocks[i]`` of ``group`` ← ``rows[i]`` (all on one device)."""
    for r in group.regions:
        dst, src = _wide(r.view, _slice(rows, r))
        dst.index_copy_(0, blocks, src)
