"""The CUDA copy path against the host link's own limit, and against vLLM's way.

Run on a machine with a CUDA device: ``python benchmarks/transfer_cuda.py [--quick]``.
Without one it prints the calling-thread cost of planning a step batch (numpy only, the
part of ``submit_batch`` that does not touch the device) and, as its last line,
``{"skipped": "no CUDA device", ...}``, and exits 0.

Two KV shapes, vLLM's flash-attention layout (per layer ``(2, blocks, 16, kv_heads,
head_dim)`` bf16, K and V split):

- ``32k``: 32 layers, 8 KV heads, head 128 — a page (one layer's K or V of one block) is
  32 KiB, a block 2 MiB;
- ``4k``: 24 layers, 2 KV heads, head 64 — 4 KiB pages, 192 KiB a block.

Every trial moves ``JOBS`` jobs of ``BLOCKS_PER_JOB`` engine blocks drawn at random, to
host rows drawn at random (a fragmented pool), all in flight at once, timed from the first
submission to the end of the last job (``torch.cuda.synchronize``):

- ``dma``: the limit — one contiguous pinned copy of the same bytes, one way; ``dma2``
  both ways at once on two streams;
- ``kvferry``: :class:`~kvferry.transfer.CudaCopyEngine`, jobs one by one through
  ``submit(job)`` and as one step batch through ``submit_batch(jobs)``; stores and loads
  at once (``both``, half the bytes each way) against ``dma2``;
- ``native``: vLLM 0.32's way, one ``cuMemcpyBatchAsync`` per job of every (block,
  layer, K/V) page (through ``cuda.bindings``, where importable).

``submit_us_per_job`` is the calling thread's time inside the submissions of a step
batch, divided by the jobs. Trials alternate the configurations; figures are medians.

The embedding API: ``kvferry.Ferry`` on an asyncio loop with the 32k KV cache, 64
concurrent ``store`` calls of 16 blocks then 64 concurrent ``load`` calls, while a task
ticks every 1 ms and records its lag (``ferry_loop_lag_ms_p99`` / ``_max``).

``pinned_pool_s_32g``: seconds to allocate and pin a 32 GiB host pool
(:class:`~kvferry.transfer.HostPool`, ``pin=True``), when the machine has the memory;
``_huge`` / ``_small`` with transparent huge pages forced on / off.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvferry.transfer import (  # noqa: E402
    CopyJob,
    CudaCopyEngine,
    GroupBlocks,
    HostPool,
    KVLayout,
    describe_kv_caches,
)
from kvferry.transfer._pages import PageTemplate, Templates, plan_batch, row_table  # noqa: E402

SHAPES = {"32k": (32, 8, 128), "4k": (24, 2, 64)}  # layers, kv heads, head dim
BLOCK_TOKENS = 16
JOBS = 64
BLOCKS_PER_JOB = 16
QUICK = "--quick" in sys.argv
TRIALS = 3 if QUICK else 7


def kv_caches(shape: str, num_blocks: int, device: str) -> dict[str, torch.Tensor]:
    layers, heads, dim = SHAPES[shape]
    return {
        f"l{i}": torch.zeros(
            (2, num_blocks, BLOCK_TOKENS, heads, dim), dtype=torch.bfloat16, device=device
        )
        for i in range(layers)
    }


def make_jobs(
    direction: str, num_blocks: int, num_rows: int, seed: int, first_id: int = 0
) -> list[CopyJob]:
    rng = np.random.default_rng(seed)
    blocks = rng.choice(num_blocks, JOBS * BLOCKS_PER_JOB, replace=False)
    rows = rng.choice(num_rows, JOBS * BLOCKS_PER_JOB, replace=False)
    out = []
    for j in range(JOBS):
        sl = slice(j * BLOCKS_PER_JOB, (j + 1) * BLOCKS_PER_JOB)
        part = GroupBlocks(group=0, device_blocks=blocks[sl], host_rows=rows[sl])
        out.append(CopyJob(job_id=first_id + j, direction=direction, parts=(part,)))  # type: ignore[arg-type]
    return out


def plan_cost(shape: str) -> float:
    """Microseconds of numpy planning (plan + page table) for one step batch, on CPU
    tensors of the shape's layout."""
    num_blocks = JOBS * BLOCKS_PER_JOB + 8
    kv = kv_caches(shape, num_blocks, "cpu")
    layout = describe_kv_caches(kv, [list(kv)], num_blocks)
    templates = Templates.of([PageTemplate.of(g) for g in layout.groups])
    jobs = make_jobs("store", num_blocks, 4 * JOBS * BLOCKS_PER_JOB, seed=1)
    bases = np.arange(4, dtype=np.int64) << 30
    times = []
    for _ in range(TRIALS * 3):
        t0 = time.perf_counter()
        plan = plan_batch(jobs, 256)
        out = np.empty(4 * plan.num_rows, dtype=np.int64)
        row_table(plan, templates, bases[np.arange(plan.num_pieces) % 4], 1 << 20, out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


# ----------------------------------------------------------------- CUDA


def timed(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


class Native:
    """vLLM's way: one ``cuMemcpyBatchAsync`` of every page of a job."""

    def __init__(self, layout: KVLayout, pool: HostPool) -> None:
        from cuda.bindings import driver  # the GPU machine's wheel; absent: no baseline

        self.driver = driver
        self.templates = [PageTemplate.of(g, max_page_bytes=1 << 40) for g in layout.groups]
        self.pool = pool
        attr = driver.CUmemcpyAttributes()
        attr.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        self.attr = attr

    def submit(self, job: CopyJob, stream: Any) -> None:
        t = self.templates[0]
        part = job.parts[0]
        dev = (t.dev_offset + part.device_blocks[:, None] * t.block_stride).ravel()
        host = (
            self.pool.rows.data_ptr()
            + (part.host_rows[:, None] * self.pool.row_bytes + t.row_offset)
        ).ravel()
        sizes = np.broadcast_to(t.nbytes, (len(part.device_blocks), len(t))).ravel()
        src, dst = (dev, host) if job.direction == "store" else (host, dev)
        n = len(sizes)
        args = [dst.tolist(), src.tolist(), sizes.tolist(), n, [self.attr], [0], 1]
        handle = stream.cuda_stream
        try:
            result = self.driver.cuMemcpyBatchAsync(*args, handle)  # CUDA 13
        except TypeError:
            result = self.driver.cuMemcpyBatchAsync(*args[:6], [0], 1, handle)  # 12.8 failIdx
        err = result[0] if isinstance(result, tuple) else result
        if int(err) != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync: {err}")


def measure_shape(shape: str, figures: dict[str, Any]) -> list[tuple[str, str, float]]:
    """Every configuration on one KV shape, ``TRIALS`` interleaved trials; medians."""
    num_blocks = 2 * JOBS * BLOCKS_PER_JOB
    kv = kv_caches(shape, num_blocks, "cuda")
    for t in kv.values():
        t.normal_()
    layout = describe_kv_caches(kv, [list(kv)], num_blocks)
    num_rows = 2 * JOBS * BLOCKS_PER_JOB
    pool = HostPool(num_slots=num_rows, blocks_per_chunk=1, row_bytes=layout.row_bytes, pin=True)
    engine = CudaCopyEngine(layout, pool)
    nbytes = JOBS * BLOCKS_PER_JOB * layout.row_bytes
    dev_buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_buf2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host_buf = pool.rows.view(-1)[:nbytes]
    host_buf2 = pool.rows.view(-1)[nbytes : 2 * nbytes]
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    native: Native | None
    try:
        native = Native(layout, pool)
    except Exception as exc:  # no cuda.bindings, or a driver without the call
        print(f"[{shape}] vLLM's way unavailable: {exc!r}")
        native = None
    res: dict[str, list[float]] = {}
    submit_us: list[float] = []

    def add(key: str, seconds: float, moved: int = nbytes) -> None:
        res.setdefault(key, []).append(moved / seconds / 1e9)

    def two_way() -> None:
        with torch.cuda.stream(s1):
            host_buf.copy_(dev_buf, non_blocking=True)
        with torch.cuda.stream(s2):
            dev_buf2.copy_(host_buf2, non_blocking=True)

    def each(jobs: list[CopyJob]) -> None:
        for j in jobs:
            engine.submit(j)

    def batch(jobs: list[CopyJob]) -> None:
        t0 = time.perf_counter()
        engine.submit_batch(jobs)
        submit_us.append((time.perf_counter() - t0) * 1e6 / len(jobs))

    def natively(jobs: list[CopyJob]) -> None:
        stream = torch.cuda.current_stream()
        for j in jobs:
            native.submit(j, stream)  # type: ignore[union-attr]

    half = JOBS // 2
    for trial in range(TRIALS):
        stores = make_jobs("store", num_blocks, num_rows, 100 + trial)
        loads = make_jobs("load", num_blocks, num_rows, 150 + trial, first_id=1000)
        add("dma_store", timed(lambda: host_buf.copy_(dev_buf, non_blocking=True)))
        add("dma_load", timed(lambda: dev_buf.copy_(host_buf, non_blocking=True)))
        add("dma2", timed(two_way), 2 * nbytes)
        add("store_each", timed(lambda: each(stores)))  # noqa: B023 (called at once)
        add("load_each", timed(lambda: each(loads)))  # noqa: B023
        add("store_batch", timed(lambda: batch(stores)))  # noqa: B023
        add("load_batch", timed(lambda: batch(loads)))  # noqa: B023
        add("both", timed(lambda: batch(stores[:half] + loads[:half])))  # noqa: B023
        if native is not None:
            add("native_store", timed(lambda: natively(stores)))  # noqa: B023
            add("native_load", timed(lambda: natively(loads)))  # noqa: B023
    engine.close()
    med = {k: statistics.median(v) for k, v in res.items()}
    # a direction's figure is its better way: one by one, or as a step batch
    best = {d: max(med[f"{d}_each"], med[f"{d}_batch"]) for d in ("store", "load")}
    figures[f"store_vs_dma_{shape}"] = round(best["store"] / med["dma_store"], 3)
    figures[f"load_vs_dma_{shape}"] = round(best["load"] / med["dma_load"], 3)
    figures[f"store_batch_vs_dma_{shape}"] = round(med["store_batch"] / med["dma_store"], 3)
    figures[f"load_batch_vs_dma_{shape}"] = round(med["load_batch"] / med["dma_load"], 3)
    figures[f"both_vs_dma_{shape}"] = round(med["both"] / med["dma2"], 3)
    for d in ("store", "load"):
        nat = med.get(f"native_{d}")
        figures[f"{d}_vs_native_{shape}"] = round(best[d] / nat, 3) if nat else None
    figures[f"submit_us_per_job_{shape}"] = round(statistics.median(submit_us), 2)
    return [(shape, key, med[key]) for key in sorted(med)]


def run_cuda() -> dict[str, Any]:
    figures: dict[str, Any] = {}
    rows_out = []
    for shape in SHAPES:
        rows_out += measure_shape(shape, figures)
        torch.cuda.empty_cache()
    print(f"{'shape':6} {'configuration':14} {'GB/s':>8}")
    for shape, key, gbps in rows_out:
        print(f"{shape:6} {key:14} {gbps:8.2f}")
    figures.update(ferry_lag())
    figures.update(pinned_pools(32 << 30))
    return figures


def ferry_lag() -> dict[str, Any]:
    from kvferry import Ferry

    num_blocks = 2 * JOBS * BLOCKS_PER_JOB
    kv = kv_caches("32k", num_blocks, "cuda")
    row_bytes = describe_kv_caches(kv, [list(kv)], num_blocks).row_bytes
    nbytes = JOBS * BLOCKS_PER_JOB * row_bytes

    async def main() -> dict[str, Any]:
        lags: list[float] = []
        running = True

        async def ticker() -> None:
            loop = asyncio.get_running_loop()
            while running:
                t0 = loop.time()
                await asyncio.sleep(1e-3)
                lags.append((loop.time() - t0 - 1e-3) * 1e3)

        async with Ferry(kv, num_blocks=num_blocks, cpu_bytes_to_use=2 * nbytes) as ferry:
            tick = asyncio.create_task(ticker())
            rng = np.random.default_rng(5)
            blocks = rng.permutation(num_blocks)[: JOBS * BLOCKS_PER_JOB].reshape(JOBS, -1)
            keys = [[f"{j}.{b}".encode() for b in range(BLOCKS_PER_JOB)] for j in range(JOBS)]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            await asyncio.gather(*(ferry.store(keys[j], blocks[j]) for j in range(JOBS)))
            store_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            await asyncio.gather(*(ferry.load(keys[j], blocks[::-1][j]) for j in range(JOBS)))
            load_s = time.perf_counter() - t0
            running = False
            await tick
        # the limit, measured right after on the same buffers' sizes
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dma = timed(lambda: host.copy_(dev, non_blocking=True))
        return {
            "ferry_loop_lag_ms_p99": round(float(np.percentile(lags, 99)), 3),
            "ferry_loop_lag_ms_max": round(max(lags), 3),
            "ferry_store_vs_dma": round(dma / store_s, 3),
            "ferry_load_vs_dma": round(dma / load_s, 3),
        }

    return asyncio.run(main())


def pinned_pools(nbytes: int) -> dict[str, float | None]:
    """Seconds to allocate and pin a host pool of ``nbytes`` (the default way, and with
    huge pages forced on and off), when the machine has the memory."""
    from kvferry._config import available_host_bytes

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from transfer import host_pool_seconds

    if available_host_bytes() < nbytes * 1.25:
        return {"pinned_pool_s_32g": None}
    return {
        "pinned_pool_s_32g": round(host_pool_seconds(nbytes, pin=True), 2),
        "pinned_pool_s_32g_huge": round(host_pool_seconds(nbytes, pin=True, huge_pages=True), 2),
        "pinned_pool_s_32g_small": round(
            host_pool_seconds(nbytes, pin=True, huge_pages=False), 2
        ),
    }


def main() -> None:
    if not torch.cuda.is_available():
        print(f"{'shape':6} {'plan us/batch':>14} {'us/job':>8}   (numpy planning only, no CUDA)")
        out: dict[str, Any] = {"skipped": "no CUDA device"}
        for shape in SHAPES:
            us = plan_cost(shape)
            print(f"{shape:6} {us:14.1f} {us / JOBS:8.2f}")
            out[f"plan_us_per_batch_{shape}"] = round(us, 1)
        print(json.dumps(out))
        return
    print(json.dumps(run_cuda()))


if __name__ == "__main__":
    main()
