"""Copy plans: a job turned into ``(dst, src, size)`` byte descriptors, with numpy.

The CPU engine's unit of work. A job's pairs (engine block, host row) and the layout's
regions give, per block, one descriptor per run; descriptors that turn out adjacent on
both sides (consecutive blocks of a block-outermost layout going to consecutive rows)
are merged, so such a job costs a handful of long copies. Plans are then cut into
pieces of about ``piece_bytes`` so that several copy threads share one job and a
deadline can stop a job between pieces.

Addresses are raw pointers: every block id and host row is checked here, before any
byte moves (an out-of-range id raises :class:`IndexError`, it is never copied).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np
import numpy.typing as npt

from ._layout import KVLayout

if TYPE_CHECKING:
    from ._copy import CopyJob

I64 = npt.NDArray[np.int64]


@attrs.frozen(kw_only=True)
class Plan:
    """Descriptors (C-contiguous int64): copy ``sizes[i]`` bytes from ``srcs[i]`` to ``dsts[i]``."""

    dsts: I64 = attrs.field(eq=False)
    srcs: I64 = attrs.field(eq=False)
    sizes: I64 = attrs.field(eq=False)

    @property
    def nbytes(self) -> int:
        return int(self.sizes.sum())

    def __len__(self) -> int:
        return len(self.sizes)


def check_job(layout: KVLayout, job: CopyJob, num_rows: int, row_bytes: int) -> None:
    """Raise if ``job`` names a group, engine block or host row that does not exist."""
    for part in job.parts:
        if not 0 <= part.group < len(layout.groups):
            raise IndexError(f"job {job.job_id}: no KV-cache group {part.group}")
        if layout.groups[part.group].row_bytes > row_bytes:
            raise ValueError(
                f"job {job.job_id}: group {part.group} needs {layout.groups[part.group].row_bytes} "
                f"bytes per row, the host rows hold {row_bytes}"
            )
        if len(part.host_rows) and (part.host_rows.min() < 0 or part.host_rows.max() >= num_rows):
            raise IndexError(f"job {job.job_id}: host rows outside 0..{num_rows - 1}")
        blocks = part.device_blocks
        if len(blocks) and (blocks.min() < 0 or blocks.max() >= layout.num_blocks):
            raise IndexError(f"job {job.job_id}: engine blocks outside 0..{layout.num_blocks - 1}")


def check_batch(
    layout: KVLayout, jobs: Sequence[CopyJob], num_rows: int, row_bytes: int
) -> list[Exception | None]:
    """:func:`check_job` of every job of a batch, in a few numpy operations over the whole
    batch when every job is good; job by job only to name what is wrong with a bad one.
    One entry per job: ``None``, or the error :func:`check_job` raises."""
    parts = [p for job in jobs for p in job.parts]
    groups = layout.groups
    good = all(0 <= p.group < len(groups) and groups[p.group].row_bytes <= row_bytes for p in parts)
    if good and parts:
        blocks = np.concatenate([p.device_blocks for p in parts])
        rows = np.concatenate([p.host_rows for p in parts])
        if len(blocks):
            good = (
                int(blocks.min()) >= 0
                and int(blocks.max()) < layout.num_blocks
                and int(rows.min()) >= 0
                and int(rows.max()) < num_rows
            )
    if good:
        return [None] * len(jobs)
    errors: list[Exception | None] = []
    for job in jobs:
        try:
            check_job(layout, job, num_rows, row_bytes)
        except (IndexError, ValueError) as exc:
            errors.append(exc)
        else:
            errors.append(None)
    return errors


def plan_job(layout: KVLayout, job: CopyJob, host_base: int, host_row_stride: int) -> Plan:
    """Descriptors of ``job`` against host rows at ``host_base + row * host_row_stride``.

    Descriptors are ordered block by block, each block's runs in host-row order, then
    merged where adjacent on both sides. The caller has run :func:`check_job`.
    """
    devs: list[I64] = []
    hosts: list[I64] = []
    sizes: list[I64] = []
    for part in job.parts:
        n = len(part.device_blocks)
        regions = layout.groups[part.group].regions
        if n == 0 or not regions:
            continue
        if len(regions) == 1 and regions[0].count == 1:  # block-outermost: one run per block
            r = regions[0]
            devs.append(r.view.data_ptr() + part.device_blocks * r.block_stride)
            hosts.append(host_base + r.offset + part.host_rows * host_row_stride)
            sizes.append(np.full(n, r.nbytes, dtype=np.int64))
            continue
        dev_cols: list[I64] = []
        host_cols: list[I64] = []
        size_cols: list[I64] = []
        blocks = part.device_blocks[:, None]
        rows = part.host_rows[:, None]
        for r in regions:
            items = np.arange(r.count, dtype=np.int64)[None, :]
            dev_cols.append(r.view.data_ptr() + blocks * r.block_stride + items * r.item_stride)
            host_cols.append(host_base + rows * host_row_stride + r.offset + items * r.nbytes)
            size_cols.append(np.full((n, r.count), r.nbytes, dtype=np.int64))
        devs.append(np.concatenate(dev_cols, axis=1).ravel())
        hosts.append(np.concatenate(host_cols, axis=1).ravel())
        sizes.append(np.concatenate(size_cols, axis=1).ravel())
    if not sizes:
        empty = np.zeros(0, dtype=np.int64)
        return Plan(dsts=empty, srcs=empty, sizes=empty)
    if len(sizes) == 1:
        dev, host, size = devs[0], hosts[0], sizes[0]
    else:
        dev, host, size = np.concatenate(devs), np.concatenate(hosts), np.concatenate(sizes)
    if job.direction == "store":
        return _merged(dsts=host, srcs=dev, sizes=size)
    return _merged(dsts=dev, srcs=host, sizes=size)


def _merged(*, dsts: I64, srcs: I64, sizes: I64) -> Plan:
    if len(sizes) > 1:
        ends_d, ends_s = dsts[:-1] + sizes[:-1], srcs[:-1] + sizes[:-1]
        starts = np.flatnonzero((ends_d != dsts[1:]) | (ends_s != srcs[1:])) + 1
        starts = np.concatenate(([0], starts))
        if len(starts) < len(sizes):
            sizes = np.add.reduceat(sizes, starts)
            dsts, srcs = dsts[starts], srcs[starts]
    c = np.ascontiguousarray
    return Plan(dsts=c(dsts, np.int64), srcs=c(srcs, np.int64), sizes=c(sizes, np.int64))


def split_plan(plan: Plan, piece_bytes: int) -> list[Plan]:
    """Cut ``plan`` into pieces of about ``piece_bytes`` (at most twice that), cutting
    descriptors longer than ``piece_bytes`` first."""
    if piece_bytes <= 0:
        raise ValueError("piece_bytes must be > 0")
    if len(plan) == 0:
        return []
    if plan.nbytes <= piece_bytes:  # the common case: a job is one piece
        return [plan]
    return _cut(plan, piece_bytes)


def _cut(plan: Plan, piece_bytes: int) -> list[Plan]:
    dsts, srcs, sizes = plan.dsts, plan.srcs, plan.sizes
    if sizes.max() > piece_bytes:
        reps = -(-sizes // piece_bytes)
        idx = np.repeat(np.arange(len(sizes)), reps)
        within = np.arange(len(idx)) - np.repeat(np.cumsum(reps) - reps, reps)
        off = within * piece_bytes
        dsts, srcs = dsts[idx] + off, srcs[idx] + off
        sizes = np.minimum(piece_bytes, sizes[idx] - off)
    start_bytes = np.cumsum(sizes) - sizes
    piece = start_bytes // piece_bytes
    cuts = np.flatnonzero(np.diff(piece)) + 1
    bounds = [0, *cuts.tolist(), len(sizes)]
    c = np.ascontiguousarray
    return [
        Plan(dsts=c(dsts[a:b]), srcs=c(srcs[a:b]), sizes=c(sizes[a:b]))
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
