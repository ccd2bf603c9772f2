"""The page-copy kernel of the CUDA path (Triton): one launch moves every page of a piece.

``copy_pages(table, lo, hi, num_pages, elem_bytes)`` copies pages ``lo:hi`` of a table
``[srcs | dsts | nbytes]`` (see :mod:`._pages`) on the current stream. Each program takes
pages in turn (a persistent grid of at most :data:`MAX_PROGRAMS`), loads the page's two
addresses from the table and copies it ``BLOCK`` elements at a time, with the widest
element that divides every address and size of the table.

Imported only when the first piece is launched: ``triton.jit`` reads
``TRITON_INTERPRET`` when the kernel is defined, so a test machine without a GPU sets it
first and runs this same kernel on CPU tensors (raw addresses included).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

MAX_PROGRAMS = 1024
"""Programs per launch: enough to keep every SM of the device busy with a few pages."""

BLOCK_BYTES = 4096
"""Bytes one program moves per step of its loop (a page of 32 KiB takes 8 steps)."""

_DTYPES: dict[int, Any] = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


@triton.jit  # type: ignore[untyped-decorator]
def _copy_pages_kernel(  # type: ignore[no-untyped-def]
    srcs,
    dsts,
    sizes,
    num_pages,
    DT: tl.constexpr,
    ELEM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    offsets = tl.arange(0, BLOCK)
    page = pid
    while page < num_pages:
        src = tl.load(srcs + page).to(tl.pointer_type(DT))
        dst = tl.load(dsts + page).to(tl.pointer_type(DT))
        n = tl.load(sizes + page) // ELEM
        for start in range(0, n, BLOCK):
            idx = start + offsets
            mask = idx < n
            tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)
        page += step


def copy_pages(table: torch.Tensor, lo: int, hi: int, num_pages: int, elem_bytes: int) -> None:
    """Launch the kernel over pages ``lo:hi`` of ``table`` (3 x ``num_pages`` int64, on the
    device) on the current stream."""
    n = hi - lo
    if n <= 0:
        return
    _copy_pages_kernel[(min(n, MAX_PROGRAMS),)](
        table[lo:hi],
        table[num_pages + lo : num_pages + hi],
        table[2 * num_pages + lo : 2 * num_pages + hi],
        n,
        DT=_DTYPES[elem_bytes],
        ELEM=elem_bytes,
        BLOCK=BLOCK_BYTES // elem_bytes,
    )
