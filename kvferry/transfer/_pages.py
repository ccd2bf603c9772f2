"""Page tables of a step batch: the device side of the CUDA path, planned with numpy.

A *page* is one contiguous run of bytes of one engine block (one item of a
:class:`~kvferry.transfer.Region`, cut to at most :data:`MAX_PAGE_BYTES`). A copy kernel
moves every page of a batch between the engine's KV tensors and a device *staging* slot
laid out exactly like host rows, so the host link only sees contiguous runs of rows.

Per KV-cache group, the pages of one block are a fixed :class:`PageTemplate` (offsets,
block strides, sizes), computed once when the engine starts. A batch's table is then a
handful of numpy operations over ``(pairs, pages per block)`` arrays, whatever the number
of layers, regions and jobs: no Python loop per block, region or job.

A batch (all of one direction's jobs of an engine step) is laid out in *staging order*:
jobs in submission order, within a job its groups, within a group its host rows sorted,
so consecutive host rows land on consecutive staging rows and each run of them is one
DMA. Staging order is cut into *pieces* of at most one ring slot of rows; a job ends with
the last piece that holds one of its rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np
import numpy.typing as npt

from ._layout import GroupLayout

if TYPE_CHECKING:
    from ._copy import CopyJob

I64 = npt.NDArray[np.int64]

MAX_PAGE_BYTES = 64 << 10
"""Longer runs (a block-outermost layout's whole block) are cut, so one kernel program
never copies much more than its neighbours."""


@attrs.frozen(kw_only=True)
class PageTemplate:
    """The pages of one engine block of one group: page ``i`` of block ``b`` starts at
    ``dev_offset[i] + b * block_stride[i]`` in the engine's memory and at ``row_offset[i]``
    in a host (or staging) row, and is ``nbytes[i]`` long."""

    dev_offset: I64 = attrs.field(eq=False)
    block_stride: I64 = attrs.field(eq=False)
    row_offset: I64 = attrs.field(eq=False)
    nbytes: I64 = attrs.field(eq=False)

    @classmethod
    def of(cls, group: GroupLayout, max_page_bytes: int = MAX_PAGE_BYTES) -> PageTemplate:
        dev, stride, row, size = [], [], [], []
        for r in group.regions:
            for item in range(r.count):
                base = r.view.data_ptr() + item * r.item_stride
                host = r.offset + item * r.nbytes
                for cut in range(0, r.nbytes, max_page_bytes):
                    dev.append(base + cut)
                    stride.append(r.block_stride)
                    row.append(host + cut)
                    size.append(min(max_page_bytes, r.nbytes - cut))

        def a(x: list[int]) -> I64:
            return np.asarray(x, dtype=np.int64)

        return cls(dev_offset=a(dev), block_stride=a(stride), row_offset=a(row), nbytes=a(size))

    def __len__(self) -> int:
        return len(self.nbytes)


@attrs.frozen(kw_only=True)
class BatchPlan:
    """A batch laid out in staging order (see the module docstring).

    ``host_rows[i]`` is the host row of staging position ``i``; position ``i`` sits in
    piece ``i // slot_rows`` at slot row ``i % slot_rows``. ``runs_*`` are the maximal runs
    of consecutive host rows inside one piece; ``run_bounds[k]:run_bounds[k+1]`` are the
    runs of piece ``k``. ``job_piece[j]`` is the last piece holding a row of job ``j``
    (-1 for a job with no blocks).
    """

    slot_rows: int
    host_rows: I64 = attrs.field(eq=False)
    dev_blocks: I64 = attrs.field(eq=False)
    groups: I64 = attrs.field(eq=False)
    runs_host: I64 = attrs.field(eq=False)
    runs_pos: I64 = attrs.field(eq=False)
    runs_len: I64 = attrs.field(eq=False)
    run_bounds: I64 = attrs.field(eq=False)
    job_piece: I64 = attrs.field(eq=False)

    @property
    def num_rows(self) -> int:
        return len(self.host_rows)

    @property
    def num_pieces(self) -> int:
        return -(-self.num_rows // self.slot_rows)


def plan_batch(jobs: Sequence[CopyJob], slot_rows: int) -> BatchPlan:
    """Lay ``jobs`` (already checked) out in staging order, in pieces of ``slot_rows``."""
    if slot_rows <= 0:
        raise ValueError(f"slot_rows must be > 0, got {slot_rows}")
    parts = [(j, p) for j, job in enumerate(jobs) for p in job.parts]
    lens = np.fromiter((len(p.device_blocks) for _, p in parts), dtype=np.int64, count=len(parts))
    empty = np.zeros(0, dtype=np.int64)
    if not lens.sum():
        return BatchPlan(
            slot_rows=slot_rows,
            host_rows=empty,
            dev_blocks=empty,
            groups=empty,
            runs_host=empty,
            runs_pos=empty,
            runs_len=empty,
            run_bounds=np.zeros(1, dtype=np.int64),
            job_piece=np.full(len(jobs), -1, dtype=np.int64),
        )
    blocks = np.concatenate([p.device_blocks for _, p in parts])
    rows = np.concatenate([p.host_rows for _, p in parts])
    group = np.repeat(np.fromiter((p.group for _, p in parts), np.int64, len(parts)), lens)
    job = np.repeat(np.fromiter((j for j, _ in parts), np.int64, len(parts)), lens)
    order = np.lexsort((rows, group, job))
    blocks, rows, group, job = blocks[order], rows[order], group[order], job[order]
    n = len(rows)
    piece = np.arange(n, dtype=np.int64) // slot_rows
    # a run breaks where the next host row is not the next one, or a piece ends
    breaks = np.flatnonzero((np.diff(rows) != 1) | (np.diff(piece) != 0)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [n]))
    run_piece = piece[starts]
    num_pieces = int(piece[-1]) + 1
    run_bounds = np.searchsorted(run_piece, np.arange(num_pieces + 1), side="left")
    # the last staging position of each job (staging order is sorted by job)
    last = np.flatnonzero(np.diff(job, append=-1) != 0)
    job_piece = np.full(len(jobs), -1, dtype=np.int64)
    job_piece[job[last]] = piece[last]
    return BatchPlan(
        slot_rows=slot_rows,
        host_rows=rows,
        dev_blocks=blocks,
        groups=group,
        runs_host=rows[starts],
        runs_pos=starts.astype(np.int64),
        runs_len=(ends - starts).astype(np.int64),
        run_bounds=run_bounds.astype(np.int64),
        job_piece=job_piece,
    )


def page_table(
    plan: BatchPlan,
    templates: Sequence[PageTemplate],
    slot_bases: I64,
    row_stride: int,
    *,
    to_device: bool,
) -> tuple[I64, I64]:
    """The batch's pages as one int64 table ``[srcs | dsts | nbytes]`` (3 x pages), ordered
    by piece, and ``bounds`` (``bounds[k]:bounds[k+1]`` are the pages of piece ``k``).

    ``slot_bases[k]`` is the device address of the staging slot piece ``k`` uses.
    ``to_device``: a load (staging → engine blocks) rather than a store.
    """
    pos = np.arange(plan.num_rows, dtype=np.int64)
    piece = pos // plan.slot_rows
    staging_row = slot_bases[piece] + (pos % plan.slot_rows) * row_stride
    devs: list[I64] = []
    stags: list[I64] = []
    sizes: list[I64] = []
    pieces: list[I64] = []
    present = np.unique(plan.groups)
    for g in present.tolist():
        t = templates[g]
        sel = np.flatnonzero(plan.groups == g) if len(present) > 1 else pos
        devs.append((t.dev_offset + plan.dev_blocks[sel, None] * t.block_stride).ravel())
        stags.append((staging_row[sel, None] + t.row_offset).ravel())
        sizes.append(np.broadcast_to(t.nbytes, (len(sel), len(t))).ravel())
        pieces.append(np.repeat(piece[sel], len(t)))
    dev, stag, size, page_piece = (np.concatenate(x) for x in (devs, stags, sizes, pieces))
    if len(present) > 1:  # groups were laid out one after the other: order by piece
        order = np.argsort(page_piece, kind="stable")
        dev, stag, size, page_piece = dev[order], stag[order], size[order], page_piece[order]
    srcs, dsts = (stag, dev) if to_device else (dev, stag)
    table = np.concatenate((srcs, dsts, size))
    bounds = np.searchsorted(page_piece, np.arange(plan.num_pieces + 1), side="left")
    return table, bounds.astype(np.int64)


def element_bytes(table: I64) -> int:
    """The widest element (1, 2, 4 or 8 bytes) that divides every address and size."""
    bits = int(np.bitwise_or.reduce(table)) if len(table) else 8
    return min(8, bits & -bits) if bits else 8
