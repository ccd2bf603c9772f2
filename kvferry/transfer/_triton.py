"""The page-copy kernel of the CUDA path (Triton): one launch moves every page of a piece.

``copy_rows(rows, lo, hi, num_rows, templates, max_pages, elem_bytes, to_device,
row_programs)`` copies rows ``lo:hi`` of a row table ``[engine blocks | row addresses |
template starts | page counts]`` (see :mod:`._pages`) on the current stream. A row
address is a staging slot's row (the staged path) or the pinned host row itself (the
direct path: the kernel then reads or writes host memory over the link). Program
``(p, r)`` takes page ``p`` of its rows ``r, r + step, ...`` (``step``: the programs
along the rows, at most ``row_programs``): the page's engine address is the template's
offset plus the block times the template's block stride, its row address the row's
plus the template's row offset. It copies ``BLOCK`` elements at a time, with the widest
element that divides every address and size the engine can produce.

Imported only when the first piece is launched. On CPU tensors (the fake device of
:mod:`kvferry.testing`) the same kernel runs in Triton's interpreter, raw addresses
included, whatever ``TRITON_INTERPRET`` says: that is how its logic is tested on a
machine without a GPU.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

MAX_ROW_PROGRAMS = 1024
"""Programs along the rows of one launch (each then loops over its share of rows)."""

BLOCK_BYTES = 4096
"""Bytes one program moves per step of its loop (a page of 32 KiB takes 8 steps)."""

_DTYPES: dict[int, Any] = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


def _copy_rows(  # type: ignore[no-untyped-def]
    table,
    lo,
    num_rows,
    total_rows,
    templates,
    num_templates,
    TO_DEVICE: tl.constexpr,
    DT: tl.constexpr,
    ELEM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    page = tl.program_id(0)
    row = tl.program_id(1)
    step = tl.num_programs(1)
    offsets = tl.arange(0, BLOCK)
    while row < num_rows:
        r = lo + row  # the table's columns: blocks, row addresses, template starts, counts
        if page < tl.load(table + 3 * total_rows + r):
            t = tl.load(table + 2 * total_rows + r) + page
            dev = tl.load(templates + t) + tl.load(table + r) * tl.load(
                templates + num_templates + t
            )
            stag = tl.load(table + total_rows + r) + tl.load(templates + 2 * num_templates + t)
            n = tl.load(templates + 3 * num_templates + t) // ELEM
            if TO_DEVICE:
                src = stag.to(tl.pointer_type(DT))
                dst = dev.to(tl.pointer_type(DT))
            else:
                src = dev.to(tl.pointer_type(DT))
                dst = stag.to(tl.pointer_type(DT))
            for start in range(0, n, BLOCK):
                idx = start + offsets
                mask = idx < n
                tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)
        row += step


# The row counts and offsets change from launch to launch: specializing on them (on a
# value of 1, or on divisibility by 16) would cost a check per argument per launch and a
# compilation per new combination.
_compiled = triton.jit(
    _copy_rows, do_not_specialize=["lo", "num_rows", "total_rows", "num_templates"]
)


def _interpreted() -> Any:
    from triton.runtime.interpreter import InterpretedFunction

    global _interpreted_kernel
    if _interpreted_kernel is None:
        _interpreted_kernel = InterpretedFunction(_copy_rows)
    return _interpreted_kernel


_interpreted_kernel: Any = None


def copy_rows(
    rows: torch.Tensor,
    lo: int,
    hi: int,
    num_rows: int,
    templates: torch.Tensor,
    max_pages: int,
    elem_bytes: int,
    to_device: bool,
    row_programs: int = MAX_ROW_PROGRAMS,
) -> None:
    """Launch the kernel over rows ``lo:hi`` of ``rows`` (4 x ``num_rows`` int64) with
    ``templates`` (4 x pages int64, flat), both on the device, on the current stream;
    at most ``row_programs`` programs along the rows."""
    n = hi - lo
    if n <= 0 or max_pages <= 0:
        return
    # CPU tensors (the tests' fake device): Triton's interpreter runs the same kernel
    kernel = _compiled if rows.device.type == "cuda" else _interpreted()
    kernel[(max_pages, max(1, min(n, row_programs)))](
        rows,  # the whole table: no views to make per launch
        lo,
        n,
        num_rows,
        templates,
        templates.numel() // 4,
        TO_DEVICE=to_device,
        DT=_DTYPES[elem_bytes],
        ELEM=elem_bytes,
        BLOCK=BLOCK_BYTES // elem_bytes,
    )
