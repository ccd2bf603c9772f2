"""The host pool: host memory for the host tier, allocated once, up front.

Rows of ``row_bytes``; a row holds one engine block of one KV-cache group, every layer
back to back (see :mod:`._layout`), and a slot (one offloaded chunk) is
``blocks_per_chunk`` consecutive rows, so all layers of a chunk lie contiguously.

Allocation is on the engine's start path, so it is made fast: the pool is one anonymous
mapping, advised to use transparent huge pages where the system offers them (512 times
fewer page faults, and fewer TLB misses for the copies later) unless it runs in a
virtual machine that gives free memory back to its host (there huge pages are slower to
get), and populated by several threads at once (``MADV_POPULATE_WRITE`` where the kernel
has it, else a write per page), so the memory is really there and the error comes at
start, not at the first store. On CUDA the populated range is then pinned with one
``cudaHostRegister``, so copies to and from it are ``non_blocking`` DMA. A fresh
anonymous mapping reads as zeros.

Lifetime: ``rows`` is a tensor over the mapping and keeps it alive; the mapping is
unpinned and unmapped when the last view of it is gone, or unpinned at once by
:meth:`HostPool.close` (after the copy engines using the pool are closed).

Who owns what: the pool's bytes are written only by the copy engine (its threads or its
streams) for the rows of jobs in flight, and by nothing else while such a job runs.
Population runs on short-lived threads inside the constructor, each on its own slice.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from .._config import available_host_bytes
from .._errors import HostMemoryError

HUGE_PAGE_BYTES = 2 << 20
"""Slices handed to populating threads are multiples of this, so no huge page is split
between two threads."""

MIN_SLICE_BYTES = 64 << 20
"""Below this per thread, another thread costs more to start than it saves."""

MAX_POPULATE_THREADS = 16
"""A cap, so that a host of many cores does not start a thread per core for this."""

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; the mmap module (3.11) does not name it
_PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


_BALLOONS = Path("/sys/bus/virtio/drivers/virtio_balloon")
_VIRTIO_BALLOON_F_REPORTING = 5


def host_reclaims_free_memory() -> bool:
    """Whether this kernel hands free memory back to a hypervisor (a virtio balloon with
    free page reporting, which reports free blocks of 2 MiB and more).

    There, a huge page is made of memory the host has taken back and must fault in
    again, while small pages come, as long as they last, from smaller free blocks it
    left alone: populating a pool with huge pages measured 2.2-4.8 s/GiB on such a
    machine (2 cores; medians of runs), with small pages 0.46-0.76.
    """
    try:
        devices = list(_BALLOONS.glob("virtio*"))
        features = [(d / "features").read_text().strip() for d in devices]
    except OSError:
        return False
    return any(
        len(f) > _VIRTIO_BALLOON_F_REPORTING and f[_VIRTIO_BALLOON_F_REPORTING] == "1"
        for f in features
    )


def default_populate_threads(nbytes: int) -> int:
    """One thread per usable core, at most :data:`MAX_POPULATE_THREADS`, and none with
    less than :data:`MIN_SLICE_BYTES` to do."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_POPULATE_THREADS, nbytes // MIN_SLICE_BYTES))


class _Mapping(mmap.mmap):
    """An anonymous mapping that undoes its pinning before it is unmapped.

    Tensors made with ``torch.frombuffer`` hold a reference to it, so ``__del__`` runs
    (and the base class unmaps) only once the last of them is gone.
    """

    _unpin: Callable[[], None] | None = None

    @property
    def address(self) -> int:
        # A ctypes view is taken and dropped at once: while it lives the mapping is
        # "exported" and could not be unmapped.
        view = ctypes.c_char.from_buffer(self)
        address = ctypes.addressof(view)
        del view
        return address

    def pin(self, nbytes: int) -> None:
        from ._cuda import register_host_memory, unregister_host_memory

        address = self.address
        register_host_memory(address, nbytes)
        self._unpin = lambda: unregister_host_memory(address)

    @property
    def pinned(self) -> bool:
        return self._unpin is not None

    def unpin(self) -> None:
        unpin, self._unpin = self._unpin, None
        if unpin is not None:
            unpin()

    def __del__(self) -> None:
        try:
            self.unpin()
        except Exception:  # at interpreter exit the CUDA runtime may be gone already
            pass


def _advise(address: int, nbytes: int, advice: int) -> int:
    """``madvise``; 0, or the errno it failed with. Releases the GIL (a ctypes call)."""
    if _libc.madvise(address, nbytes, advice) == 0:
        return 0
    return ctypes.get_errno()


def _populate_slice(address: int, nbytes: int, *, use_madvise: bool) -> None:
    if use_madvise:
        err = _advise(address, nbytes, _MADV_POPULATE_WRITE)
        if err == 0:
            return
        if err not in (errno.EINVAL, errno.ENOSYS):  # EINVAL: a kernel before 5.14
            raise OSError(err, os.strerror(err))
    # One write per page faults it in; the kernel zeroes it, so the rest need not be
    # written (a memset would zero every byte twice). numpy drops the GIL for the fill.
    pages = (ctypes.c_ubyte * nbytes).from_address(address)
    np.frombuffer(memoryview(pages), dtype=np.uint8)[::_PAGE] = 0


def populate(address: int, nbytes: int, threads: int, *, use_madvise: bool = True) -> None:
    """Fault in ``nbytes`` of anonymous memory at ``address`` (page-aligned), writable,
    on ``threads`` threads (the caller's among them).

    Raises :class:`OSError` when the kernel cannot give the memory (``ENOMEM``).
    """
    step = -(-nbytes // max(1, threads))
    step = -(-step // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    bounds = [(a, min(step, nbytes - a)) for a in range(0, nbytes, step)]
    errors: list[BaseException] = []

    def run(offset: int, length: int) -> None:
        try:
            _populate_slice(address + offset, length, use_madvise=use_madvise)
        except BaseException as exc:  # re-raised below, on the caller's thread
            errors.append(exc)

    workers = [threading.Thread(target=run, args=b, name="kvferry-pool") for b in bounds[1:]]
    for w in workers:
        w.start()
    if bounds:
        run(*bounds[0])
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


class HostPool:
    """``rows``: a ``(num_slots * blocks_per_chunk, row_bytes)`` uint8 tensor, zeroed.

    ``pin=True`` page-locks it for the CUDA device. ``populate_threads`` defaults to
    :func:`default_populate_threads`. ``huge_pages``: whether to advise transparent huge
    pages; by default yes when pinning (the driver locks a pool page by page: with huge
    pages, 32 GiB took 5.6-5.9 s on an H200 machine that reclaims free memory, with small
    ones 9.8-11.9 s), else unless :func:`host_reclaims_free_memory` (where populating
    them is several times slower than small pages). The ``huge_pages`` attribute says
    whether the kernel took the advice (still only advice: it falls back to small pages
    where it has no huge page free).
    """

    def __init__(
        self,
        num_slots: int,
        blocks_per_chunk: int,
        row_bytes: int,
        *,
        pin: bool = False,
        populate_threads: int | None = None,
        huge_pages: bool | None = None,
    ) -> None:
        if num_slots <= 0:
            raise HostMemoryError(
                f"the host pool has room for no block: cpu_bytes_to_use is smaller than "
                f"one offloaded block ({blocks_per_chunk * row_bytes} bytes)"
            )
        self.num_slots = num_slots
        self.blocks_per_chunk = blocks_per_chunk
        self.row_bytes = row_bytes
        nbytes = num_slots * blocks_per_chunk * row_bytes
        available = available_host_bytes()
        if nbytes > available:
            raise HostMemoryError(
                f"host pool of {nbytes} bytes asked (cpu_bytes_to_use), "
                f"but the machine has only {available} bytes available"
            )
        # Whole huge pages, so that (where the kernel aligns such mappings) the last
        # one is not left to small pages.
        length = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        try:
            mapping = _Mapping(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as exc:
            raise HostMemoryError(f"could not map a host pool of {nbytes} bytes: {exc}") from exc
        address = mapping.address
        self.huge_pages = False
        if huge_pages is None:
            huge_pages = pin or not host_reclaims_free_memory()
        if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
            self.huge_pages = _advise(address, length, mmap.MADV_HUGEPAGE) == 0
        threads = populate_threads or default_populate_threads(nbytes)
        try:
            populate(address, length, threads)
        except OSError as exc:
            raise HostMemoryError(
                f"could not allocate a host pool of {nbytes} bytes: {exc}"
            ) from exc
        rows = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
        if pin:
            mapping.pin(length)
        self._mapping: _Mapping | None = mapping
        self._rows: torch.Tensor | None = rows.view(num_slots * blocks_per_chunk, row_bytes)
        self._nbytes = nbytes

    @property
    def rows(self) -> torch.Tensor:
        if self._rows is None:
            raise HostMemoryError("the host pool is closed")
        return self._rows

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def pinned(self) -> bool:
        return self._mapping is not None and self._mapping.pinned

    def slot_rows(self, slot: int) -> torch.Tensor:
        """The rows of one slot (a view)."""
        b = self.blocks_per_chunk
        return self.rows[slot * b : (slot + 1) * b]

    def close(self) -> None:
        """Unpin now and let the memory go once no view of ``rows`` is left.

        Idempotent. Close the copy engines that use the pool first: nothing may copy
        to or from it afterwards. A pool simply dropped is unpinned and unmapped too,
        once its last view is gone.
        """
        mapping, self._mapping, self._rows = self._mapping, None, None
        if mapping is not None:
            mapping.unpin()
