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

``*_before`` (vLLM-CPU's layout at 16 KiB chunks): the same trials through a second
engine whose kernel neither prefetches ahead nor copies descriptors in pairs (the
kernel as it was before either), interleaved with the default one, so the two figures
compare within one run. ``*_kernel_*`` (same
layout and chunk): the copy kernel alone, one call over ``MOVE_MIB`` of random chunks on
one thread, its CPU time against the CPU time of the memcpy (so that other tenants'
use of the two cores, which moves every wall-clock figure here, moves these little).

Host pool (``hostpool_*``): seconds per GiB to get a zeroed, populated pool of
``HOSTPOOL_GIB`` — :class:`~kvferry.transfer.HostPool` as it chooses
(``hostpool_s_per_gib``), with huge pages and without (``hostpool_huge_pages_*``,
``hostpool_small_pages_*``), against the way it was made before,
``torch.empty(...).fill_(0)`` on one thread (``hostpool_torch_s_per_gib``) — median
over repeats that alternate the four, the order rotating. Each starts
``HOSTPOOL_PAUSE_S`` after the last one freed its memory: a virtual machine with free
page reporting (as here: the host takes back free blocks of 2 MiB and more after about
2 s) would otherwise hand that memory back still backed, which an engine's start never
sees. :func:`host_pool_seconds` is the function a CUDA benchmark calls for
``pinned_pool_s_32g`` (``host_pool_seconds(32 << 30, pin=True)``; ``huge_pages=``
forces the choice either way).

``--only WORD`` runs only the sections whose name contains WORD (``hostpool``,
``vllm-cpu 16k``, ...).

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import functools
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
from kvferry.transfer._kernel import BatchKernel, jit_kernel  # noqa: E402
from kvferry.transfer._plan import plan_job  # noqa: E402

QUICK = "--quick" in sys.argv
ONLY = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else ""
TRIALS = 3 if QUICK else 11
POOL_MIB = 256 if QUICK else 1024
MOVE_MIB = 64 if QUICK else 128
JOB_MIB = 8
LAYERS = 8
CHUNKS = {"16k": 16 << 10, "64k": 64 << 10, "256k": 256 << 10, "2m": 2 << 20}
HOSTPOOL_GIB = 1 if QUICK else 2
HOSTPOOL_REPEATS = 2 if QUICK else 4
HOSTPOOL_PAUSE_S = 3.0


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
    direction: str,
    blocks: np.ndarray,
    rows: np.ndarray,
    chunk: int,
    first_id: int,
    job_bytes: int = JOB_MIB << 20,
) -> list[CopyJob]:
    per_job = max(1, job_bytes // chunk)
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

    def memcpy(self, nbytes: int, clock: Callable[[], float] = time.perf_counter) -> float:
        """Seconds of one contiguous copy of ``nbytes`` from the KV cache to the pool."""
        span = len(self.kv_bytes) - nbytes
        a, b = (int(x) // 4096 * 4096 for x in self.rng.integers(0, span + 1, 2))
        t0 = clock()
        np.copyto(self.pool_bytes[b : b + nbytes], self.kv_bytes[a : a + nbytes])
        return clock() - t0

    def kernel(self, direction: str, kernel: BatchKernel) -> float:
        """CPU seconds of one kernel call over the descriptors of ``MOVE_MIB`` of random
        chunks, on this thread: what the copy kernel itself costs, whatever else the
        machine's cores are doing."""
        blocks, rows = self.pick(self.move)
        (job,) = jobs_for(direction, blocks, rows, self.chunk, 0, job_bytes=self.move * self.chunk)
        host = self.pool.rows
        plan = plan_job(self.layout, job, host.data_ptr(), host.stride(0))
        t0 = time.thread_time()
        kernel(plan.dsts, plan.srcs, plan.sizes)
        return time.thread_time() - t0

    def store(self, engine: ThreadCopyEngine | None = None) -> float:
        blocks, rows = self.pick(self.move)
        return run_jobs(engine or self.engine, jobs_for("store", blocks, rows, self.chunk, 0))

    def load(self, engine: ThreadCopyEngine | None = None) -> float:
        blocks, rows = self.pick(self.move)
        return run_jobs(engine or self.engine, jobs_for("load", blocks, rows, self.chunk, 0))

    def concurrent(self) -> float:
        half = self.move // 2
        blocks, rows = self.pick(2 * half)
        stores = jobs_for("store", blocks[:half], rows[:half], self.chunk, 0)
        loads = jobs_for("load", blocks[half:], rows[half:], self.chunk, 10_000)
        mixed = [j for pair in zip(stores, loads, strict=True) for j in pair]
        return run_jobs(self.engine, mixed)

    def close(self) -> None:
        self.engine.close()
        self.pool.close()


_scratch: list[np.ndarray] = []


def cold(op: Callable[[], float]) -> float:
    """Run ``op`` with the caches emptied of both buffers (the L3 here is ~260 MiB,
    shared with other tenants: a warm source would flatter whichever side had it)."""
    if not _scratch:  # made on first use, so importing this module costs nothing
        _scratch.append(np.ones((384 << 20) // 8, dtype=np.uint64))
    gc.collect()
    _scratch[0].sum()
    return op()


def ratios(
    trial: Trial, ops: dict[str, Callable[[], float]], nbytes: int
) -> dict[str, tuple[float, float, float]]:
    """Per op: (median ratio, median kvferry GB/s, median memcpy GB/s) over trials that
    alternate a memcpy and each op in turn."""
    for op in ops.values():
        op()  # warm up: the JIT kernel, first-touch of index arrays
    rs: dict[str, list[float]] = {name: [] for name in ops}
    ks: dict[str, list[float]] = {name: [] for name in ops}
    ms: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(TRIALS):
        for name, op in ops.items():
            m = nbytes / cold(lambda: trial.memcpy(nbytes)) / 1e9
            k = nbytes / cold(op) / 1e9
            rs[name].append(k / m)
            ks[name].append(k)
            ms[name].append(m)
    med = statistics.median
    return {name: (med(rs[name]), med(ks[name]), med(ms[name])) for name in ops}


def kernel_ratios(trial: Trial, kernels: dict[str, BatchKernel]) -> dict[str, float]:
    """Per direction and kernel: median over trials of memcpy CPU time ÷ kernel CPU time,
    both single-threaded, alternating."""
    nbytes = trial.move * trial.chunk
    rs: dict[str, list[float]] = {}
    for direction in ("store", "load"):
        for kernel in kernels.values():
            trial.kernel(direction, kernel)  # warm up
        for _ in range(TRIALS):
            for name, kernel in kernels.items():
                m = cold(lambda: trial.memcpy(nbytes, time.thread_time))
                k = cold(functools.partial(trial.kernel, direction, kernel))
                rs.setdefault(f"{direction}_kernel{name}", []).append(m / k)
    return {key: statistics.median(r) for key, r in rs.items()}


def host_pool_seconds(nbytes: int, *, pin: bool = False, huge_pages: bool | None = None) -> float:
    """Seconds to make (and, with ``pin``, page-lock) a :class:`HostPool` of ``nbytes``
    in rows of 1 MiB; the pool is closed and dropped before returning."""
    row = 1 << 20
    t0 = time.perf_counter()
    pool = HostPool(
        num_slots=-(-nbytes // row),
        blocks_per_chunk=1,
        row_bytes=row,
        pin=pin,
        huge_pages=huge_pages,
    )
    seconds = time.perf_counter() - t0
    pool.close()
    del pool
    gc.collect()
    return seconds


def torch_pool_seconds(nbytes: int, *, pin: bool = False) -> float:
    """Seconds to make a pool the way :class:`HostPool` did before: ``torch.empty``
    (``pin_memory``), then ``fill_(0)`` on one thread to touch every page."""
    t0 = time.perf_counter()
    rows = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    rows.fill_(0)
    seconds = time.perf_counter() - t0
    del rows
    gc.collect()
    return seconds


def host_pool_figures() -> dict[str, float]:
    nbytes = HOSTPOOL_GIB << 30
    ways: dict[str, Callable[[int], float]] = {
        "hostpool": host_pool_seconds,
        "hostpool_huge_pages": functools.partial(host_pool_seconds, huge_pages=True),
        "hostpool_small_pages": functools.partial(host_pool_seconds, huge_pages=False),
        "hostpool_torch": torch_pool_seconds,
    }
    names = list(ways)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(HOSTPOOL_REPEATS):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            time.sleep(HOSTPOOL_PAUSE_S)
            seconds[name].append(ways[name](nbytes) / HOSTPOOL_GIB)
    figures: dict[str, float] = {}
    for name, s in seconds.items():
        figures[f"{name}_s_per_gib"] = round(statistics.median(s), 3)
        runs = " ".join(f"{x:.2f}" for x in s)
        print(f"{name:<22} {HOSTPOOL_GIB} GiB: {statistics.median(s):.3f} s/GiB (runs: {runs})")
    return figures


def copy_figures(figures: dict[str, float]) -> None:
    head = ("layout", "chunk", "op", "kvferry GB/s", "memcpy GB/s", "ratio")
    print(f"{head[0]:<12} {head[1]:>6} {head[2]:<26} {head[3]:>13} {head[4]:>12} {head[5]:>6}")
    for kind, prefix in (("block-first", ""), ("vllm-cpu", "lbhnc_")):
        for name, chunk in CHUNKS.items():
            if ONLY not in f"{kind} {name}":
                continue
            trial = Trial(kind, chunk, seed=len(figures))
            nbytes = trial.move * chunk
            ops: dict[str, Callable[[], float]] = {"store": trial.store, "load": trial.load}
            before: ThreadCopyEngine | None = None
            if kind == "vllm-cpu" and name == "16k" and trial.engine.kernel_name == "jit":
                before = ThreadCopyEngine(
                    trial.layout, trial.pool, kernel=jit_kernel(prefetch_ahead=0, pair_max_bytes=0)
                )
                ops["store_before"] = functools.partial(trial.store, before)
                ops["load_before"] = functools.partial(trial.load, before)
            rows = ratios(trial, ops, nbytes)
            if name == "256k":
                half = (trial.move // 2) * 2 * chunk
                rows |= ratios(trial, {"concurrent": trial.concurrent}, half)
            for op_name, (r, k, m) in rows.items():
                print(f"{kind:<12} {name:>6} {op_name:<26} {k:>13.2f} {m:>12.2f} {r:>6.2f}")
                key = (
                    f"{prefix}{op_name}_vs_memcpy"
                    if op_name == "concurrent"
                    else f"{prefix}{op_name.removesuffix('_before')}_vs_memcpy_{name}"
                    + ("_before" if op_name.endswith("_before") else "")
                )
                figures[key] = round(r, 3)
            if before is not None:
                before.close()
                # The kernel alone, one thread, CPU time: the figure that noisy
                # neighbours on the cores cannot move much.
                kernels = {
                    "": jit_kernel(),
                    "_before": jit_kernel(prefetch_ahead=0, pair_max_bytes=0),
                }
                for key, r in kernel_ratios(trial, kernels).items():
                    print(f"{kind:<12} {name:>6} {key:<26} {'':>13} {'':>12} {r:>6.2f}")
                    op_name, _, variant = key.partition("_kernel")
                    figures[f"{prefix}{op_name}_kernel_vs_memcpy_{name}{variant}"] = round(r, 3)
            trial.close()
            del trial
            gc.collect()


def main() -> None:
    figures: dict[str, float] = {}
    if not ONLY or ONLY in "hostpool":
        figures |= host_pool_figures()
    copy_figures(figures)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
