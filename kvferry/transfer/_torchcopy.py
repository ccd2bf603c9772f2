"""Copies expressed as torch ops, for devices whose memory Python cannot address (CUDA).

A job moves through a *staging* buffer on the device, laid out exactly like host rows:

- store: each region's blocks are gathered into staging with ``index_select`` (a device
  kernel), then each run of consecutive host rows is one contiguous device→host copy;
- load: each run of host rows is one contiguous host→device copy into staging, then
  each region is scattered into its blocks with ``index_copy_``.

So the host link only ever sees large contiguous copies (pinned, ``non_blocking``),
whatever the layout, and the gathers run at device-memory speed. All ops go on the
current stream; the caller picks it. The same code runs on CPU tensors, which is how
the CUDA engine's logic is tested without a GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import torch

from ._layout import GroupLayout, KVLayout, Region

if TYPE_CHECKING:
    from ._copy import CopyJob

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


def host_runs(rows: npt.NDArray[np.int64]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive host rows: ``(first row, index in rows, length)``."""
    if len(rows) == 0:
        return []
    starts = np.concatenate(([0], np.flatnonzero(np.diff(rows) != 1) + 1))
    ends = np.concatenate((starts[1:], [len(rows)]))
    return [(int(rows[a]), int(a), int(b - a)) for a, b in zip(starts, ends, strict=True)]


def torch_copy_job(
    layout: KVLayout,
    host_rows: torch.Tensor,
    job: CopyJob,
    staging: torch.Tensor,
    *,
    non_blocking: bool,
) -> None:
    """Enqueue ``job`` (a :class:`~kvferry.transfer.CopyJob`, already checked) on the
    current stream, through ``staging`` (``(rows, host row bytes)`` on the device).

    Jobs larger than ``staging`` go in pieces; the stream orders each piece after the
    previous one's use of the buffer.
    """
    cap = staging.shape[0]
    for part in job.parts:
        group = layout.groups[part.group]
        for a in range(0, len(part.device_blocks), cap):
            dev = part.device_blocks[a : a + cap]
            rows = part.host_rows[a : a + cap]
            m = len(dev)
            idx = torch.as_tensor(dev.copy()).to(layout.device, non_blocking=non_blocking)
            buf = staging[:m]
            if job.direction == "store":
                gather_rows(group, idx, buf)
                for h0, i0, n in host_runs(rows):
                    host_rows[h0 : h0 + n].copy_(buf[i0 : i0 + n], non_blocking=non_blocking)
            else:
                for h0, i0, n in host_runs(rows):
                    buf[i0 : i0 + n].copy_(host_rows[h0 : h0 + n], non_blocking=non_blocking)
                scatter_rows(group, idx, buf)
