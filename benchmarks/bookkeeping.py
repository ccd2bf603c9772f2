"""Bookkeeping of the host tier: kvferry's Directory against vLLM's CPUOffloadingManager.

One seeded trace — requests over shared document prefixes (Zipf-skewed), each with a
unique question suffix, and bursts of one-off long documents (scans) — replayed through
kvferry's directory (driven directly and synchronously, message by message, as its
DirectoryActor and EvictorActor would) and through vLLM 0.32's ``CPUOffloadingManager``
(policies "lru" and "arc"), driven the way its OffloadingConnector drives it: per key
``lookup`` until the first miss, ``prepare_load`` of the hit prefix, ``prepare_store`` of
the rest, and later ``complete_load`` / ``complete_store`` / ``on_request_finished``.
``--window`` requests are in flight at once (their loads pinned, their stores pending).

Figures:
- ns per op: CPU time (``time.process_time``, best of ``--repeats``, runs interleaved)
  per block of a request taken through lookup and its load or store (prepare and
  complete). The op count is the trace's, the same for every system.
- hit rate: blocks a lookup found ready ÷ blocks looked up.
- bytes per block: ``tracemalloc`` (numpy's buffers included) of the whole structure
  holding 1,000,000 blocks after 1,000,000 more were stored through it (evictions done,
  ghost lists full), keys of 36 bytes (a 32-byte block hash + a 4-byte group), held by
  nothing but the structure; at the default watermarks, and at the connector's (1, 1)
  (``*_inline``: below 1M slots, with the dict index, LRU's order is then an
  OrderedDict; at the table's 1M, logs with either).
- the directory's two key indexes: its default (``index``: compact from 100k slots where
  compiled, else a dict), and each named, ``index="dict"`` (a dict of the caller's keys)
  and ``index="compact"`` (no Python object per block): ``*_dict`` and ``*_compact``
  keys in the JSON.
- the directory's per-request passes over slots compiled (numba, its default where
  installed: the headline figures) and in Python (``compiled=False``, what runs without
  numba): ``*_python`` keys; ``compiled_loops`` says which the headline ran.
- index: the cost of resolving a request's keys with a dict and with the directory's
  compact :class:`~kvferry.cache._index.KeyIndex` (no Python object per key; compiled
  where numba is installed), and their bytes per key.
- ``index``, ``index_memory``: the index the directory chose by default for the replays'
  capacity and for the memory table's.

- scaling: a full directory of 10k, 100k, 1M and 4M slots, at watermarks (1, 1) (every
  store evicts inline) and the default ones (the evictor's batches), then the same
  steady work at each: ns per block-op (the ratio 4M / 10k: ``scaling_4m_vs_10k``, the
  worst policy and watermarks), and CPU µs per evicted key inside the directory's
  eviction (``evict_us_per_key_*``, the worst policy and watermarks).

Traces are seeded from ``--seed`` (default: a fresh seed, printed first); ``--runs N``
replays N traces (seeds ``seed``.. ``seed + N - 1``), and makes the scaling table once a
seed, and reports the median and the spread (``*_spread``: min, max) of each figure.
The last line printed is one JSON object with the figures.

Measured on the 2-core CPU machine while other jobs (end-to-end tests) kept its load at
5-9, seed 500, before and after an eviction's numpy calls were cut (fewer calls, index
arrays, ghost pushes batched; every policy's victims still checked once): dict
index ``evict_us_per_key_1m`` 7.1-8.1 -> 2.0-2.6, ``evict_us_per_key_4m`` 7.6-7.7 ->
2.8-2.9; compact index 5.3-8.5 -> 3.0-3.4 and 9.2-10.6 -> 2.0-2.9. The worst is ARC (or
S3-FIFO) evicting 64 blocks at a time at watermarks (1, 1) (LRU 1.1-2.3 there, every
policy 0.24-1.7 in the evictor's batches): a numpy call costs 1-5 µs here under such
load and such an eviction still makes about 30, and a ghost list enters its tags into a
table of millions (~0.5 µs a key of cache misses). ``scaling_4m_vs_10k`` 1.3-2.2 (LRU at
(1, 1)): the 10k runs got faster (their eviction was mostly numpy calls), the 4M ones
pay cache misses per op (a dict of 4M keys, arrays of 4M slots). Before any of this, an
eviction at (1, 1) passed over every slot: 28 µs per op for LRU at (1, 1) on the replay.
Later, with the ghost lists' tag table taking rows with ``np.take`` and ordering a batch
by one sort (a push of 64 tags 52 -> 25 µs at 100k slots), ``--runs 3`` (seeds
500-502), on a quieter machine: ``evict_us_per_key_1m`` median 1.90 (1.82-2.71),
``_4m`` 3.21 (2.91-3.26; ARC inline, its index removals and recency pops), and
``scaling_4m_vs_10k`` 1.48 (1.22-2.10). On a quiet machine (load under 1, nothing else
running), ``--runs 3 --skip-memory`` (seeds 600-602): ``evict_us_per_key_1m`` 1.31
(1.30-1.31), ``_4m`` 1.28 (1.21-1.45), ``scaling_4m_vs_10k`` 1.49 (1.38-1.67; LRU at
(1, 1) the worst in each run), ``ns_per_op_vs_vllm_arc`` 0.50 (0.49-0.51), ``_lru`` 0.18
(0.17-0.20). Later, with ARC's stored keys hashed in batches at the next eviction (the
directory's ``tags_in_batches``), its ghost lookups testing membership before searching
for positions and its target ``p`` adapted in one pass, three runs of ``--skip-memory
--skip-scaling`` on the 2-core machine shared with other work (seeds 600, 601, 602):
``ns_per_op_vs_vllm_arc`` 0.48, 0.46, 0.47 -> 0.44, 0.44, 0.43; ``_lru`` 0.17, 0.16,
0.16 before and 0.18, 0.16, 0.16 after; hit rates unchanged. Later, with the
directory's per-request passes over slots compiled (numba; ``compiled=False`` runs the
Python loops beside them in the same replays), ``--runs 3 --skip-memory --skip-scaling``
(seeds 600-602) on the quiet 2-core machine: ``ns_per_op_vs_vllm_arc`` 0.398
(0.384-0.399) compiled against 0.441 (0.429-0.446) in Python, ``_lru`` 0.149
(0.149-0.151) against 0.172 (0.169-0.172); hit rates unchanged. Later, with the ghost
lists' tag tables compiled too, a store's keys resolved straight into an array and its
slots marked STORING compiled, and from 1M slots a request's lookup kept for its touch,
the whole benchmark with ``--runs 3`` (seeds 600-602) on the 2-core machine, busier than
before (vLLM's ns/op up 5-10%): ``ns_per_op_vs_vllm_arc`` 0.358 (0.358-0.371) against
0.442 (0.416-0.450) in Python, ``_lru`` 0.135 (0.133-0.146) against 0.180
(0.170-0.181), ``bytes_per_block_vs_vllm`` 0.409 (a release counter per slot from 1M
slots), ``scaling_4m_vs_10k`` 1.540 (1.536-1.573; 1.470, 1.444-1.489, in a run of the
scaling table alone with the kept lookups only); hit rates unchanged. Then, with a full
recency log moved to a new buffer a little at a time (no pass over it in one call), the
same: ``_arc`` 0.374 (0.352-0.378), ``_lru`` 0.142 (0.142-0.143), ``bytes_per_block``
0.417 (two buffers while a log is moved), ``scaling_4m_vs_10k`` 1.533 (1.521-1.621),
and at 4M slots the slowest segment of a run within 5% of the fastest (it was up to 90%
slower: the one-pass compaction of a log of 8M entries, 55 ms in one call). Then, with the
compact index's find, insert and remove compiled and the directory's default from 100k
slots (the replays' capacities, 111k-119k, and the memory table's 1M take it; the
scaling table's 10k a dict), the same: ``_arc`` 0.348 (0.330-0.384), ``_lru`` 0.147
(0.138-0.151); with the compact index named 0.369 (0.363-0.372) and 0.149
(0.138-0.154), with the dict 0.381 (0.365-0.405) and 0.162 (0.149-0.172);
``bytes_per_block_vs_vllm`` 0.172 (91 bytes a block; the dict 0.417, ARC 0.282);
``scaling_4m_vs_10k`` 1.179 (1.153-1.240), ``evict_us_per_key_1m`` 0.846, ``_4m``
0.722; hit rates unchanged.
``--quick`` runs small traces and capacities (what the tests run).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import time
import tracemalloc
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvferry.cache import DEFAULT_WATERMARKS, Directory, _kernels
from kvferry.cache._index import KeyIndex

Keys = tuple[bytes, ...]


def make_trace(
    *,
    seed: int = 0,
    requests: int = 20_000,
    docs: int = 5_000,
    zipf: float = 0.8,
    scan_share: float = 0.25,
    scan_burst: int = 20,
) -> tuple[list[Keys], int]:
    """Requests as tuples of keys (prefix order), and the number of distinct keys.

    A request is a document's blocks (8..47, Zipf-popular, under one of 8 system prompts
    of 2 blocks) then 1..5 blocks of its own; ``scan_share`` of the requests come in
    bursts of ``scan_burst`` one-off documents of 32..63 blocks.
    """
    rng = np.random.default_rng(seed)
    counter = 0

    def new_key() -> bytes:
        nonlocal counter
        counter += 1
        return hashlib.sha256(counter.to_bytes(8, "big")).digest() + b"\0\0\0\0"

    system = [[new_key(), new_key()] for _ in range(8)]
    doc_keys = [
        system[d % 8] + [new_key() for _ in range(int(rng.integers(8, 48)))] for d in range(docs)
    ]
    popularity = 1.0 / np.arange(1, docs + 1) ** zipf
    popularity /= popularity.sum()
    order = rng.permutation(docs)
    picks = iter(order[rng.choice(docs, size=requests, p=popularity)].tolist())
    trace: list[Keys] = []
    while len(trace) < requests:
        if rng.random() < scan_share / scan_burst:
            for _ in range(scan_burst):
                trace.append(tuple(new_key() for _ in range(int(rng.integers(32, 64)))))
            continue
        doc = doc_keys[next(picks)]
        trace.append(tuple(doc + [new_key() for _ in range(int(rng.integers(1, 6)))]))
    return trace[:requests], counter


# -- drivers -----------------------------------------------------------------------------


class KVFerryDriver:
    """The messages the connector sends, handled as the DirectoryActor handles them;
    ``idle`` is what the EvictorActor does between messages."""

    def __init__(self, capacity: int, policy: str, **kwargs: Any) -> None:
        self.d = Directory(capacity, policy=policy, **kwargs)

    def start(self, keys: Keys) -> tuple[int, Any]:
        d = self.d
        n = d.lookup(keys)
        load = d.prepare_load(keys[:n]) if n else None
        return n, (keys, load, d.prepare_store(keys[n:]))

    def finish(self, job: Any) -> None:
        keys, load, store = job
        if load is not None:
            self.d.complete_load(load)
        store = store[store >= 0]
        if len(store):
            self.d.complete_store(store, True)
        self.d.touch(keys)  # the connector's Touch when a request ends (head first)

    def idle(self) -> None:
        if self.d.room_short():
            self.d.evict()


class VLLMDriver:
    def __init__(self, capacity: int, policy: str) -> None:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        self.m: Any = CPUOffloadingManager(capacity, cache_policy=policy)
        self._hit = LookupResult.HIT
        self._ctx = ReqContext
        self._n = 0

    def start(self, keys: Keys) -> tuple[int, Any]:
        m, hit = self.m, self._hit
        self._n += 1
        ctx = self._ctx(req_id=str(self._n))
        m.on_new_request(ctx)
        n = 0
        for key in keys:
            if m.lookup(key, ctx) is not hit:
                break
            n += 1
        load = keys[:n]
        if n:
            m.prepare_load(load, ctx)
        out = m.prepare_store(keys[n:], ctx)
        return n, (ctx, load, out.keys_to_store if out is not None else [])

    def finish(self, job: Any) -> None:
        ctx, load, stored = job
        if load:
            self.m.complete_load(load, ctx)
        if stored:
            self.m.complete_store(stored, ctx)
        self.m.on_request_finished(ctx)

    def idle(self) -> None:
        pass


def replay(driver: Any, trace: Sequence[Keys], window: int) -> tuple[float, float]:
    """(hit rate, CPU seconds) of ``trace`` through ``driver``."""
    inflight: deque[Any] = deque()
    hits = looked = 0
    gc.collect()
    t0 = time.process_time()
    for keys in trace:
        n, job = driver.start(keys)
        hits += n
        looked += len(keys)
        inflight.append(job)
        if len(inflight) > window:
            driver.finish(inflight.popleft())
        driver.idle()
    while inflight:
        driver.finish(inflight.popleft())
    return hits / looked, time.process_time() - t0


# -- memory ------------------------------------------------------------------------------


def key(i: int) -> bytes:
    """A 36-byte offload key: a 32-byte block hash and group 0."""
    return hashlib.sha256(i.to_bytes(8, "big", signed=True)).digest() + b"\0\0\0\0"


def bytes_per_block(
    make: Callable[[int], Any], store: Callable[[Any, list[bytes]], None], n: int, batch: int = 32
) -> tuple[float, float, float]:
    """tracemalloc bytes per block held by a structure of ``n`` blocks in its steady state:
    ``2n`` blocks stored first (so that ghost lists, which fill with the evictions, are
    full), then the mean, min and max of 8 samples while ``n/2`` more are stored (dicts
    resize and vLLM's LRU heap compacts in cycles). ``batch`` keys (about one request's)
    per store."""
    small = make(batch)  # warm up: lazy imports and caches are not the structure's
    for i in range(4):
        store(small, [key(-1 - i * batch - j) for j in range(batch)])
    del small
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    obj = make(n)
    samples = []
    every = n // 16 // batch * batch
    for first in range(0, 5 * n // 2, batch):
        store(obj, [key(first + i) for i in range(batch)])
        if first >= 2 * n and (first - 2 * n) % every == every - batch:
            gc.collect()
            samples.append((tracemalloc.get_traced_memory()[0] - base) / n)
    tracemalloc.stop()
    del obj
    return sum(samples) / len(samples), min(samples), max(samples)


def kvferry_store(d: Directory, keys: list[bytes]) -> None:
    slots = d.prepare_store(keys)
    d.complete_store(slots[slots >= 0], True)
    if d.room_short():
        d.evict()


def vllm_store(m: Any, keys: list[bytes]) -> None:
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(req_id="mem")
    out = m.prepare_store(keys, ctx)
    m.complete_store(out.keys_to_store, ctx)
    m.on_request_finished(ctx)


def vllm_manager(n: int, policy: str) -> Any:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return CPUOffloadingManager(n, cache_policy=policy)


# -- the index alone ---------------------------------------------------------------------


def index_figures(n: int, batches: list[list[bytes]]) -> dict[str, float]:
    """µs to resolve one request's keys, and bytes per key: a dict against the directory's
    compact :class:`~kvferry.cache._index.KeyIndex`."""
    out: dict[str, float] = {}
    for name in ("dict", "compact"):
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        idx: Any = {} if name == "dict" else KeyIndex(n)
        for i in range(0, n, 1024):
            keys = [key(j) for j in range(i, min(n, i + 1024))]
            if name == "dict":
                idx.update(zip(keys, range(i, i + len(keys)), strict=True))
            else:
                idx.insert(keys, np.arange(i, i + len(keys)))
        gc.collect()
        out[f"{name}_bytes_per_key"] = (tracemalloc.get_traced_memory()[0] - base) / n
        tracemalloc.stop()
        best = float("inf")
        for _ in range(3):
            t0 = time.process_time()
            for keys in batches:
                if name == "dict":
                    get = idx.get
                    [get(k, -1) for k in keys]
                else:
                    idx.find(keys)
            best = min(best, time.process_time() - t0)
        out[f"{name}_us_per_request"] = best / len(batches) * 1e6
        del idx
    return out


# -- scaling with capacity --------------------------------------------------------------

CAPACITIES = {"10k": 10_000, "100k": 100_000, "1m": 1_000_000, "4m": 4_000_000}
WATERMARKS = {"inline": (1.0, 1.0), "default": DEFAULT_WATERMARKS}


def random_keys(rng: np.random.Generator, n: int) -> list[bytes]:
    """``n`` distinct-with-certainty-in-practice 36-byte keys, fast (no hashing)."""
    buf = rng.bytes(36 * n)
    return [buf[i : i + 36] for i in range(0, 36 * n, 36)]


def time_evictions(d: Directory, n: int, times: int) -> float:
    """CPU µs per key of ``times`` evictions of ``n`` blocks in a row, as the directory makes
    them (inline, or the evictor's batch), timed as one loop: ``time.process_time`` costs
    80 µs or more a call here, too much to time each one."""
    gc.collect()
    before = d.evictions
    t0 = time.process_time()
    for _ in range(times):
        d._evict(n, None)
    seconds = time.process_time() - t0
    return seconds / max(d.evictions - before, 1) * 1e6


def scaling_run(
    capacity: int,
    policy: str,
    watermarks: tuple[float, float],
    *,
    seed: int,
    requests: int,
    reused: int = 32,
    new: int = 64,
    window: int = 8,
    segments: int = 3,
    index: str | None = None,
) -> dict[str, Any]:
    """A full directory of ``capacity`` slots, then ``requests`` requests in steady state.

    Filled with ``capacity`` keys as requests of ``reused + new`` keys. Each later request
    is ``reused`` keys of an earlier request (up to half the capacity back, uniformly: the
    requests' reads span the whole tier) and ``new`` keys, which evict as many; with
    ``window`` requests in flight, driven like the trace replay. Same work at every
    capacity. Returns ns per block-op of each of ``segments`` parts of the steady phase,
    and the CPU time per evicted key inside the directory's eviction.
    """
    rng = np.random.default_rng(seed)
    per = reused + new
    d = Directory(capacity, policy=policy, watermarks=watermarks, index=index)
    history: list[list[bytes]] = []
    fill = random_keys(rng, capacity)
    for i in range(0, capacity, 1024):
        batch = fill[i : i + 1024]
        slots = d.prepare_store(batch)
        d.complete_store(slots[slots >= 0], True)
        if d.room_short():
            d.evict()
    history = [fill[i : i + per] for i in range(0, capacity - per + 1, per)]
    del fill
    back = max(1, capacity // 2 // per)
    driver = KVFerryDriver.__new__(KVFerryDriver)
    driver.d = d
    picks = rng.integers(1, back + 1, size=requests).tolist()
    trace: list[Keys] = []
    for gap in picks:
        old = history[max(0, len(history) - gap)] if history else []
        keys = old[:reused] + random_keys(rng, new)
        history.append(keys)
        trace.append(tuple(keys))
        if len(history) > 2 * back + 2:  # only the last ``back`` are ever picked
            del history[: len(history) - back - 1]
    evictions = d.evictions
    ns: list[float] = []
    hits = looked = 0
    part = len(trace) // segments
    for k in range(segments):
        seg = trace[k * part : (k + 1) * part]
        h, t = replay(driver, seg, window)
        ns.append(t / sum(map(len, seg)) * 1e9)
        hits += round(h * sum(map(len, seg)))
        looked += sum(map(len, seg))
    evicted = d.evictions - evictions
    # Then evictions alone, from the full tier this left: what a store makes at (1, 1), or
    # the evictor's batch (high - low of the capacity), over a quarter of the capacity.
    low, high = watermarks
    n = 64 if high - low < 0.005 else max(64, int((high - low) * capacity))
    us = time_evictions(d, n, max(1, min(capacity // 4, 100 * n) // n))
    return {
        "ns_per_op": ns,
        "evict_us_per_key": us,
        "evicted": evicted,
        "evict_batch": n,
        "hit_rate": hits / looked,
        "index": d.index,
    }


def scaling_table(
    seed: int,
    requests: int,
    capacities: dict[str, int],
    policies: Sequence[str],
    index: str | None = None,
) -> dict[str, float]:
    """Per-op time and eviction cost from 10k to 4M slots; prints the table. ``index``:
    the directory's key index (None: its default at each capacity)."""
    print(
        f"\nscaling (seed {seed}, {index or 'the default'} index): full directory, then "
        f"{requests} requests of 32 reused + 64 new keys (the new ones evict as many)"
    )
    print(
        f"  {'capacity':>8} {'index':7} {'policy':7} {'watermarks':10} {'ns/op min':>9} "
        f"{'max':>6} {'evict us/key':>12} {'batch':>6} {'evicted':>8} {'hit rate':>8}"
    )
    per_op: dict[tuple[str, str, str], float] = {}
    evict: dict[str, float] = {}
    for cname, cap in capacities.items():
        for policy in policies:
            for wname, wm in WATERMARKS.items():
                gc.collect()
                r = scaling_run(cap, policy, wm, seed=seed, requests=requests, index=index)
                per_op[cname, policy, wname] = min(r["ns_per_op"])
                evict[cname] = max(evict.get(cname, 0.0), r["evict_us_per_key"])
                print(
                    f"  {cname:>8} {r['index']:7} {policy:7} {wname:10} {min(r['ns_per_op']):9.0f} "
                    f"{max(r['ns_per_op']):6.0f} {r['evict_us_per_key']:12.3f} "
                    f"{r['evict_batch']:6d} {r['evicted']:8d} {r['hit_rate']:8.3f}",
                    flush=True,
                )
    out: dict[str, float] = {f"evict_us_per_key_{c}": round(v, 3) for c, v in evict.items()}
    names = list(capacities)
    if len(names) > 1:
        lo, hi = names[0], names[-1]
        ratios = {(p, w): per_op[hi, p, w] / per_op[lo, p, w] for p in policies for w in WATERMARKS}
        worst = max(ratios, key=lambda pw: ratios[pw])
        print(
            "  per-op time, "
            + hi
            + " vs "
            + lo
            + ": "
            + ", ".join(f"{p} {w} {r:.2f}" for (p, w), r in ratios.items())
        )
        out[f"scaling_{hi}_vs_{lo}"] = round(ratios[worst], 3)
    return out


# -- main --------------------------------------------------------------------------------


def speed_table(
    trace: list[Keys], capacity: int, repeats: int, window: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Hit rate and best CPU seconds of each system on ``trace``; prints the table."""
    systems: dict[str, Callable[[], Any]] = {
        "kvferry lru": lambda: KVFerryDriver(capacity, "lru"),
        "vllm lru": lambda: VLLMDriver(capacity, "lru"),
        "kvferry arc": lambda: KVFerryDriver(capacity, "arc"),
        "vllm arc": lambda: VLLMDriver(capacity, "arc"),
        "kvferry s3fifo": lambda: KVFerryDriver(capacity, "s3fifo"),
        "kvferry lru, evict inline (1,1)": lambda: KVFerryDriver(
            capacity, "lru", watermarks=(1.0, 1.0)
        ),
        "kvferry lru, dict index": lambda: KVFerryDriver(capacity, "lru", index="dict"),
        "kvferry arc, dict index": lambda: KVFerryDriver(capacity, "arc", index="dict"),
        "kvferry lru, compact index": lambda: KVFerryDriver(capacity, "lru", index="compact"),
        "kvferry arc, compact index": lambda: KVFerryDriver(capacity, "arc", index="compact"),
        "kvferry lru, Python loops": lambda: KVFerryDriver(capacity, "lru", compiled=False),
        "kvferry arc, Python loops": lambda: KVFerryDriver(capacity, "arc", compiled=False),
    }
    hit: dict[str, float] = {}
    cpu: dict[str, float] = {name: float("inf") for name in systems}
    for _ in range(repeats):  # interleaved, so that a noisy moment hits all alike
        for name, make in systems.items():
            h, t = replay(make(), trace, window)
            hit[name] = h
            cpu[name] = min(cpu[name], t)
    ops = sum(map(len, trace))
    print(f"\n{'system':34} {'hit rate':>9} {'ns/op':>9} {'vs vLLM':>8}")
    for name in systems:
        ref = "vllm lru" if "lru" in name else "vllm arc"
        ratio = cpu[name] / cpu[ref]
        print(f"{name:34} {hit[name]:9.4f} {cpu[name] / ops * 1e9:9.0f} {ratio:8.2f}")
    return hit, cpu


def memory_table(n: int) -> dict[str, float]:
    """Mean bytes per block of each system at ``n`` blocks; prints the table."""
    makers: dict[str, tuple[Callable[[int], Any], Callable[[Any, list[bytes]], None]]] = {
        "kvferry lru": (lambda c: Directory(c, policy="lru"), kvferry_store),
        "vllm lru": (lambda c: vllm_manager(c, "lru"), vllm_store),
        "kvferry arc": (lambda c: Directory(c, policy="arc"), kvferry_store),
        "vllm arc": (lambda c: vllm_manager(c, "arc"), vllm_store),
        "kvferry s3fifo": (lambda c: Directory(c, policy="s3fifo"), kvferry_store),
        "kvferry lru, dict index": (lambda c: Directory(c, index="dict"), kvferry_store),
        "kvferry lru, compact index": (lambda c: Directory(c, index="compact"), kvferry_store),
        "kvferry lru, evict inline (1,1)": (
            lambda c: Directory(c, watermarks=(1.0, 1.0)),
            kvferry_store,
        ),
    }
    mem: dict[str, float] = {}
    print(
        f"\nbytes per block, {n} blocks held, steady state (2n stored, then n/2 more; "
        f"the directory's default index there: {Directory(n).index}):"
    )
    print(f"  {'system':16} {'mean':>6} {'min':>6} {'max':>6}")
    for name, (make, store) in makers.items():
        mean, low, high = bytes_per_block(make, store, n)
        mem[name] = mean
        print(f"  {name:16} {mean:6.0f} {low:6.0f} {high:6.0f}", flush=True)
    return mem


def spread(values: Sequence[float]) -> str:
    v = sorted(values)
    return f"median {v[len(v) // 2]:.3f}, min {v[0]:.3f}, max {v[-1]:.3f} over {len(v)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small traces, 100k blocks for memory")
    ap.add_argument("--seed", type=int, default=None, help="first seed (default: a fresh one)")
    ap.add_argument("--runs", type=int, default=1, help="replays, each on a trace of its own seed")
    ap.add_argument("--repeats", type=int, default=3, help="timed replays per system and run")
    ap.add_argument("--window", type=int, default=8, help="requests in flight")
    ap.add_argument("--skip-memory", action="store_true", help="no memory figures (minutes)")
    ap.add_argument("--skip-replay", action="store_true", help="no trace replay against vLLM")
    ap.add_argument("--skip-scaling", action="store_true", help="no 10k..4M capacity table")
    ap.add_argument("--scaling-requests", type=int, default=1500)
    ap.add_argument(
        "--index",
        choices=("dict", "compact"),
        default=None,
        help="for scaling (default: the directory's own choice at each capacity)",
    )
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(3), "big")
    compiled = Directory(1)._k is not None
    print(
        f"seed {seed}; the directory's per-request loops: "
        + ("compiled (numba)" if compiled else f"in Python (numba missing, or {_kernels.ENV}=0)")
    )
    requests, docs = (3_000, 800) if args.quick else (20_000, 5_000)
    ratios: dict[str, list[float]] = {}
    rates: dict[str, list[float]] = {}
    capacity_used = 0  # the replays' last capacity
    for run in range(0 if args.skip_replay else args.runs):
        trace, distinct = make_trace(seed=seed + run, requests=requests, docs=docs)
        capacity = capacity_used = int(0.3 * distinct)
        print(
            f"\nrun {run + 1}, trace seed {seed + run}: {len(trace)} requests, "
            f"{sum(map(len, trace))} block-ops, {distinct} distinct blocks, "
            f"capacity {capacity} blocks (the directory's default index there: "
            f"{Directory(capacity).index})"
        )
        hit, cpu = speed_table(trace, capacity, args.repeats, args.window)
        for p in ("lru", "arc"):
            ratios.setdefault(p, []).append(cpu[f"kvferry {p}"] / cpu[f"vllm {p}"])
            for variant, name in (
                ("dict", "dict index"),
                ("compact", "compact index"),
                ("python", "Python loops"),
            ):
                ratios.setdefault(f"{p}_{variant}", []).append(
                    cpu[f"kvferry {p}, {name}"] / cpu[f"vllm {p}"]
                )
        for name, h in hit.items():
            rates.setdefault(name, []).append(h)
    if args.runs > 1 and ratios:
        print(
            f"\nns per op vs vLLM over {args.runs} traces (seeds {seed}..{seed + args.runs - 1}):"
        )
        for p, r in ratios.items():
            print(f"  {p}: {spread(r)}")
    n = 100_000 if args.quick else 1_000_000
    mem_ratio: dict[str, float | None] = {
        "lru": None,
        "arc": None,
        "lru_dict": None,
        "lru_compact": None,
        "lru_inline": None,
    }
    if not args.skip_memory:
        mem = memory_table(n)
        mem_ratio = {p: round(mem[f"kvferry {p}"] / mem[f"vllm {p}"], 3) for p in ("lru", "arc")}
        for variant in ("dict", "compact"):
            mem_ratio[f"lru_{variant}"] = round(
                mem[f"kvferry lru, {variant} index"] / mem["vllm lru"], 3
            )
        mem_ratio["lru_inline"] = round(mem["kvferry lru, evict inline (1,1)"] / mem["vllm lru"], 3)
        idx = index_figures(n, [list(keys) for keys in make_trace(seed=seed)[0][:2000]])
        print(
            f"\nkey index, {n} keys: dict {idx['dict_bytes_per_key']:.0f} B/key, "
            f"{idx['dict_us_per_request']:.1f} us/request; compact numpy table "
            f"{idx['compact_bytes_per_key']:.0f} B/key, "
            f"{idx['compact_us_per_request']:.1f} us/request"
        )
    scaling: dict[str, Any] = {}
    if not args.skip_scaling:
        caps = CAPACITIES if not args.quick else {"10k": 10_000, "100k": 100_000}
        tables: dict[str, list[float]] = {}
        for run in range(args.runs):  # one table a seed, as the replays
            for key, value in scaling_table(
                seed + run,
                300 if args.quick else args.scaling_requests,
                caps,
                ("lru", "arc", "s3fifo"),
                args.index,
            ).items():
                tables.setdefault(key, []).append(value)
        if args.runs > 1:
            print(f"\nscaling over {args.runs} seeds ({seed}..{seed + args.runs - 1}):")
            for key, values in tables.items():
                print(f"  {key}: {spread(values)}")
        for key, values in tables.items():
            scaling[key] = sorted(values)[len(values) // 2]
            scaling[f"{key}_spread"] = [min(values), max(values)]

    def median(values: list[float] | None) -> float | None:
        return round(sorted(values)[len(values) // 2], 4) if values else None

    def span(values: list[float] | None) -> list[float] | None:
        return [round(min(values), 4), round(max(values), 4)] if values else None

    print(
        json.dumps(
            {
                "seed": seed,
                "runs": len(ratios.get("lru", [])),
                "compiled_loops": compiled,
                "ns_per_op_vs_vllm_lru": median(ratios.get("lru")),
                "ns_per_op_vs_vllm_lru_spread": span(ratios.get("lru")),
                "ns_per_op_vs_vllm_arc": median(ratios.get("arc")),
                "ns_per_op_vs_vllm_arc_spread": span(ratios.get("arc")),
                "bytes_per_block_vs_vllm": mem_ratio["lru"],
                "bytes_per_block_vs_vllm_arc": mem_ratio["arc"],
                "index": Directory(capacity_used).index if capacity_used else None,
                "index_memory": Directory(n).index,
                "ns_per_op_vs_vllm_lru_dict": median(ratios.get("lru_dict")),
                "ns_per_op_vs_vllm_arc_dict": median(ratios.get("arc_dict")),
                "bytes_per_block_vs_vllm_dict": mem_ratio["lru_dict"],
                "ns_per_op_vs_vllm_lru_compact": median(ratios.get("lru_compact")),
                "ns_per_op_vs_vllm_lru_compact_spread": span(ratios.get("lru_compact")),
                "ns_per_op_vs_vllm_arc_compact": median(ratios.get("arc_compact")),
                "ns_per_op_vs_vllm_arc_compact_spread": span(ratios.get("arc_compact")),
                "bytes_per_block_vs_vllm_compact": mem_ratio["lru_compact"],
                "bytes_per_block_vs_vllm_inline": mem_ratio["lru_inline"],
                "ns_per_op_vs_vllm_lru_python": median(ratios.get("lru_python")),
                "ns_per_op_vs_vllm_arc_python": median(ratios.get("arc_python")),
                "hit_rate_lru": median(rates.get("kvferry lru")),
                "hit_rate_arc": median(rates.get("kvferry arc")),
                "hit_rate_s3fifo": median(rates.get("kvferry s3fifo")),
                "hit_rate_vllm_lru": median(rates.get("vllm lru")),
                "hit_rate_vllm_arc": median(rates.get("vllm arc")),
                **scaling,
            }
        )
    )


if __name__ == "__main__":
    main()
