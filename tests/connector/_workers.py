"""A worker half on a fake CUDA device, for tests that drive it call by call."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvferry import FerryConfig
from kvferry.testing import FakeCudaDevice


@contextmanager
def fake_cuda_worker(
    make_vllm_config: Callable[..., Any],
    kv_cache_config: Any,
    extra: dict[str, Any],
    device: FakeCudaDevice,
) -> Iterator[Any]:
    """A registered ``WorkerSide`` with ``extra`` (its ``copy_engine`` runs on ``device``);
    on exit it is shut down and every event of ``device`` fired."""
    from kvferry.connector._worker import WorkerSide

    side = WorkerSide(make_vllm_config(extra), kv_cache_config, FerryConfig.from_dict(extra))
    spec = kv_cache_config.kv_cache_groups[0]
    kv = {
        name: torch.randn(2, kv_cache_config.num_blocks, 128, 2, 64).bfloat16()
        for name in spec.layer_names
    }
    side.register_kv_caches(kv)
    try:
        yield side
    finally:
        side.shutdown()
        for event in device.events:
            event.fire()
