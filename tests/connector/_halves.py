"""Both halves of the connector without an engine: a worker half (CPU copy engine) and a
scheduler half on one config, passed each other's data the way vLLM does once per step
(the worker is built first, as in vLLM: its ``register_kv_caches`` runs before the
scheduler exists)."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from kvferry import FerryConfig

from ._steps import BLOCK, step

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
SLOT_BYTES = 2 * 2 * BLOCK * 2 * 64 * 2  # 2 layers x (K, V) x 128 tokens x 2 heads x 64 x bf16


class Halves:
    """``extra``: kvferry's config; ``seed``: the engine blocks' random KV; ``clock``: the
    scheduler half's."""

    def __init__(
        self,
        make_vllm_config: Any,
        kv_cache_config: Any,
        extra: dict[str, Any],
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from kvferry.connector._scheduler import SchedulerSide
        from kvferry.connector._worker import WorkerSide

        cfg = FerryConfig.from_dict(extra)
        self.worker = WorkerSide(make_vllm_config(extra), kv_cache_config, cfg)
        g = torch.Generator().manual_seed(seed)
        self.kv = {n: torch.randn(2, 16, BLOCK, 2, 64, generator=g).bfloat16() for n in LAYERS}
        self.worker.register_kv_caches(self.kv)
        self.sched = SchedulerSide(make_vllm_config(extra), kv_cache_config, cfg, clock=clock)
        self.recving: set[str] = set()
        self.load_errors: set[int] = set()

    def step(
        self,
        new: dict[str, tuple[list[int], ...]] | None = None,
        scheduled: dict[str, int] | None = None,
    ) -> None:
        meta = self.sched.build_connector_meta(step(new or {}, scheduled or {}))
        self.worker.handle_preemptions(meta)
        self.worker.start_load_kv(meta)
        self.worker.wait_for_save(meta)
        sending, recving = self.worker.get_finished()
        self.recving |= recving or set()
        self.load_errors |= self.worker.get_block_ids_with_load_errors()
        self.sched.update_connector_output(
            SimpleNamespace(
                kv_connector_worker_meta=self.worker.build_worker_meta(),
                finished_sending=sending,
                finished_recving=recving,
            )
        )

    def run_until(self, done: Callable[[], bool], within_s: float = 60.0) -> None:
        """Empty engine steps until ``done()`` (within ``within_s``)."""
        deadline = time.monotonic() + within_s
        while not done():
            assert time.monotonic() < deadline, f"not done within {within_s} s"
            self.step()
            time.sleep(0.001)  # a back-off between steps; the condition decides

    def block(self, b: int) -> bytes:
        return b"".join(
            self.kv[n][:, b].contiguous().view(torch.uint8).numpy().tobytes() for n in LAYERS
        )

    def close(self) -> None:
        self.sched.shutdown()
        self.worker.shutdown()
