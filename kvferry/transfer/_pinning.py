"""Page-locking host memory that is already mapped, for DMA (``cudaHostRegister``).

The host pool maps and populates its memory itself (many threads, huge pages), then
registers the populated range once: pinning then costs one pass of the driver over
pages that are already there, instead of ``cudaHostAlloc``'s single-threaded faults.

This module touches ``torch.cuda``, which the rest of the package leaves to
``_cuda.py``: it is the one other place, and only for these two calls.
"""

from __future__ import annotations

from typing import Any

from .._errors import HostMemoryError


def register_host_memory(address: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` at ``address`` for the CUDA device (``cudaHostRegister``).

    Raises :class:`HostMemoryError` when there is no CUDA device or the driver refuses
    (the page-locked limit, ``ulimit -l``, or too little memory).
    """
    import torch

    if not torch.cuda.is_available():
        raise HostMemoryError("a pinned host pool needs a CUDA device, and there is none")
    cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    err = cudart.cudaHostRegister(address, nbytes, 0)  # cudaHostRegisterDefault
    if int(err) != 0:
        raise HostMemoryError(
            f"could not pin a host pool of {nbytes} bytes (cudaHostRegister: "
            f"{cudart.cudaGetErrorString(err)}); is the page-locked memory limit "
            f"(ulimit -l) too low?"
        )


def unregister_host_memory(address: int) -> None:
    """Undo :func:`register_host_memory`; must run before the memory is unmapped."""
    import torch

    cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    cudart.cudaHostUnregister(address)
