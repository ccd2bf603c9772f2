"""Store and load throughput of the CPU copy engine against a plain memory copy.

Run with the project's venv: ``.venv/bin/python benchmarks/transfer.py [--quick]``.

For each chunk size (the bytes of one offloaded block across all layers: 16 KiB, 64 KiB,
256 KiB, 2 MiB) and each KV layout, a trial moves ``MOVE_MIB`` of randomly chosen chunks
(engine blocks drawn at random from the KV cache, host slots at random from the pool —
the fragmented case) through :class:`~kvferry.transfer.ThreadCopyEngine`, as jobs of
about ``JOB_MIB`` all submitted at once (many jobs in flight), timed from the first
``submit`` to the last completion (planning included). Its baseline is one plain
contiguous ``memcpy`` of the same number of bytes between the same two allocations
(glibc's, through ``numpy.copyto``; at this size it uses streaming stores, its fastest
path), timed in the same trial. Trials alternate baseline and transfer so that a noisy
neighbour hits both alike; each figure is the median over trials of kvferry GB/s ÷
memcpy GB/s.

The KV cache and the host pool are each ``POOL_MIB``, and every timed copy (baseline
or transfer) starts with the caches emptied by reading a scratch buffer larger than the
L3: the L3 here (~260 MiB, shared with other tenants) would otherwise serve whichever
side last touched the data.

Layouts (``LAYERS`` layers, bf16):
- ``block-first``: block-outermost (vLLM's BLHNC), all layers of a block together — the
  layout kvferry asks vLLM for: a chunk is one contiguous run. The JSON keys without a
  prefix are this layout's.
- ``vllm-cpu``: vLLM-CPU's LBHNC, per layer (blocks, 2, …) views over one allocation:
  a chunk is ``LAYERS`` runs of chunk/``LAYERS`` bytes. Its keys are prefixed
  ``lbhnc_``.

``concurrent_vs_memcpy``: stores and loads of 256 KiB chunks submitted interleaved
(half the bytes each, on disjoint blocks and slots), total bytes ÷ time, against the
memcpy of the same total.

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvferry.transfer import (  # noqa: E402
    CopyJob,
    GroupBlocks,
    HostPool,
    KVLayout,
    ThreadCopyEngine,
    describe_kv_caches,
)

QUICK = "--quick" in sys.argv
TRIALS = 3 if QUICK else 11
POOL_MIB = 256 if QUICK else 1024
MOVE_MIB = 64 if QUICK else 128
JOB_MIB = 8
LAYERS = 8
CHUNKS = {"16k": 16 << 10, "64k": 64 << 10, "256k": 256 << 10, "2m": 2 << 20}


def make_layout(kind: str, chunk: int) -> tuple[KVLayout, torch.Tensor]:
    """A KV cache of ``POOL_MIB`` in layout ``kind`` whose blocks are ``chunk`` bytes."""
    num_blocks = (POOL_MIB << 20) // chunk
    per_layer = chunk // LAYERS // 2 // 2  # elements of K (or V) of one layer, bf16
    if kind == "block-first":
        base = torch.empty(num_blocks, LAYERS, 2, per_layer, dtype=torch.bfloat16)
        layers = {f"l{i}": base[:, i] for i in range(LAYERS)}
    else:
        base = torch.empty(LAYERS, num_blocks, 2, per_layer, dtype=torch.bfloat16)
        layers = {f"l{i}": base[i] for i in range(LAYERS)}
    base.view(torch.uint8).fill_(1)  # touch every page
    layout = describe_kv_caches(layers, [list(layers)], num_blocks)
    assert layout.row_bytes == chunk
    return layout, base


def jobs_for(
    direction: str, blocks: np.ndarray, rows: np.ndarray, chunk: int, first_id: int
) -> list[CopyJob]:
    per_job = max(1, (JOB_MIB << 20) // chunk)
    return [
        CopyJob(
            job_id=first_id + i,
            direction=direction,  # type: ignore[arg-type]
            parts=(
                GroupBlocks(
                    group=0, device_blocks=blocks[a : a + per_job], host_rows=rows[a : a + per_job]
                ),
            ),
        )
        for i, a in enumerate(range(0, len(blocks), per_job))
    ]


def run_jobs(engine: ThreadCopyEngine, jobs: list[CopyJob]) -> float:
    t0 = time.perf_counter()
    completions = [engine.submit(j) for j in jobs]
    # Newest first: one wake-up at the end rather than one per job, as the connector
    # (which polls once per engine step) never wakes for each job either.
    for c in reversed(completions):
        c.synchronize()
    seconds = time.perf_counter() - t0
    assert all(c.exception() is None for c in completions)
    return seconds


class Trial:
    def __init__(self, kind: str, chunk: int, seed: int) -> None:
        self.chunk = chunk
        self.layout, self.kv = make_layout(kind, chunk)
        n = self.layout.num_blocks
        self.pool = HostPool(num_slots=n, blocks_per_chunk=1, row_bytes=chunk)
        self.engine = ThreadCopyEngine(self.layout, self.pool)
        self.rng = np.random.default_rng(seed)
        self.move = (MOVE_MIB << 20) // chunk
        self.kv_bytes = self.kv.view(-1).view(torch.uint8).numpy()
        self.pool_bytes = self.pool.rows.view(-1).numpy()

    def pick(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        n = self.layout.num_blocks
        return self.rng.choice(n, k, replace=False), self.rng.choice(n, k, replace=False)

    def memcpy(self, nbytes: int) -> float:
        """Seconds of one contiguous copy of ``nbytes`` from the KV cache to the pool."""
        span = len(self.kv_bytes) - nbytes
        a, b = (int(x) // 4096 * 4096 for x in self.rng.integers(0, span + 1, 2))
        t0 = time.perf_counter()
        np.copyto(self.pool_bytes[b : b + nbytes], self.kv_bytes[a : a + nbytes])
        return time.perf_counter() - t0

    def store(self) -> float:
        blocks, rows = self.pick(self.move)
        return run_jobs(self.engine, jobs_for("store", blocks, rows, self.chunk, 0))

    def load(self) -> float:
        blocks, rows = self.pick(self.move)
        return run_jobs(self.engine, jobs_for("load", blocks, rows, self.chunk, 0))

    def concurrent(self) -> float:
        half = self.move // 2
        blocks, rows = self.pick(2 * half)
        stores = jobs_for("store", blocks[:half], rows[:half], self.chunk, 0)
        loads = jobs_for("load", blocks[half:], rows[half:], self.chunk, 10_000)
        mixed = [j for pair in zip(stores, loads, strict=True) for j in pair]
        return run_jobs(self.engine, mixed)

    def close(self) -> None:
        self.engine.close()


_SCRATCH = np.ones((384 << 20) // 8, dtype=np.uint64)


def cold(op: Callable[[], float]) -> float:
    """Run ``op`` with the caches emptied of both buffers (the L3 here is ~260 MiB,
    shared with other tenants: a warm source would flatter whichever side had it)."""
    gc.collect()
    _SCRATCH.sum()
    return op()


def ratios(trial: Trial, op: Callable[[], float], nbytes: int) -> tuple[float, float, float]:
    """(median ratio, median kvferry GB/s, median memcpy GB/s) over alternating trials."""
    op()  # warm up: the JIT kernel, first-touch of index arrays
    rs, ks, ms = [], [], []
    for _ in range(TRIALS):
        m = nbytes / cold(lambda: trial.memcpy(nbytes)) / 1e9
        k = nbytes / cold(op) / 1e9
        rs.append(k / m)
        ks.append(k)
        ms.append(m)
    return statistics.median(rs), statistics.median(ks), statistics.median(ms)


def main() -> None:
    figures: dict[str, float] = {}
    head = ("layout", "chunk", "op", "kvferry GB/s", "memcpy GB/s", "ratio")
    print(f"{head[0]:<12} {head[1]:>6} {head[2]:<10} {head[3]:>13} {head[4]:>12} {head[5]:>6}")
    for kind, prefix in (("block-first", ""), ("vllm-cpu", "lbhnc_")):
        for name, chunk in CHUNKS.items():
            trial = Trial(kind, chunk, seed=len(figures))
            nbytes = trial.move * chunk
            ops: list[tuple[str, Callable[[], float]]] = [
                ("store", trial.store),
                ("load", trial.load),
            ]
            if name == "256k":
                ops.append(("concurrent", trial.concurrent))
            for op_name, op in ops:
                n = nbytes if op_name != "concurrent" else (trial.move // 2) * 2 * chunk
                r, k, m = ratios(trial, op, n)
                print(f"{kind:<12} {name:>6} {op_name:<10} {k:>13.2f} {m:>12.2f} {r:>6.2f}")
                key = (
                    f"{prefix}{op_name}_vs_memcpy"
                    if op_name == "concurrent"
                    else f"{prefix}{op_name}_vs_memcpy_{name}"
                )
                figures[key] = round(r, 3)
            trial.close()
            del trial
            gc.collect()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
