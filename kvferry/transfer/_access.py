"""Raw block access: the bytes of engine blocks, for users who want them.

``read_blocks(block_ids)`` returns the KV of those engine blocks as a ``(n, row_bytes)``
uint8 CPU tensor — one host row per block, every layer of the KV-cache group back to
back in the layout's order (see :mod:`._layout`); ``write_blocks(block_ids, rows)`` puts
such rows back. A round trip is exact, byte for byte, whatever the layout.

Both are synchronous and run on the calling thread: the caller makes sure the engine is
not computing into those blocks meanwhile (on CUDA the ops go on the current stream, so
they are ordered with the engine's own work on it).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from ._copy import CopyJob, Direction, GroupBlocks
from ._kernel import batch_kernel
from ._layout import KVLayout
from ._plan import check_job, plan_job
from ._torchcopy import gather_rows, scatter_rows


class KVBlockAccess:
    """Read and write engine blocks of one KV-cache group as host rows."""

    def __init__(self, layout: KVLayout, *, group: int = 0) -> None:
        if not 0 <= group < len(layout.groups):
            raise IndexError(f"no KV-cache group {group} (the layout has {len(layout.groups)})")
        self.layout = layout
        self.group = group

    @property
    def row_bytes(self) -> int:
        """Bytes of one block of this group (every layer)."""
        return self.layout.groups[self.group].row_bytes

    def _job(self, direction: Direction, block_ids: npt.ArrayLike) -> CopyJob:
        blocks = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        part = GroupBlocks(group=self.group, device_blocks=blocks, host_rows=np.arange(len(blocks)))
        job = CopyJob(job_id=-1, direction=direction, parts=(part,))
        check_job(self.layout, job, len(blocks), self.row_bytes)
        return job

    def read_blocks(self, block_ids: npt.ArrayLike) -> torch.Tensor:
        """The bytes of ``block_ids``: a new ``(len(block_ids), row_bytes)`` uint8 CPU tensor."""
        job = self._job("store", block_ids)
        n = job.num_blocks
        if self.layout.device.type == "cpu":
            out = torch.empty((n, self.row_bytes), dtype=torch.uint8)
            self._run(job, out)
            return out
        staging = torch.empty((n, self.row_bytes), dtype=torch.uint8, device=self.layout.device)
        idx = torch.as_tensor(job.parts[0].device_blocks.copy()).to(self.layout.device)
        gather_rows(self.layout.groups[self.group], idx, staging)
        return staging.cpu()

    def write_blocks(self, block_ids: npt.ArrayLike, rows: torch.Tensor) -> None:
        """Put ``rows`` (``(len(block_ids), row_bytes)`` uint8, as :meth:`read_blocks`
        returns) into ``block_ids``."""
        job = self._job("load", block_ids)
        n = job.num_blocks
        if rows.dtype != torch.uint8 or tuple(rows.shape) != (n, self.row_bytes):
            raise ValueError(
                f"rows must be uint8 of shape ({n}, {self.row_bytes}), got "
                f"{rows.dtype} {tuple(rows.shape)}"
            )
        if self.layout.device.type == "cpu":
            self._run(job, rows.to("cpu").contiguous())
            return
        idx = torch.as_tensor(job.parts[0].device_blocks.copy()).to(self.layout.device)
        scatter_rows(self.layout.groups[self.group], idx, rows.to(self.layout.device).contiguous())

    def _run(self, job: CopyJob, rows: torch.Tensor) -> None:
        _, kernel = batch_kernel()
        plan = plan_job(self.layout, job, rows.data_ptr(), rows.stride(0))
        kernel(plan.dsts, plan.srcs, plan.sizes)
