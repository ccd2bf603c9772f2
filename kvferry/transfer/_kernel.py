"""The batched copy kernel of the CPU path: ``copy_batch(dsts, srcs, sizes)``.

One call copies many ``(dst, src, size)`` descriptors (vLLM's ``swap_blocks_batch`` has
the same shape), so a job of thousands of layer-blocks costs one call, not thousands of
Python-level copies. Two implementations, same contract:

- a JIT-compiled kernel (LLVM IR through ``llvmlite``, the compiler under numba that
  vLLM installs): descriptors of at least :data:`NT_MIN_BYTES` are written with
  non-temporal (streaming) stores, 8 KiB at a time as two interleaved 4 KiB streams
  with software prefetch (the loop of glibc's own large ``memcpy``). Streaming stores
  skip the read-for-ownership of every destination line: that is what lets a
  chunk-sized copy reach the bandwidth of one large ``memcpy`` — glibc takes that path
  only above ~3/4 of the L3 size (99 MiB on the benchmark machine), far above a chunk,
  and a plain ``memmove`` per chunk measured ~0.65 of it. For batches of short
  scattered runs (vLLM-CPU's per-layer runs of a few KiB), whose cost is the latency
  of each run's first misses rather than bandwidth, each descriptor prefetches the
  start of the one :data:`PREFETCH_AHEAD` further on, and two short descriptors of
  one size are copied together (:data:`PAIR_MAX_BYTES`). It ends with a full fence, so
  the bytes are visible before the copy thread reports the job done.
- a fallback (``ctypes.memmove`` per descriptor) where ``llvmlite`` is missing or the
  JIT fails: correct, slower on small descriptors.

Both release the GIL while copying (``ctypes`` foreign calls drop it). Descriptors must
not overlap; the caller guarantees every address is inside a live allocation.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from .._logging import get_logger

NT_MIN_BYTES = 1024
"""Descriptors below this are copied with plain stores (for a few cache lines streaming
gains nothing; from 1 KiB it measured 20–40% faster on scattered runs)."""

PREFETCH_AHEAD = 2
"""While copying descriptor ``i``, prefetch descriptor ``i + PREFETCH_AHEAD``. Scattered
short runs (vLLM-CPU's per-layer runs of a few KiB, each in another page of a
small-page KV cache) otherwise start each with a TLB miss and a DRAM round trip that
the hardware prefetchers, which stop at page boundaries, do not hide. Measured on
16 KiB chunks of 8 layers (2 KiB runs), single-threaded, CPU time: 2 ahead lifted
stores from 0.61 to 0.70-0.73 of memcpy and loads from 0.53 to 0.80; 1, 4 and 8 ahead
did no better."""

PREFETCH_LINES = 8
"""Cache lines of the source prefetched per descriptor (fewer when it is shorter); the
hardware streamer takes over from there. 16 or 32 lines measured worse than 8 (they
crowd the fill buffers)."""

PAIR_MAX_BYTES = 8192
"""Two consecutive streaming descriptors of one size below this (and 64-byte aligned
destinations, the size a multiple of 256) are copied together, a line of each in turn:
twice the lines in flight. On the 2 KiB runs above it lifted stores from 0.68 to about
0.75 of memcpy (loads stayed at about 0.77); three or four at once did no better. From
8 KiB the two-pages-at-once loop of a single descriptor does the same."""

BatchKernel = Callable[[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]], None]

_IR = r"""
declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)
declare void @llvm.prefetch.p0(ptr, i32, i32, i32)

; Prefetch descriptor j, if there is one: its destination's first line (with intent to
; write: the page walk of a scattered destination is done before its stores need it)
; and the first pf_lines lines of its source (at most its size), so that scattered short
; runs do not each start with a TLB miss and a DRAM round trip.
define internal void @prefetch_desc(ptr %dsts, ptr %srcs, ptr %sizes, i64 %count, i64 %j,
                                    i64 %pf_lines) alwaysinline {
entry:
  %in = icmp ult i64 %j, %count
  br i1 %in, label %pf, label %done
pf:
  %pd = getelementptr i64, ptr %dsts, i64 %j
  %ps = getelementptr i64, ptr %srcs, i64 %j
  %pn = getelementptr i64, ptr %sizes, i64 %j
  %da = load i64, ptr %pd
  %sa = load i64, ptr %ps
  %n = load i64, ptr %pn
  %d = inttoptr i64 %da to ptr
  %s = inttoptr i64 %sa to ptr
  call void @llvm.prefetch.p0(ptr %d, i32 1, i32 3, i32 1)
  %n63 = add i64 %n, 63
  %all = lshr i64 %n63, 6
  %few = icmp ult i64 %all, %pf_lines
  %lines = select i1 %few, i64 %all, i64 %pf_lines
  br label %loop
loop:
  %q = phi i64 [0, %pf], [%q.next, %body]
  %more = icmp ult i64 %q, %lines
  br i1 %more, label %body, label %done
body:
  %off = shl i64 %q, 6
  %a = getelementptr i8, ptr %s, i64 %off
  call void @llvm.prefetch.p0(ptr %a, i32 0, i32 3, i32 1)
  %q.next = add i64 %q, 1
  br label %loop
done:
  ret void
}

define void @copy_batch(ptr %dsts, ptr %srcs, ptr %sizes, i64 %count, i64 %nt_min,
                        i64 %ahead, i64 %pf_lines, i64 %pair_max) {
entry:
  %empty = icmp eq i64 %count, 0
  %pf.on = icmp ne i64 %ahead, 0
  br i1 %empty, label %done, label %desc
desc:
  %i = phi i64 [0, %entry], [%i.next, %next], [%i.pair.next, %pair.done]
  %dp = getelementptr i64, ptr %dsts, i64 %i
  %sp = getelementptr i64, ptr %srcs, i64 %i
  %np = getelementptr i64, ptr %sizes, i64 %i
  %da = load i64, ptr %dp
  %sa = load i64, ptr %sp
  %n = load i64, ptr %np
  %d = inttoptr i64 %da to ptr
  %s = inttoptr i64 %sa to ptr
  br i1 %pf.on, label %pf, label %go
pf:
  %jj = add i64 %i, %ahead
  call void @prefetch_desc(ptr %dsts, ptr %srcs, ptr %sizes, i64 %count, i64 %jj,
                           i64 %pf_lines)
  br label %go
go:
  %big = icmp uge i64 %n, %nt_min
  br i1 %big, label %pair.check, label %plain
plain:
  call void @llvm.memcpy.p0.p0.i64(ptr %d, ptr %s, i64 %n, i1 false)
  br label %next
pair.check:
  ; a descriptor shorter than pair_max followed by one of the same size, both
  ; destinations 64-byte aligned and the size a multiple of 256: copy the two together,
  ; 256 bytes of each per step, so that twice as many lines are in flight as with one
  ; stream (short scattered runs are bound by latency, not bandwidth)
  %i1 = add i64 %i, 1
  %has1 = icmp ult i64 %i1, %count
  %short = icmp ult i64 %n, %pair_max
  %pair.maybe = and i1 %has1, %short
  br i1 %pair.maybe, label %pair.load, label %head
pair.load:
  %dp1 = getelementptr i64, ptr %dsts, i64 %i1
  %sp1 = getelementptr i64, ptr %srcs, i64 %i1
  %np1 = getelementptr i64, ptr %sizes, i64 %i1
  %da1 = load i64, ptr %dp1
  %sa1 = load i64, ptr %sp1
  %n1 = load i64, ptr %np1
  %same = icmp eq i64 %n1, %n
  %dor = or i64 %da, %da1
  %dmis = and i64 %dor, 63
  %nmis = and i64 %n, 255
  %pair.mis = or i64 %dmis, %nmis
  %aligned = icmp eq i64 %pair.mis, 0
  %pair.ok = and i1 %same, %aligned
  br i1 %pair.ok, label %pair, label %head
pair:
  br i1 %pf.on, label %pair.pf, label %pair.start
pair.pf:
  %jj1 = add i64 %i1, %ahead
  call void @prefetch_desc(ptr %dsts, ptr %srcs, ptr %sizes, i64 %count, i64 %jj1,
                           i64 %pf_lines)
  br label %pair.start
pair.start:
  %pd1 = inttoptr i64 %da1 to ptr
  %ps1 = inttoptr i64 %sa1 to ptr
  %steps = lshr i64 %n, 8
  br label %pair.loop
pair.loop:
  %r = phi i64 [0, %pair.start], [%r.next, %pair.body]
  %pair.more = icmp ult i64 %r, %steps
  br i1 %pair.more, label %pair.body, label %pair.done
pair.body:
  %ro = shl i64 %r, 8
  %sa0 = getelementptr i8, ptr %s, i64 %ro
  %sb0 = getelementptr i8, ptr %ps1, i64 %ro
  %da0 = getelementptr i8, ptr %d, i64 %ro
  %db0 = getelementptr i8, ptr %pd1, i64 %ro
  %sa.1 = getelementptr i8, ptr %sa0, i64 64
  %sa.2 = getelementptr i8, ptr %sa0, i64 128
  %sa.3 = getelementptr i8, ptr %sa0, i64 192
  %sb.1 = getelementptr i8, ptr %sb0, i64 64
  %sb.2 = getelementptr i8, ptr %sb0, i64 128
  %sb.3 = getelementptr i8, ptr %sb0, i64 192
  %da.1 = getelementptr i8, ptr %da0, i64 64
  %da.2 = getelementptr i8, ptr %da0, i64 128
  %da.3 = getelementptr i8, ptr %da0, i64 192
  %db.1 = getelementptr i8, ptr %db0, i64 64
  %db.2 = getelementptr i8, ptr %db0, i64 128
  %db.3 = getelementptr i8, ptr %db0, i64 192
  %wa0 = load <8 x i64>, ptr %sa0, align 1
  %wb0 = load <8 x i64>, ptr %sb0, align 1
  %wa1 = load <8 x i64>, ptr %sa.1, align 1
  %wb1 = load <8 x i64>, ptr %sb.1, align 1
  %wa2 = load <8 x i64>, ptr %sa.2, align 1
  %wb2 = load <8 x i64>, ptr %sb.2, align 1
  %wa3 = load <8 x i64>, ptr %sa.3, align 1
  %wb3 = load <8 x i64>, ptr %sb.3, align 1
  store <8 x i64> %wa0, ptr %da0, align 64, !nontemporal !0
  store <8 x i64> %wb0, ptr %db0, align 64, !nontemporal !0
  store <8 x i64> %wa1, ptr %da.1, align 64, !nontemporal !0
  store <8 x i64> %wb1, ptr %db.1, align 64, !nontemporal !0
  store <8 x i64> %wa2, ptr %da.2, align 64, !nontemporal !0
  store <8 x i64> %wb2, ptr %db.2, align 64, !nontemporal !0
  store <8 x i64> %wa3, ptr %da.3, align 64, !nontemporal !0
  store <8 x i64> %wb3, ptr %db.3, align 64, !nontemporal !0
  %r.next = add i64 %r, 1
  br label %pair.loop
pair.done:
  %i.pair.next = add i64 %i, 2
  %pair.again = icmp ult i64 %i.pair.next, %count
  br i1 %pair.again, label %desc, label %done
head:
  ; plain bytes until the destination is 64-byte aligned (streaming stores need it)
  %mis = and i64 %da, 63
  %lead = sub i64 64, %mis
  %h = and i64 %lead, 63
  call void @llvm.memcpy.p0.p0.i64(ptr %d, ptr %s, i64 %h, i1 false)
  %rest = sub i64 %n, %h
  %d1 = getelementptr i8, ptr %d, i64 %h
  %s1 = getelementptr i8, ptr %s, i64 %h
  ; 8 KiB at a time: 256 bytes from each of two pages 4 KiB apart per step, as
  ; glibc's large memcpy does (two DRAM streams in flight), prefetching ahead
  %pairs = lshr i64 %rest, 13
  br label %outer
outer:
  %p = phi i64 [0, %head], [%p.next, %outer.end]
  %pm = icmp ult i64 %p, %pairs
  br i1 %pm, label %outer.body, label %lines.start
outer.body:
  %pbase = shl i64 %p, 13
  %ps = getelementptr i8, ptr %s1, i64 %pbase
  %pd = getelementptr i8, ptr %d1, i64 %pbase
  br label %inner
inner:
  %k = phi i64 [0, %outer.body], [%k.next, %inner]
  %off = shl i64 %k, 8
  %a0 = getelementptr i8, ptr %ps, i64 %off
  %b0 = getelementptr i8, ptr %a0, i64 4096
  %x0 = getelementptr i8, ptr %pd, i64 %off
  %y0 = getelementptr i8, ptr %x0, i64 4096
  %pfa = getelementptr i8, ptr %a0, i64 256
  %pfa2 = getelementptr i8, ptr %a0, i64 512
  %pfb = getelementptr i8, ptr %b0, i64 256
  %pfb2 = getelementptr i8, ptr %b0, i64 512
  call void @llvm.prefetch.p0(ptr %pfa, i32 0, i32 3, i32 1)
  call void @llvm.prefetch.p0(ptr %pfa2, i32 0, i32 3, i32 1)
  call void @llvm.prefetch.p0(ptr %pfb, i32 0, i32 3, i32 1)
  call void @llvm.prefetch.p0(ptr %pfb2, i32 0, i32 3, i32 1)
  %a1 = getelementptr i8, ptr %a0, i64 64
  %a2 = getelementptr i8, ptr %a0, i64 128
  %a3 = getelementptr i8, ptr %a0, i64 192
  %b1 = getelementptr i8, ptr %b0, i64 64
  %b2 = getelementptr i8, ptr %b0, i64 128
  %b3 = getelementptr i8, ptr %b0, i64 192
  %x1 = getelementptr i8, ptr %x0, i64 64
  %x2 = getelementptr i8, ptr %x0, i64 128
  %x3 = getelementptr i8, ptr %x0, i64 192
  %y1 = getelementptr i8, ptr %y0, i64 64
  %y2 = getelementptr i8, ptr %y0, i64 128
  %y3 = getelementptr i8, ptr %y0, i64 192
  %va0 = load <8 x i64>, ptr %a0, align 1
  %va1 = load <8 x i64>, ptr %a1, align 1
  %va2 = load <8 x i64>, ptr %a2, align 1
  %va3 = load <8 x i64>, ptr %a3, align 1
  %vb0 = load <8 x i64>, ptr %b0, align 1
  %vb1 = load <8 x i64>, ptr %b1, align 1
  %vb2 = load <8 x i64>, ptr %b2, align 1
  %vb3 = load <8 x i64>, ptr %b3, align 1
  store <8 x i64> %va0, ptr %x0, align 64, !nontemporal !0
  store <8 x i64> %va1, ptr %x1, align 64, !nontemporal !0
  store <8 x i64> %va2, ptr %x2, align 64, !nontemporal !0
  store <8 x i64> %va3, ptr %x3, align 64, !nontemporal !0
  store <8 x i64> %vb0, ptr %y0, align 64, !nontemporal !0
  store <8 x i64> %vb1, ptr %y1, align 64, !nontemporal !0
  store <8 x i64> %vb2, ptr %y2, align 64, !nontemporal !0
  store <8 x i64> %vb3, ptr %y3, align 64, !nontemporal !0
  %k.next = add i64 %k, 1
  %km = icmp ult i64 %k.next, 16
  br i1 %km, label %inner, label %outer.end
outer.end:
  %p.next = add i64 %p, 1
  br label %outer
lines.start:
  ; what is left: 64 bytes per step, then plain bytes
  %pdone = shl i64 %pairs, 13
  %rem = sub i64 %rest, %pdone
  %d2 = getelementptr i8, ptr %d1, i64 %pdone
  %s2 = getelementptr i8, ptr %s1, i64 %pdone
  %lines = lshr i64 %rem, 6
  br label %loop
loop:
  %j = phi i64 [0, %lines.start], [%j.next, %body]
  %more = icmp ult i64 %j, %lines
  br i1 %more, label %body, label %tail
body:
  %o = shl i64 %j, 6
  %from = getelementptr i8, ptr %s2, i64 %o
  %to = getelementptr i8, ptr %d2, i64 %o
  %v = load <8 x i64>, ptr %from, align 1
  store <8 x i64> %v, ptr %to, align 64, !nontemporal !0
  %j.next = add i64 %j, 1
  br label %loop
tail:
  %copied = shl i64 %lines, 6
  %left = sub i64 %rem, %copied
  %d3 = getelementptr i8, ptr %d2, i64 %copied
  %s3 = getelementptr i8, ptr %s2, i64 %copied
  call void @llvm.memcpy.p0.p0.i64(ptr %d3, ptr %s3, i64 %left, i1 false)
  br label %next
next:
  %i.next = add i64 %i, 1
  %again = icmp ult i64 %i.next, %count
  br i1 %again, label %desc, label %done
done:
  fence seq_cst
  ret void
}

!0 = !{i32 1}
"""

_lock = threading.Lock()
_jit: tuple[Any, Callable[..., None]] | None = None
_jit_failed = False


def _compile() -> tuple[Any, Callable[..., None]]:
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    module = llvm.parse_assembly(_IR)
    module.verify()
    target = llvm.Target.from_default_triple()
    machine = target.create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3
    )
    engine = llvm.create_mcjit_compiler(module, machine)
    engine.finalize_object()
    address = engine.get_function_address("copy_batch")
    i64 = ctypes.c_int64
    proto = ctypes.CFUNCTYPE(
        None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, i64, i64, i64, i64, i64
    )
    # The engine owns the machine code: it is kept beside the function for the process.
    return engine, proto(address)


def _jit_function() -> Callable[..., None] | None:
    global _jit, _jit_failed
    with _lock:
        if _jit is None and not _jit_failed:
            try:
                _jit = _compile()
            except Exception as exc:  # no llvmlite, or an LLVM too old for opaque pointers
                _jit_failed = True
                get_logger("kvferry.transfer").warning(
                    "copy_kernel_fallback", reason=repr(exc), kernel="memmove"
                )
        return None if _jit is None else _jit[1]


def _check(
    dsts: npt.NDArray[np.int64], srcs: npt.NDArray[np.int64], sizes: npt.NDArray[np.int64]
) -> None:
    for a in (dsts, srcs, sizes):
        if a.dtype != np.int64 or not a.flags.c_contiguous:
            raise TypeError("descriptors must be C-contiguous int64 arrays")
    if not (dsts.shape == srcs.shape == sizes.shape):
        raise ValueError("dsts, srcs and sizes differ in length")


def jit_kernel(
    *,
    prefetch_ahead: int = PREFETCH_AHEAD,
    prefetch_lines: int = PREFETCH_LINES,
    pair_max_bytes: int = PAIR_MAX_BYTES,
) -> BatchKernel:
    """The JIT kernel, tuned (``prefetch_ahead=0, pair_max_bytes=0``: the kernel as it
    was before either existed, which benchmarks compare with in the same run).

    Raises :class:`RuntimeError` where the JIT kernel is unavailable.
    """
    if min(prefetch_ahead, prefetch_lines, pair_max_bytes) < 0:
        raise ValueError("prefetch_ahead, prefetch_lines and pair_max_bytes must be >= 0")
    fn = _jit_function()
    if fn is None:
        raise RuntimeError("the JIT copy kernel is unavailable (see the copy_kernel_fallback log)")
    jit = fn

    def kernel(
        dsts: npt.NDArray[np.int64], srcs: npt.NDArray[np.int64], sizes: npt.NDArray[np.int64]
    ) -> None:
        _check(dsts, srcs, sizes)
        jit(
            dsts.ctypes.data,
            srcs.ctypes.data,
            sizes.ctypes.data,
            len(sizes),
            NT_MIN_BYTES,
            prefetch_ahead,
            prefetch_lines,
            pair_max_bytes,
        )

    kernel.__name__ = "jit"
    return kernel


def memmove_kernel(
    dsts: npt.NDArray[np.int64], srcs: npt.NDArray[np.int64], sizes: npt.NDArray[np.int64]
) -> None:
    """The fallback: one ``ctypes.memmove`` per descriptor."""
    _check(dsts, srcs, sizes)
    move = ctypes.memmove
    for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
        move(d, s, n)


def batch_kernel(prefer: str = "auto") -> tuple[str, BatchKernel]:
    """The kernel to use and its name: ``"jit"`` where it compiles, else ``"memmove"``.

    ``prefer="memmove"`` forces the fallback (tests run both).
    """
    if prefer not in ("auto", "jit", "memmove"):
        raise ValueError(f"unknown copy kernel {prefer!r} (auto, jit, memmove)")
    if prefer != "memmove" and _jit_function() is not None:
        return "jit", jit_kernel()
    if prefer == "jit":
        raise RuntimeError("the JIT copy kernel is unavailable (see the copy_kernel_fallback log)")
    return "memmove", memmove_kernel
