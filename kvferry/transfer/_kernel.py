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
  and a plain ``memmove`` per chunk measured ~0.65 of it. It ends with a full fence, so
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

BatchKernel = Callable[[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]], None]

_IR = r"""
declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)
declare void @llvm.prefetch.p0(ptr, i32, i32, i32)

define void @copy_batch(ptr %dsts, ptr %srcs, ptr %sizes, i64 %count, i64 %nt_min) {
entry:
  %empty = icmp eq i64 %count, 0
  br i1 %empty, label %done, label %desc
desc:
  %i = phi i64 [0, %entry], [%i.next, %next]
  %dp = getelementptr i64, ptr %dsts, i64 %i
  %sp = getelementptr i64, ptr %srcs, i64 %i
  %np = getelementptr i64, ptr %sizes, i64 %i
  %da = load i64, ptr %dp
  %sa = load i64, ptr %sp
  %n = load i64, ptr %np
  %d = inttoptr i64 %da to ptr
  %s = inttoptr i64 %sa to ptr
  %big = icmp uge i64 %n, %nt_min
  br i1 %big, label %head, label %plain
plain:
  call void @llvm.memcpy.p0.p0.i64(ptr %d, ptr %s, i64 %n, i1 false)
  br label %next
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
    proto = ctypes.CFUNCTYPE(
        None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64
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


def _jit_kernel(
    dsts: npt.NDArray[np.int64], srcs: npt.NDArray[np.int64], sizes: npt.NDArray[np.int64]
) -> None:
    """The JIT kernel (see the module docstring)."""
    _check(dsts, srcs, sizes)
    fn = _jit_function()
    assert fn is not None
    fn(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(sizes), NT_MIN_BYTES)


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
        return "jit", _jit_kernel
    if prefer == "jit":
        raise RuntimeError("the JIT copy kernel is unavailable (see the copy_kernel_fallback log)")
    return "memmove", memmove_kernel
