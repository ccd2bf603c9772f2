"""The host pool: host memory for the host tier, allocated once, up front.

Rows of ``row_bytes``; a row holds one engine block of one KV-cache group, every layer
back to back (see :mod:`._layout`), and a slot (one offloaded chunk) is
``blocks_per_chunk`` consecutive rows, so all layers of a chunk lie contiguously. Pages
are touched at allocation so the memory is really there (and the error comes at start,
not at the first store); on CUDA the pool is pinned, so copies to and from it are
``non_blocking`` DMA.

Who owns what: the pool's bytes are written only by the copy engine (its threads or its
streams) for the rows of jobs in flight, and by nothing else while such a job runs.
"""

from __future__ import annotations

import torch

from .._config import available_host_bytes
from .._errors import HostMemoryError


class HostPool:
    """``rows``: a ``(num_slots * blocks_per_chunk, row_bytes)`` uint8 tensor."""

    def __init__(
        self, num_slots: int, blocks_per_chunk: int, row_bytes: int, *, pin: bool = False
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
        try:
            rows = torch.empty(
                (num_slots * blocks_per_chunk, row_bytes), dtype=torch.uint8, pin_memory=pin
            )
            rows.fill_(0)  # touch every page now
        except RuntimeError as exc:
            raise HostMemoryError(
                f"could not allocate a host pool of {nbytes} bytes: {exc}"
            ) from exc
        self.rows = rows

    @property
    def nbytes(self) -> int:
        return int(self.rows.numel())

    def slot_rows(self, slot: int) -> torch.Tensor:
        """The rows of one slot (a view)."""
        b = self.blocks_per_chunk
        return self.rows[slot * b : (slot + 1) * b]
