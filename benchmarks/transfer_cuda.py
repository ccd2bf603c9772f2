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
submission to the end of the last job (its completion, then ``torch.cuda.synchronize``):

- ``dma``: the limit — one contiguous pinned copy of the same bytes, one way; ``dma2``
  both ways at once on two streams;
- kvferry's default (staged) path, enqueued by the engine's issue thread:
  :class:`~kvferry.transfer.CudaCopyEngine`, jobs one by one through ``submit(job)``
  (``*_each``) and as one step batch through ``submit_batch(jobs)`` (``*_batch``); stores
  and loads at once (``both``, half the bytes each way) against ``dma2``; ``*_steps``:
  ``STEPS`` step batches handed over back to back, as consecutive engine steps do;
  ``*_chunked``: each job to the consecutive rows of one host slot, as the connector's
  pool lays out a chunk; ``*_inline``: the same step batch enqueued by the calling
  thread (``issue="inline"``);
- the direct path (``direct_*``; ``*_p1`` / ``*_p8`` with ``row_programs`` capped);
- ``native``: vLLM 0.32's way, one ``cuMemcpyBatchAsync`` per job of every (block,
  layer, K/V) page (through ``cuda.bindings``, where importable; its arguments are built
  before the timing, as vLLM builds them in C++).

``submit_us_per_batch`` / ``_per_job`` is the calling thread's time inside the
submissions of a step batch (``inline_submit_us_per_batch`` when it enqueues them itself,
``direct_submit_us_per_batch`` on the direct path); ``issue_thread_us_per_batch`` /
``_per_piece`` the issue thread's CPU time for one. Trials alternate the configurations;
figures are medians.

Compute beside copies: a chain of 8192^3 bf16 matrix products on a compute stream,
alone and while rounds of step batches run, for each path (``compute_slowdown_*``, and
``copy_under_compute_*`` the copies' rate beside it over their rate alone).

The embedding API: ``kvferry.Ferry`` on an asyncio loop with the 32k KV cache, 64
concurrent ``store`` calls of 16 blocks then 64 concurrent ``load`` calls, while a task
ticks every 1 ms and records its lag (``ferry_loop_lag_ms_p99`` / ``_max``).

``pinned_pool_s_32g``: seconds to allocate and pin a 32 GiB host pool
(:class:`~kvferry.transfer.HostPool`, ``pin=True``), when the machine has the memory;
``_huge`` / ``_small`` with transparent huge pages forced on / off;
``unpinned_pool_s_32g_huge`` the same pool populated but not pinned.

Measured on an H200 (PCIe gen 5 x16; DMA 54-55 GB/s each way, 100 GB/s both ways), two
runs of one session (its machine slower on the CPU side than an earlier session's, where
the path then reached 0.83 / 0.88 at 4 KiB): staged store / load 0.95 / 0.96 of DMA at 32
KiB pages (0.98 / 0.99 as consecutive step batches), 0.72-0.79 / 0.76-0.77 at 4 KiB (0.87-
0.88 / 0.92 as step batches, 0.80 / 0.80 chunked); vLLM's way 1.38-1.43x / 1.45-1.55x
and 5.1-8.5x / 5.6-9.8x of it; both ways at once 0.89-0.93 / 0.53 of the two-way limit
(as step batches 0.81-0.98 / 0.66-0.73); the calling thread 71-94 µs for a 64-job step
batch of 2 GiB and 37-64 µs for one of 192 MiB (enqueuing them inline: 8.6-9.5 / 1.7-2.9
ms; the issue thread's CPU 98-104 / 237-301 µs a piece); direct 0.92 / 0.89 and 0.74-0.75
/ 0.74-0.75; matrix products beside the copies 1.02x as long (staged), 3.8-4.2x
(direct), 2.2-2.4x (direct, one program per page); ``Ferry``'s loop lag 2.6-2.8 ms at p99
(3.0 at worst), its stores and loads 0.60-0.79 / 0.64-0.79 of DMA; a pinned 32 GiB pool
8.9-9.9 s by default (huge pages; timed first), 5.7-5.9 s with huge pages forced (timed
next; 4.3-4.8 s of it populating), 10.5-10.9 s with small pages.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
import traceback
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
PROGRAM_CAPS = (1, 8)
"""Caps on the direct kernel's programs along the rows (``row_programs``), measured beside
the default: how few multiprocessors' worth of programs still fill the link."""
TRIALS = 3 if QUICK else 7
STEPS = 4
"""Step batches handed over back to back in the ``*_steps`` configurations."""


def kv_caches(shape: str, num_blocks: int, device: str) -> dict[str, torch.Tensor]:
    layers, heads, dim = SHAPES[shape]
    return {
        f"l{i}": torch.zeros(
            (2, num_blocks, BLOCK_TOKENS, heads, dim), dtype=torch.bfloat16, device=device
        )
        for i in range(layers)
    }


def make_jobs(
    direction: str,
    num_blocks: int,
    num_rows: int,
    seed: int,
    first_id: int = 0,
    *,
    chunked: bool = False,
) -> list[CopyJob]:
    """``JOBS`` jobs of ``BLOCKS_PER_JOB`` random engine blocks; each block to a random
    host row, or (``chunked``) each job to the consecutive rows of a random host slot,
    as the connector's pool lays out a chunk."""
    rng = np.random.default_rng(seed)
    blocks = rng.choice(num_blocks, JOBS * BLOCKS_PER_JOB, replace=False)
    if chunked:
        slots = rng.choice(num_rows // BLOCKS_PER_JOB, JOBS, replace=False)
        rows = (slots[:, None] * BLOCKS_PER_JOB + np.arange(BLOCKS_PER_JOB)).ravel()
    else:
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
    """Seconds from the call of ``fn`` to the end of everything it started: the jobs
    whose completions it returns (handed to an engine's issue thread, they are enqueued
    only then), and the device."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    started = fn()
    for completion in started if isinstance(started, list) else ():
        completion.synchronize()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


class Native:
    """vLLM's way: one ``cuMemcpyBatchAsync`` of every page of a job."""

    def __init__(self, layout: KVLayout, pool: HostPool) -> None:
        from cuda.bindings import driver  # the GPU machine's wheel; absent: no baseline

        self.driver = driver
        self.templates = [PageTemplate.of(g, max_page_bytes=1 << 40) for g in layout.groups]
        self.pool = pool
        # as vLLM: a store's source in stream order, a load's (host memory) in any order
        order = driver.CUmemcpySrcAccessOrder
        self.attrs = {}
        for direction, access in (
            ("store", order.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM),
            ("load", order.CU_MEMCPY_SRC_ACCESS_ORDER_ANY),
        ):
            attr = driver.CUmemcpyAttributes()
            attr.srcAccessOrder = access
            self.attrs[direction] = attr

    def prepare(self, job: CopyJob) -> list[Any]:
        """The call's arguments for ``job`` (vLLM builds them in C++ from tensors of
        pointers: built here before the timing, only the call is timed)."""
        t = self.templates[0]
        part = job.parts[0]
        dev = (t.dev_offset + part.device_blocks[:, None] * t.block_stride).ravel()
        host = (
            self.pool.rows.data_ptr()
            + (part.host_rows[:, None] * self.pool.row_bytes + t.row_offset)
        ).ravel()
        sizes = np.broadcast_to(t.nbytes, (len(part.device_blocks), len(t))).ravel()
        src, dst = (dev, host) if job.direction == "store" else (host, dev)
        ptr = self.driver.CUdeviceptr
        return [
            [ptr(int(a)) for a in dst],
            [ptr(int(a)) for a in src],
            [int(n) for n in sizes],
            len(sizes),
            [self.attrs[job.direction]],
            [0],
            1,
        ]

    def submit(self, args: list[Any], stream: Any) -> None:
        result = self.driver.cuMemcpyBatchAsync(*args, stream.cuda_stream)  # CUDA 13
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
    engine = CudaCopyEngine(layout, pool)  # the default path: staged, issue thread
    inline = CudaCopyEngine(layout, pool, issue="inline")  # enqueued by the calling thread
    direct = CudaCopyEngine(layout, pool, path="direct")
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
    print(f"[{shape}] default path: {engine.path}", flush=True)

    def add(key: str, seconds: float, moved: int = nbytes) -> None:
        res.setdefault(key, []).append(moved / seconds / 1e9)

    def two_way() -> None:
        with torch.cuda.stream(s1):
            host_buf.copy_(dev_buf, non_blocking=True)
        with torch.cuda.stream(s2):
            dev_buf2.copy_(host_buf2, non_blocking=True)

    def each(jobs: list[CopyJob]) -> list[Any]:
        return [engine.submit(j) for j in jobs]

    def batch(jobs: list[CopyJob], by: CudaCopyEngine = engine) -> list[Any]:
        t0 = time.perf_counter()
        done = by.submit_batch(jobs)
        (submit_us if by is engine else inline_us).append((time.perf_counter() - t0) * 1e6)
        return done

    inline_us: list[float] = []
    issue_us: list[float] = []  # the issue thread's CPU time for a step batch
    issue_pieces: list[int] = []

    def issuing(key: str, fn: Callable[[], list[Any]]) -> None:
        before = engine.statistics()
        add(key, timed(fn))  # its jobs ended: the issue thread is done with the batch
        after = engine.statistics()
        issue_us.append((after.issue_cpu_s - before.issue_cpu_s) * 1e6)
        issue_pieces.append(after.pieces - before.pieces)

    native_stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def direct_batch(jobs: list[CopyJob]) -> list[Any]:
        t0 = time.perf_counter()
        done = direct.submit_batch(jobs)
        direct_us.append((time.perf_counter() - t0) * 1e6)
        return done

    direct_us: list[float] = []

    def natively(args: list[list[Any]]) -> None:
        # a stream of its own: the batched copy refuses the legacy default stream
        for a in args:
            native.submit(a, native_stream)  # type: ignore[union-attr]

    def capped(jobs: list[CopyJob], programs: int) -> list[Any]:
        direct.row_programs = programs  # read when the issue thread enqueues the batch
        try:
            done = direct.submit_batch(jobs)
            direct.wait_enqueued()
            return done
        finally:
            direct.row_programs = default_programs

    default_programs = direct.row_programs

    half = JOBS // 2
    for trial in range(TRIALS):
        stores = make_jobs("store", num_blocks, num_rows, 100 + trial)
        loads = make_jobs("load", num_blocks, num_rows, 150 + trial, first_id=1000)
        chunked = [
            make_jobs(d, num_blocks, num_rows, 170 + trial, chunked=True) for d in ("store", "load")
        ]
        add("dma_store", timed(lambda: host_buf.copy_(dev_buf, non_blocking=True)))
        add("dma_load", timed(lambda: dev_buf.copy_(host_buf, non_blocking=True)))
        add("dma2", timed(two_way), 2 * nbytes)
        add("store_each", timed(lambda: each(stores)))  # noqa: B023 (called at once)
        add("load_each", timed(lambda: each(loads)))  # noqa: B023
        issuing("store_batch", lambda: batch(stores))  # noqa: B023
        issuing("load_batch", lambda: batch(loads))  # noqa: B023
        add("both", timed(lambda: batch(stores[:half] + loads[:half])))  # noqa: B023
        # consecutive engine steps: STEPS batches handed over back to back, as a serving
        # engine does, so one batch's planning overlaps the last one's copies
        steps = {
            d: [make_jobs(d, num_blocks, num_rows, 200 + 10 * trial + k) for k in range(STEPS)]
            for d in ("store", "load")
        }
        for d, batches in steps.items():
            moved = STEPS * nbytes
            add(f"{d}_steps", timed(lambda b=batches: [c for j in b for c in batch(j)]), moved)
        mixed = [s[:half] + l_[half:] for s, l_ in zip(steps["store"], steps["load"], strict=True)]
        add("both_steps", timed(lambda: [c for j in mixed for c in batch(j)]), STEPS * nbytes)  # noqa: B023
        add("store_chunked", timed(lambda: batch(chunked[0])))  # noqa: B023
        add("load_chunked", timed(lambda: batch(chunked[1])))  # noqa: B023
        add("both_chunked", timed(lambda: batch(chunked[0][:half] + chunked[1][half:])))  # noqa: B023
        add("store_inline", timed(lambda: batch(stores, inline)))  # noqa: B023
        add("load_inline", timed(lambda: batch(loads, inline)))  # noqa: B023
        add("both_inline", timed(lambda: batch(stores[:half] + loads[:half], inline)))  # noqa: B023
        add("direct_store_batch", timed(lambda: direct_batch(stores)))  # noqa: B023
        add("direct_load_batch", timed(lambda: direct_batch(loads)))  # noqa: B023
        add("direct_both", timed(lambda: direct.submit_batch(stores[:half] + loads[:half])))  # noqa: B023
        for programs in PROGRAM_CAPS:
            add(f"store_p{programs}", timed(lambda: capped(stores, programs)))  # noqa: B023
            add(f"load_p{programs}", timed(lambda: capped(loads, programs)))  # noqa: B023
        if native is not None:
            s_args = [native.prepare(j) for j in stores]
            l_args = [native.prepare(j) for j in loads]
            try:
                add("native_store", timed(lambda: natively(s_args)))  # noqa: B023
                add("native_load", timed(lambda: natively(l_args)))  # noqa: B023
            except Exception as exc:  # a driver refusing the call: no baseline
                print(f"[{shape}] vLLM's way failed: {exc!r}")
                native = None
    engine.close()
    inline.close()
    direct.close()
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
    per_batch = statistics.median(submit_us)
    figures[f"submit_us_per_batch_{shape}"] = round(per_batch, 1)
    figures[f"submit_us_per_job_{shape}"] = round(per_batch / JOBS, 2)
    figures[f"direct_submit_us_per_batch_{shape}"] = round(statistics.median(direct_us), 1)
    figures[f"inline_submit_us_per_batch_{shape}"] = round(statistics.median(inline_us), 1)
    figures[f"issue_thread_us_per_batch_{shape}"] = round(statistics.median(issue_us), 1)
    figures[f"issue_thread_us_per_piece_{shape}"] = round(sum(issue_us) / sum(issue_pieces), 1)
    for d in ("store", "load"):
        figures[f"{d}_chunked_vs_dma_{shape}"] = round(med[f"{d}_chunked"] / med[f"dma_{d}"], 3)
    figures[f"both_chunked_vs_dma_{shape}"] = round(med["both_chunked"] / med["dma2"], 3)
    for d in ("store", "load"):
        figures[f"{d}_steps_vs_dma_{shape}"] = round(med[f"{d}_steps"] / med[f"dma_{d}"], 3)
    figures[f"both_steps_vs_dma_{shape}"] = round(med["both_steps"] / med["dma2"], 3)
    for d in ("store", "load", "both"):
        figures[f"inline_{d}_vs_thread_{shape}"] = round(
            med[f"{d}_inline"] / med[d if d == "both" else f"{d}_batch"], 3
        )
    figures[f"direct_store_vs_dma_{shape}"] = round(med["direct_store_batch"] / med["dma_store"], 3)
    figures[f"direct_load_vs_dma_{shape}"] = round(med["direct_load_batch"] / med["dma_load"], 3)
    figures[f"direct_both_vs_dma_{shape}"] = round(med["direct_both"] / med["dma2"], 3)
    for programs in PROGRAM_CAPS:
        for d in ("store", "load"):
            figures[f"direct_{d}_p{programs}_vs_dma_{shape}"] = round(
                med[f"{d}_p{programs}"] / med[f"dma_{d}"], 3
            )
    return [(shape, key, med[key]) for key in sorted(med)]


def run_cuda() -> dict[str, Any]:
    from kvferry.transfer._cuda import _batch_copy

    # the staged path's DMA: one driver call per piece, or (without one) a copy per run
    figures: dict[str, Any] = {"batched_copy": _batch_copy() is not None}
    print(f"batched copy (cuMemcpyBatchAsync): {figures['batched_copy']}")
    rows_out = []
    for shape in SHAPES:
        rows_out += measure_shape(shape, figures)
        torch.cuda.empty_cache()
    print(f"{'shape':6} {'configuration':14} {'GB/s':>8}")
    for shape, key, gbps in rows_out:
        print(f"{shape:6} {key:14} {gbps:8.2f}")
    print(json.dumps(figures), flush=True)
    for part in (compute_interference, ferry_lag, lambda: pinned_pools(32 << 30)):
        try:
            figures.update(part())
        except Exception as exc:  # one part failing still reports the others
            traceback.print_exc()
            figures[f"error_{getattr(part, '__name__', 'pinned_pools')}"] = repr(exc)[:200]
    return figures


def compute_interference() -> dict[str, Any]:
    """What copies cost the engine's compute, and compute the copies: a chain of 8192^3
    bf16 matrix products on a compute stream, alone and while rounds of step batches
    (32k shape, stores and loads at once) run, for each path; and the copies alone.

    ``compute_slowdown_<path>`` is the products' time with copies over their time alone
    (CUDA events on the compute stream); ``copy_under_compute_<path>`` the copies' rate
    with the products over their rate alone.
    """
    n = 8192
    g = torch.Generator(device="cuda").manual_seed(3)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g)
    c = torch.empty_like(a)
    compute = torch.cuda.Stream()
    num_blocks = 2 * JOBS * BLOCKS_PER_JOB
    kv = kv_caches("32k", num_blocks, "cuda")
    for t in kv.values():
        t.normal_()
    layout = describe_kv_caches(kv, [list(kv)], num_blocks)
    pool = HostPool(num_slots=num_blocks, blocks_per_chunk=1, row_bytes=layout.row_bytes, pin=True)
    engines = {
        "staged": CudaCopyEngine(layout, pool),
        "direct": CudaCopyEngine(layout, pool, path="direct"),
        "direct_p1": CudaCopyEngine(layout, pool, path="direct", row_programs=1),
    }
    half = JOBS // 2
    rounds = 4 if QUICK else 8
    batches = [
        make_jobs("store", num_blocks, num_blocks, 300 + r)[:half]
        + make_jobs("load", num_blocks, num_blocks, 400 + r, first_id=1000)[:half]
        for r in range(rounds)
    ]
    moved = rounds * JOBS * BLOCKS_PER_JOB * layout.row_bytes

    def products(k: int) -> tuple[Any, Any]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(compute):
            start.record()
            for _ in range(k):
                torch.mm(a, b, out=c)
            end.record()
        return start, end

    def copies(engine: CudaCopyEngine) -> float:
        t0 = time.perf_counter()
        done = [c for jobs in batches for c in engine.submit_batch(jobs)]
        for d in done:
            d.synchronize()
        return time.perf_counter() - t0

    # as many products as take about as long as the copies
    torch.cuda.synchronize()
    s0, e0 = products(20)
    torch.cuda.synchronize()
    per_product = s0.elapsed_time(e0) / 20
    copy_alone = {name: [] for name in engines}  # type: dict[str, list[float]]
    for name, engine in engines.items():
        copies(engine)  # warm
        copy_alone[name].append(copies(engine))
    k = max(10, int(max(min(v) for v in copy_alone.values()) * 1e3 / per_product * 1.5))
    alone: list[float] = []
    with_copies: dict[str, list[float]] = {name: [] for name in engines}
    under: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(2 if QUICK else 3):
        torch.cuda.synchronize()
        s1, e1 = products(k)
        torch.cuda.synchronize()
        alone.append(s1.elapsed_time(e1))
        for name, engine in engines.items():
            copy_alone[name].append(copies(engine))
            torch.cuda.synchronize()
            s2, e2 = products(k)
            under[name].append(copies(engine))
            torch.cuda.synchronize()
            with_copies[name].append(s2.elapsed_time(e2))
    for engine in engines.values():
        engine.close()
    base = statistics.median(alone)
    out: dict[str, Any] = {"compute_products": k, "compute_alone_ms": round(base, 1)}
    print(f"{'path':12} {'copy GB/s alone':>16} {'under compute':>14} {'compute slowdown':>17}")
    for name in engines:
        ca = statistics.median(copy_alone[name])
        cu = statistics.median(under[name])
        slow = statistics.median(with_copies[name]) / base
        print(f"{name:12} {moved / ca / 1e9:16.2f} {moved / cu / 1e9:14.2f} {slow:17.3f}")
        out[f"compute_slowdown_{name}"] = round(slow, 3)
        out[f"copy_under_compute_{name}"] = round(ca / cu, 3)
    return out


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
        "pinned_pool_s_32g_small": round(host_pool_seconds(nbytes, pin=True, huge_pages=False), 2),
        # populated alone (huge pages, not pinned): the rest of _huge is the pinning
        "unpinned_pool_s_32g_huge": round(host_pool_seconds(nbytes, huge_pages=True), 2),
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
