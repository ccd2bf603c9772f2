"""Page tables of a step batch: the device side of the CUDA path, planned with numpy.

A *page* is one contiguous run of bytes of one engine block (one item of a
:class:`~kvferry.transfer.Region`, cut to at most :data:`MAX_PAGE_BYTES`). A copy kernel
moves every page of a batch between the engine's KV tensors and a device *staging* slot
laid out exactly like host rows, so the host link only sees contiguous runs of rows.

Per KV-cache group, the pages of one block are a fixed :class:`PageTemplate` (offsets,
block strides, sizes), computed once when the engine starts and uploaded to the device
once (:class:`Templates`). A batch's table then holds a few words per *row* (engine
block, staging address, its group's template), built with a handful of numpy operations,
whatever the number of layers, regions and jobs: no Python loop per block, region or job,
and nothing per page; the kernel finds each page from its row and the template.

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


def _batch_rows(jobs: Sequence[CopyJob]) -> tuple[I64, I64, I64, I64, I64]:
    """Every row of ``jobs`` in submission order (engine blocks, host rows, groups), and
    per part its job and its number of rows."""
    parts = [(j, p) for j, job in enumerate(jobs) for p in job.parts]
    k = len(parts)
    lens = np.fromiter((len(p.device_blocks) for _, p in parts), np.int64, k)
    owners = np.fromiter((j for j, _ in parts), np.int64, k)
    if not lens.sum():
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, owners, lens
    blocks = np.concatenate([p.device_blocks for _, p in parts])
    rows = np.concatenate([p.host_rows for _, p in parts])
    group = np.repeat(np.fromiter((p.group for _, p in parts), np.int64, k), lens)
    return blocks, rows, group, owners, lens


def _plan(
    slot_rows: int,
    rows: I64,
    blocks: I64,
    group: I64,
    job_piece: I64,
    runs: tuple[I64, I64, I64, I64] | None = None,
) -> BatchPlan:
    """A plan without runs (``runs`` None), or with ``runs`` = (host, pos, len, bounds)."""
    empty = np.zeros(0, dtype=np.int64)
    return BatchPlan(
        slot_rows=slot_rows,
        host_rows=rows,
        dev_blocks=blocks,
        groups=group,
        runs_host=empty if runs is None else runs[0],
        runs_pos=empty if runs is None else runs[1],
        runs_len=empty if runs is None else runs[2],
        run_bounds=np.zeros(1, dtype=np.int64) if runs is None else runs[3],
        job_piece=job_piece,
    )


def plan_batch(jobs: Sequence[CopyJob], slot_rows: int) -> BatchPlan:
    """Lay ``jobs`` (already checked) out in staging order, in pieces of ``slot_rows``."""
    if slot_rows <= 0:
        raise ValueError(f"slot_rows must be > 0, got {slot_rows}")
    blocks, rows, group, owners, lens = _batch_rows(jobs)
    n = len(rows)
    if not n:
        return _plan(slot_rows, rows, blocks, group, np.full(len(jobs), -1, dtype=np.int64))
    job = np.repeat(owners, lens)
    if len(jobs) < 1 << 15 and int(rows.max()) < 1 << 40 and int(group.max()) < 1 << 8:
        # one int64 sort key: job, then group, then host row
        order = np.argsort((job << 48) | (group << 40) | rows, kind="stable")
    else:
        order = np.lexsort((rows, group, job))
    blocks, rows, group, job = blocks[order], rows[order], group[order], job[order]
    piece = np.arange(n, dtype=np.int64) // slot_rows
    # a run breaks where the next host row is not the next one, or a piece ends
    step = rows[1:] - rows[:-1]
    breaks = np.flatnonzero((step != 1) | (piece[1:] != piece[:-1])) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [n]))
    num_pieces = int(piece[-1]) + 1
    run_bounds = np.searchsorted(piece[starts], np.arange(num_pieces + 1), side="left")
    # the last staging position of each job (staging order is sorted by job)
    last = np.concatenate((np.flatnonzero(job[1:] != job[:-1]), [n - 1]))
    job_piece = np.full(len(jobs), -1, dtype=np.int64)
    job_piece[job[last]] = piece[last]
    runs = (
        rows[starts],
        starts.astype(np.int64),
        (ends - starts).astype(np.int64),
        run_bounds.astype(np.int64),
    )
    return _plan(slot_rows, rows, blocks, group, job_piece, runs)


def plan_rows(jobs: Sequence[CopyJob]) -> BatchPlan:
    """``jobs`` (already checked) as one piece in submission order, without runs: the
    direct path's plan (its kernel reaches every host row itself, so neither the order of
    host rows nor their runs matter)."""
    blocks, rows, group, owners, lens = _batch_rows(jobs)
    job_piece = np.full(len(jobs), -1, dtype=np.int64)
    job_piece[owners[lens > 0]] = 0
    return _plan(max(1, len(rows)), rows, blocks, group, job_piece)


@attrs.frozen(kw_only=True)
class Templates:
    """Every group's :class:`PageTemplate` in one ``(4, pages)`` int64 table (device
    offsets, block strides, row offsets, sizes), uploaded to the device once; group ``g``
    owns columns ``start[g] : start[g] + count[g]``."""

    table: I64 = attrs.field(eq=False)
    start: I64 = attrs.field(eq=False)
    count: I64 = attrs.field(eq=False)

    @classmethod
    def of(cls, templates: Sequence[PageTemplate]) -> Templates:
        count = np.array([len(t) for t in templates], dtype=np.int64)
        start = np.concatenate(([0], np.cumsum(count)[:-1])).astype(np.int64)
        table = np.stack(
            [
                np.concatenate([t.dev_offset for t in templates]),
                np.concatenate([t.block_stride for t in templates]),
                np.concatenate([t.row_offset for t in templates]),
                np.concatenate([t.nbytes for t in templates]),
            ]
        ).astype(np.int64)
        return cls(table=np.ascontiguousarray(table), start=start, count=count)

    @property
    def max_pages(self) -> int:
        return int(self.count.max()) if len(self.count) else 0


def row_table(
    plan: BatchPlan,
    templates: Templates,
    slot_bases: I64 | None,
    row_stride: int,
    out: I64,
    *,
    host_base: int | None = None,
) -> None:
    """Fill ``out`` (4 x rows int64, e.g. a pinned buffer) with the batch's rows in staging
    order: ``[engine blocks | row addresses | template starts | page counts]``.

    The row address is where the kernel reads or writes the row: with ``slot_bases``
    (``slot_bases[k]`` the device address of the staging slot piece ``k`` uses), the row's
    place in its slot; with ``host_base`` instead (the direct path), the host row itself,
    ``host_base + host_row * row_stride``. The kernel finds every page of a row from the
    row and its group's template, so the table is a few words a row whatever the number
    of layers.
    """
    n = plan.num_rows
    if len(out) != 4 * n:
        raise ValueError(f"out holds {len(out)} entries, the row table needs {4 * n}")
    out[:n] = plan.dev_blocks
    if host_base is not None:
        np.multiply(plan.host_rows, row_stride, out=out[n : 2 * n])
        out[n : 2 * n] += host_base
    elif slot_bases is not None:
        pos = np.arange(n, dtype=np.int64)
        np.add(
            slot_bases[pos // plan.slot_rows],
            (pos % plan.slot_rows) * row_stride,
            out=out[n : 2 * n],
        )
    else:
        raise ValueError("row_table needs slot_bases or host_base")
    if len(templates.count) == 1:
        out[2 * n : 3 * n] = templates.start[0]
        out[3 * n :] = templates.count[0]
    else:
        out[2 * n : 3 * n] = templates.start[plan.groups]
        out[3 * n :] = templates.count[plan.groups]


def element_bytes(table: I64) -> int:
    """The widest element (1, 2, 4 or 8 bytes) that divides every address and size."""
    bits = int(np.bitwise_or.reduce(table)) if len(table) else 8
    return min(8, bits & -bits) if bits else 8
