"""The host pool: allocated once, zeroed and resident when the constructor returns, huge
pages advised, clear errors, and its memory released when it is closed and dropped."""

from __future__ import annotations

import ctypes
import gc
import mmap
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvferry import HostMemoryError
from kvferry.transfer import HostPool, _pool

MiB = 1 << 20

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps")


def mapping_of(address: int, nbytes: int = 1) -> dict[str, str] | None:
    """The ``/proc/self/smaps`` entry of the mapping holding all of ``address`` ..
    ``address + nbytes``, or None (a small mapping the allocator puts in a freed range
    later does not count)."""
    entry: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            if entry is not None:
                return entry
            start, end = (int(x, 16) for x in head[0].split("-"))
            entry = {} if start <= address and address + nbytes <= end else None
        elif entry is not None:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
    return entry


def resident_bytes(address: int, nbytes: int) -> int:
    """Bytes of the page-aligned range that are in memory (``mincore``)."""
    page = mmap.PAGESIZE
    pages = -(-nbytes // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    if libc.mincore(address, nbytes, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(int(v) & 1 for v in vec) * page


def thp_offered() -> bool:
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode


def test_rows_have_the_asked_shape_and_are_zeroed() -> None:
    pool = HostPool(num_slots=3, blocks_per_chunk=2, row_bytes=4160)
    assert pool.rows.dtype == torch.uint8
    assert pool.rows.shape == (6, 4160)
    assert pool.rows.stride() == (4160, 1)
    assert pool.nbytes == 6 * 4160
    assert not pool.rows.any()


def test_slot_rows_are_consecutive_rows() -> None:
    pool = HostPool(num_slots=3, blocks_per_chunk=2, row_bytes=16)
    assert pool.slot_rows(1).data_ptr() == pool.rows[2].data_ptr()
    assert pool.slot_rows(1).shape == (2, 16)


@linux_only
@pytest.mark.parametrize("use_madvise", [True, False], ids=["populate-write", "page-writes"])
@pytest.mark.parametrize("threads", [1, 3])
def test_populate_makes_every_page_resident_and_zero(use_madvise: bool, threads: int) -> None:
    nbytes = 10 * MiB  # not a multiple of the threads' slices: the last one is shorter
    mapping = _pool._Mapping(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    assert resident_bytes(mapping.address, nbytes) == 0
    _pool.populate(mapping.address, nbytes, threads, use_madvise=use_madvise)
    assert resident_bytes(mapping.address, nbytes) == nbytes
    assert not np.frombuffer(mapping, dtype=np.uint8).any()


@linux_only
def test_pool_memory_is_resident_when_the_constructor_returns() -> None:
    pool = HostPool(num_slots=5, blocks_per_chunk=1, row_bytes=MiB, populate_threads=2)
    assert resident_bytes(pool.rows.data_ptr(), pool.nbytes) == pool.nbytes


@linux_only
@pytest.mark.skipif(not thp_offered(), reason="this system offers no transparent huge pages")
def test_pool_is_advised_to_use_huge_pages_when_asked() -> None:
    pool = HostPool(num_slots=4, blocks_per_chunk=1, row_bytes=2 * MiB, huge_pages=True)
    assert pool.huge_pages
    entry = mapping_of(pool.rows.data_ptr(), pool.nbytes)
    assert entry is not None
    assert "hg" in entry["VmFlags"].split()  # the kernel's mark of MADV_HUGEPAGE


@linux_only
def test_pool_without_huge_pages_gives_no_advice() -> None:
    pool = HostPool(num_slots=4, blocks_per_chunk=1, row_bytes=2 * MiB, huge_pages=False)
    assert not pool.huge_pages
    entry = mapping_of(pool.rows.data_ptr(), pool.nbytes)
    assert entry is not None
    assert "hg" not in entry["VmFlags"].split()
    assert not pool.rows.any()


@linux_only
@pytest.mark.skipif(not thp_offered(), reason="this system offers no transparent huge pages")
def test_pool_uses_huge_pages_by_default_unless_the_host_reclaims_free_memory() -> None:
    pool = HostPool(num_slots=2, blocks_per_chunk=1, row_bytes=2 * MiB)
    assert pool.huge_pages == (not _pool.host_reclaims_free_memory())


def test_pool_larger_than_the_machine_fails_clearly() -> None:
    with pytest.raises(HostMemoryError, match="machine has only"):
        HostPool(num_slots=1 << 40, blocks_per_chunk=1, row_bytes=MiB)


def test_pool_of_no_slot_fails_clearly() -> None:
    with pytest.raises(HostMemoryError, match="room for no block"):
        HostPool(num_slots=0, blocks_per_chunk=4, row_bytes=MiB)


def test_pool_the_kernel_cannot_map_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    # Past the check against available memory, 2**62 bytes exceed any address space.
    monkeypatch.setattr(_pool, "available_host_bytes", lambda: 1 << 63)
    with pytest.raises(HostMemoryError, match="could not map a host pool"):
        HostPool(num_slots=1 << 22, blocks_per_chunk=1, row_bytes=1 << 40)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_pinned_pool_without_cuda_fails_clearly() -> None:
    with pytest.raises(HostMemoryError, match="needs a CUDA device"):
        HostPool(num_slots=2, blocks_per_chunk=1, row_bytes=4096, pin=True)


def test_close_is_idempotent_and_rows_are_refused_after_it() -> None:
    pool = HostPool(num_slots=2, blocks_per_chunk=1, row_bytes=4096)
    pool.close()
    pool.close()
    assert not pool.pinned
    with pytest.raises(HostMemoryError, match="closed"):
        pool.rows  # noqa: B018


@linux_only
def test_memory_is_unmapped_once_the_pool_and_its_last_view_are_gone() -> None:
    pool = HostPool(num_slots=2, blocks_per_chunk=1, row_bytes=MiB)
    address, nbytes = pool.rows.data_ptr(), pool.nbytes
    view = pool.slot_rows(1)
    view.fill_(7)
    pool.close()
    del pool
    gc.collect()
    assert mapping_of(address, nbytes) is not None  # a view is left: mapped and readable
    assert int(view[0, 0]) == 7
    del view
    gc.collect()
    assert mapping_of(address, nbytes) is None


@linux_only
def test_a_pool_simply_dropped_is_unmapped() -> None:
    pool = HostPool(num_slots=2, blocks_per_chunk=1, row_bytes=MiB)
    address, nbytes = pool.rows.data_ptr(), pool.nbytes
    assert mapping_of(address, nbytes) is not None
    del pool
    gc.collect()
    assert mapping_of(address, nbytes) is None


@pytest.mark.gpu
def test_pinned_pool_is_page_locked_until_closed() -> None:
    pool = HostPool(num_slots=4, blocks_per_chunk=1, row_bytes=MiB, pin=True)
    rows = pool.rows
    assert pool.pinned and rows.is_pinned()
    device = torch.arange(MiB, dtype=torch.int32, device="cuda").view(torch.uint8)[: 2 * MiB]
    rows[:2].view(-1).copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(rows[:2].view(-1), device.cpu())
    pool.close()
    pool.close()
    assert not rows.is_pinned()


@pytest.mark.gpu
@pytest.mark.skipif(not thp_offered(), reason="this system offers no transparent huge pages")
def test_a_pinned_pool_asks_for_huge_pages_by_default() -> None:
    # the driver locks a pool page by page: fewer, larger pages pin faster
    pool = HostPool(num_slots=4, blocks_per_chunk=1, row_bytes=2 * MiB, pin=True)
    assert pool.huge_pages
    pool.close()


@pytest.mark.gpu
def test_pinned_pool_simply_dropped_is_unpinned_and_unmapped() -> None:
    pool = HostPool(num_slots=2, blocks_per_chunk=1, row_bytes=MiB, pin=True)
    address, nbytes = pool.rows.data_ptr(), pool.nbytes
    del pool
    gc.collect()
    assert mapping_of(address, nbytes) is None
