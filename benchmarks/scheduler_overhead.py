"""Scheduler-side overhead per engine step: kvferry against vLLM's OffloadingConnector.

A real ``vllm.v1.core.sched.scheduler.Scheduler`` (vLLM 0.32, no engine, no model
forward) is driven step by step on one seeded workload, three times:

  0. no connector (the baseline);
  1. kvferry's scheduler half (``KVFerryConnector`` loaded by module path);
  2. vLLM's own ``OffloadingConnector`` scheduler half (CPU backend, LRU), whose
     scheduler side needs no GPU — only its worker refuses the CPU platform.

Each step is ``schedule()`` then ``update_from_output()`` with a simulated model-runner
output: one sampled token per request whose prefill is complete (none for a partial
prefill chunk, as the model runner discards it), and the ``KVConnectorOutput`` each
connector's real worker would report if every copy took no time:

- kvferry (connector/_worker.py): loads and stores are submitted in the step that
  carries them (``start_load_kv`` / ``wait_for_save``) and are polled done in the same
  step's ``get_finished``: ``finished_recving`` = the loads' request ids,
  ``finished_sending`` = ``release_req_ids`` (their stores are all done), worker
  metadata ``KVFerryWorkerMetadata(acks={job: [1, 0]}, stats={bytes, seconds})``.
- OffloadingConnector (offloading/worker.py): loads are submitted in ``start_load_kv``
  and done in the same step (``finished_recving`` = their request ids); stores are
  *deferred* by ``wait_for_save`` to the next step's ``handle_preemptions`` (or submitted
  at once if named in ``jobs_to_flush``), so a store is reported one step after it was
  planned. Worker metadata ``OffloadingWorkerMetadata(completed_jobs={job: 1},
  transfer_stats=...)``; stores never emit ``finished_sending``.

Timed per step: ``add_request`` of the step's arrivals (it calls the connector's
``on_new_request``) + ``schedule()`` + ``update_from_output()``, with ``perf_counter_ns``
(wall) and ``process_time_ns`` (CPU); building the simulated output is not timed. The
three runs go in lockstep (step i of each, in an order that rotates, before step i+1 of
any), so that what the rest of the machine does weighs on all three alike; as in a real
engine, where the model runs between two scheduler steps, each step starts with caches
the others have cooled. That is repeated ``--repeats`` times, after an untimed warm-up.
The workload is deterministic (a fixed seed, and ``PYTHONHASHSEED=0``: the script
re-executes itself to set it), so step i does the same work in every repeat; the figure
kept for step i is its least time over the repeats (what a repeat adds on top — other
processes, interrupts — is noise), then the mean and the median over steps. Objects
alive before a run are frozen out of the garbage collector (``gc.freeze``); the runs'
own garbage is collected as usual. Added time per step = connector run − no-connector
run; the headline figure is kvferry's added time ÷ vLLM's, on the mean
(``sched_overhead_vs_vllm``; target ≤ 1.0, goal 0.5). The same ratio on the median and
on CPU time is printed too.

Then ``--instrument-repeats`` more lockstep runs of the two connectors time every
connector call vLLM makes (a wrapper on the instance, which adds its own small cost to
each call): where each connector spends its time, how often vLLM calls it, and the
``..._inside`` figures.

The workload: documents (Zipf-popular) under a shared system prompt, each request a
document + its own question; some requests re-ask an earlier prompt word for word. The
engine's cache is small, so documents leave it and come back from the host tier. Both
connectors get the same offloaded block size and the same host capacity in blocks.

Both connectors store the same kind of blocks: prompt blocks only (vLLM's default,
kvferry's ``store_decoded: false``), the headline figures; then decoded blocks too
(``store_decoded: true``, vLLM's ``offload_prompt_only=False``), whose figures are under
``"decoded"`` in the JSON. ``--mode`` runs one of the two.

Hit tokens: both connectors see the same requests and the same engine steps, so a
difference in ``hit_tokens`` is a difference in what their host tiers held when asked.
What made kvferry hit fewer (75,328 against vLLM's 80,336 on the default workload, prompt
blocks only, before it was fixed): its evictor kept 1-3% of the tier free (watermarks
0.97/0.99; with (1, 1): 78,000), and its LRU order was the order blocks were offered for
store, so a document's head was older than its tail, where vLLM's manager re-stamps a
finished request's blocks head last (``on_request_finished``), so tails leave first and
the prefixes later requests share stay. With inline eviction by default, recency from a
request's end and no recency from repeated lookups: 81,280 against 80,336.

The last line printed is one JSON object with the figures. ``--quick`` runs a small one.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SAMPLED_TOKEN = 7
"""The token every simulated decode step samples (never the model's EOS, 2)."""


# -- workload ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    step: int
    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int


def make_workload(
    *,
    seed: int,
    requests: int,
    docs: int,
    per_step: int,
    reask_share: float = 0.15,
    zipf: float = 0.9,
) -> list[Arrival]:
    """Seeded requests: system prompt + document + question, arriving ``per_step`` a step.

    The system prompt is 64 tokens, a document 320..960, a question 1..80 (so prompts end
    mid-block), an answer 2..24 tokens. ``reask_share`` of the requests repeat an earlier
    prompt word for word (a retry); the others pick a document, Zipf-popular.
    """
    rng = np.random.default_rng(seed)
    vocab_lo, vocab_hi = 3, 2048  # ids 0..2 are special in the tiny Llama
    system = rng.integers(vocab_lo, vocab_hi, size=64).tolist()
    doc_tokens = [
        rng.integers(vocab_lo, vocab_hi, size=int(rng.integers(320, 961))).tolist()
        for _ in range(docs)
    ]
    popularity = 1.0 / np.arange(1, docs + 1) ** zipf
    popularity /= popularity.sum()
    out: list[Arrival] = []
    for i in range(requests):
        step = i // per_step
        if out and rng.random() < reask_share:
            prompt = out[int(rng.integers(0, len(out)))].prompt
        else:
            d = int(rng.choice(docs, p=popularity))
            question = rng.integers(vocab_lo, vocab_hi, size=int(rng.integers(1, 81))).tolist()
            prompt = tuple(system + doc_tokens[d] + question)
        out.append(
            Arrival(step=step, req_id=f"r{i}", prompt=prompt, max_tokens=int(rng.integers(2, 25)))
        )
    return out


# -- vLLM objects --------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    model_dir: Path
    block: int
    offload_block: int
    num_gpu_blocks: int
    host_blocks: int
    max_num_seqs: int
    max_batched_tokens: int
    max_model_len: int
    store_decoded: bool = False
    """Both connectors store decoded blocks too (kvferry ``store_decoded: true``, vLLM
    ``offload_prompt_only=False``); else prompt blocks only, vLLM's default."""
    watermarks: tuple[float, float] | None = None
    """kvferry's ``eviction_watermarks`` (None: its default)."""


def kv_cache_config(s: Setup) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    cfg = json.loads((s.model_dir / "config.json").read_text())
    spec = FullAttentionSpec(
        block_size=s.block,
        num_kv_heads=cfg["num_key_value_heads"],
        head_size=cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]),
        dtype=torch.bfloat16,
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(cfg["num_hidden_layers"])]
    return KVCacheConfig(
        num_blocks=s.num_gpu_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )


def host_bytes(s: Setup, kcc: Any) -> int:
    """Bytes for ``host_blocks`` offloaded blocks, the same count for both connectors.

    kvferry: slots = bytes // (row_bytes * blocks_per_chunk); vLLM's CPU spec:
    chunks = bytes // round_up(bytes_per_block * blocks_per_chunk, page size).
    """
    import mmap

    row: int = sum(
        len(g.layer_names) * g.kv_cache_spec.page_size_bytes for g in kcc.kv_cache_groups
    )
    chunk = row * (s.offload_block // s.block)
    page = mmap.PAGESIZE
    aligned = (chunk + page - 1) // page * page
    if aligned != chunk:
        raise SystemExit(
            f"an offloaded block of {chunk} bytes is not page-aligned: pick other sizes"
        )
    return s.host_blocks * chunk


def make_scheduler(s: Setup, kind: str) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    kcc = kv_cache_config(s)
    model_config = ModelConfig(
        model=str(s.model_dir),
        skip_tokenizer_init=True,
        max_model_len=s.max_model_len,
        dtype="bfloat16",
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_batched_tokens,
        max_model_len=s.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=False,
    )
    cache_config = CacheConfig(block_size=s.block, enable_prefix_caching=True)
    kv_transfer_config = None
    if kind == "kvferry":
        kv_transfer_config = KVTransferConfig(
            kv_connector="KVFerryConnector",
            kv_connector_module_path="kvferry.connector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "cpu_bytes_to_use": host_bytes(s, kcc),
                "block_size": s.offload_block,
                "store_decoded": s.store_decoded,
                **({"eviction_watermarks": s.watermarks} if s.watermarks else {}),
            },
        )
    elif kind == "vllm":
        kv_transfer_config = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "cpu_bytes_to_use": host_bytes(s, kcc),
                "block_size": s.offload_block,
                **({"offload_prompt_only": False} if s.store_decoded else {}),
            },
        )
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=kv_transfer_config,
    )
    # What the engine core does before it builds its scheduler.
    vllm_config.cache_config.num_gpu_blocks = s.num_gpu_blocks
    if vllm_config.cache_config.kv_cache_layout is None:
        vllm_config.cache_config.kv_cache_layout = "LBHNC"
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kcc,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=s.block,
        log_stats=False,
    )


def host_capacity(scheduler: Any, kind: str) -> int | None:
    conn = scheduler.connector
    if kind == "kvferry":
        return int(conn._scheduler.geometry.num_slots)
    if kind == "vllm":
        return int(conn.connector_scheduler.manager._num_chunks)
    return None


# -- simulated workers -------------------------------------------------------------------


@dataclass
class Moved:
    """What the connector's metadata asked the workers to move, over a run."""

    load_jobs: int = 0
    store_jobs: int = 0
    load_blocks: int = 0
    store_blocks: int = 0
    flushes: int = 0
    """Store jobs named to be waited for before their blocks are reused."""
    releases: int = 0


class KVFerryWorkerSim:
    """kvferry's WorkerSide with copies that end as soon as they are submitted."""

    def __init__(self, row_bytes: int, moved: Moved) -> None:
        from vllm.v1.outputs import KVConnectorOutput

        from kvferry.connector import KVFerryMetadata, KVFerryWorkerMetadata

        self._meta_t = KVFerryMetadata
        self._wmeta = KVFerryWorkerMetadata
        self._out = KVConnectorOutput
        self.row_bytes = row_bytes
        self.moved = moved

    def step(self, meta: Any) -> Any:
        assert isinstance(meta, self._meta_t), type(meta)
        m = self.moved
        acks: dict[int, list[int]] = {}
        stats: dict[str, float] = {}
        recving: set[str] = set()
        # handle_preemptions: flush_job_ids name stores already done (they end at once).
        m.flushes += len(meta.flush_job_ids)
        # start_load_kv, then wait_for_save, then get_finished: every job is done.
        for spec in meta.loads:
            blocks = sum(len(p.device_blocks) for p in spec.copy.parts)
            m.load_jobs += 1
            m.load_blocks += blocks
            acks[spec.copy.job_id] = [1, 0]
            recving.add(spec.req_id)
            stats["load_bytes"] = stats.get("load_bytes", 0.0) + blocks * self.row_bytes
            stats["load_seconds"] = stats.get("load_seconds", 0.0) + blocks * self.row_bytes / 1e10
        for spec in meta.stores:
            blocks = sum(len(p.device_blocks) for p in spec.copy.parts)
            m.store_jobs += 1
            m.store_blocks += blocks
            acks[spec.copy.job_id] = [1, 0]
            stats["store_bytes"] = stats.get("store_bytes", 0.0) + blocks * self.row_bytes
            stats["store_seconds"] = (
                stats.get("store_seconds", 0.0) + blocks * self.row_bytes / 1e10
            )
        # A released request's stores are all done: it is finished_sending at once.
        sending = set(meta.release_req_ids)
        m.releases += len(sending)
        return self._out(
            finished_sending=sending or None,
            finished_recving=recving or None,
            kv_connector_worker_meta=self._wmeta(acks=acks, stats=stats) if acks or stats else None,
        )

    def idle(self) -> bool:
        return True


def _num_blocks(spec: Any) -> int:
    """GPU blocks of a ``GPULoadStoreSpec`` (one id per engine block, all groups)."""
    return len(spec.block_ids)


class VLLMWorkerSim:
    """OffloadingConnectorWorker with copies that end as soon as they are submitted."""

    def __init__(self, row_bytes: int, moved: Moved) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingConnectorMetadata,
            OffloadingWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput

        self._meta_t = OffloadingConnectorMetadata
        self._wmeta = OffloadingWorkerMetadata
        self._out = KVConnectorOutput
        self.row_bytes = row_bytes
        self.moved = moved
        self._unsubmitted: list[tuple[int, int]] = []  # (job id, GPU blocks), deferred stores

    def step(self, meta: Any) -> Any:
        assert isinstance(meta, self._meta_t), type(meta)
        m = self.moved
        store_jobs = dict(meta.store_jobs)  # the real worker pops from its unpickled copy
        submitted: list[tuple[int, int, str | None]] = []  # (job, blocks, load req id)
        # handle_preemptions: jobs_to_flush leave this step's store_jobs and are submitted
        # with the stores deferred from the previous step, then waited for.
        for job_id in meta.jobs_to_flush or ():
            m.flushes += 1
            entry = store_jobs.pop(job_id, None)
            if entry is not None:
                self._unsubmitted.append((job_id, _num_blocks(entry.src_spec)))
        submitted.extend((j, n, None) for j, n in self._unsubmitted)
        self._unsubmitted = []
        # start_load_kv (start_kv_transfers): this step's loads.
        for job_id, entry in meta.load_jobs.items():
            blocks = _num_blocks(entry.dst_spec)
            m.load_jobs += 1
            m.load_blocks += blocks
            submitted.append((job_id, blocks, entry.req_id))
        # wait_for_save (prepare_store_kv): the rest is deferred to the next step.
        for job_id, entry in store_jobs.items():
            self._unsubmitted.append((job_id, _num_blocks(entry.src_spec)))
        for entry in meta.store_jobs.values():
            m.store_jobs += 1
            m.store_blocks += _num_blocks(entry.src_spec)
        # get_finished: everything submitted is done.
        wmeta = self._wmeta()
        recving: set[str] = set()
        for job_id, blocks, load_req in submitted:
            nbytes = blocks * self.row_bytes
            side = wmeta.transfer_stats.load if load_req is not None else wmeta.transfer_stats.store
            side.record(nbytes, nbytes / 1e10)
            wmeta.mark_completed(job_id)
            if load_req is not None:
                recving.add(load_req)
        return self._out(
            finished_sending=set(),
            finished_recving=recving,
            kv_connector_worker_meta=wmeta if wmeta.completed_jobs else None,
        )

    def idle(self) -> bool:
        return not self._unsubmitted


class NoWorkerSim:
    def __init__(self, row_bytes: int, moved: Moved) -> None:
        self.moved = moved

    def step(self, meta: Any) -> Any:
        return None

    def idle(self) -> bool:
        return True


# -- one run -----------------------------------------------------------------------------

CONNECTOR_CALLS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "get_external_cache_hit_sources",
    "get_loaded_kv_cache_group_ids",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "get_kv_connector_stats",
    "take_events",
    "has_pending_push_work",
    "has_pending_block_frees",
)
"""The connector methods vLLM's Scheduler calls; ``--instrument-repeats`` runs time each."""


class CallMeter:
    """Wraps a connector's methods (on the instance) to time and count the calls made
    inside the timed part of a step; a call made from inside another is not counted."""

    def __init__(self, connector: Any) -> None:
        self.ns: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.step_ns: list[int] = []
        """Time inside the connector, per step."""
        self._this_step = 0
        self.active = False
        self._depth = 0
        for name in CONNECTOR_CALLS:
            fn = getattr(connector, name, None)
            if callable(fn):
                setattr(connector, name, self._wrap(name, fn))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        perf = time.perf_counter_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active or self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            t0 = perf()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = perf() - t0
                self._depth -= 1
                self.ns[name] = self.ns.get(name, 0) + dt
                self.calls[name] = self.calls.get(name, 0) + 1
                self._this_step += dt

        return timed

    def end_step(self) -> None:
        self.step_ns.append(self._this_step)
        self._this_step = 0


@dataclass
class RunResult:
    kind: str
    steps: int
    step_ns: list[int]
    """Wall time (perf_counter_ns) of each step's timed part."""
    step_cpu_ns: list[int]
    """CPU time of this process (process_time_ns) over the same part: steadier on a busy box."""
    moved: Moved
    computed_tokens: int
    """Tokens the simulated model computed (prefill and decode): fewer = more reuse."""
    preemptions: int
    host_blocks: int | None
    finished: int
    notes: list[str] = field(default_factory=list)
    stats: Any = None
    """kvferry's SchedulerStatistics at the end of the run."""
    meter: CallMeter | None = None

    @property
    def signature(self) -> tuple[int, ...]:
        """What the run did; equal for repeats of one deterministic workload."""
        m = self.moved
        return (
            self.steps,
            self.computed_tokens,
            m.load_jobs,
            m.store_jobs,
            m.load_blocks,
            m.store_blocks,
        )


def best_steps(series: list[list[int]], same_work: bool) -> list[int]:
    """Per step, the least time over the repeats (the step did the same work in each; what
    a repeat adds on top is noise: other processes, interrupts). Repeats that did not do
    the same work: the repeat with the least mean."""
    if same_work:
        return [min(col) for col in zip(*series, strict=True)]
    return min(series, key=statistics.fmean)


class Driver:
    """One scheduler (with or without a connector), its simulated worker, and the workload,
    advanced one engine step at a time."""

    def __init__(
        self, s: Setup, kind: str, workload: list[Arrival], max_steps: int, *, instrument: bool
    ) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        self.kind = kind
        self.s = s
        self.workload = workload
        self.max_steps = max_steps
        self.hasher = get_request_block_hasher(s.block, sha256)
        self.scheduler = make_scheduler(s, kind)
        kcc = self.scheduler.kv_cache_config
        row_bytes = sum(
            len(g.layer_names) * g.kv_cache_spec.page_size_bytes for g in kcc.kv_cache_groups
        )
        self.moved = Moved()
        sims: dict[str, Callable[..., Any]] = {
            "none": NoWorkerSim,
            "kvferry": KVFerryWorkerSim,
            "vllm": VLLMWorkerSim,
        }
        self.sim = sims[kind](row_bytes, self.moved)
        conn = self.scheduler.connector
        self.meter = CallMeter(conn) if instrument and conn is not None else None
        self.by_step: dict[int, list[Arrival]] = {}
        for arrival in workload:
            self.by_step.setdefault(arrival.step, []).append(arrival)
        self.last_arrival = max(self.by_step)
        self.step_ns: list[int] = []
        self.step_cpu_ns: list[int] = []
        self.computed = 0
        self.preemptions = 0
        self.finished = 0
        self.notes: list[str] = []
        self.done = False

    def _request(self, a: Arrival) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=a.max_tokens)
        sp.update_from_generation_config({}, 2)
        return Request(
            request_id=a.req_id,
            prompt_token_ids=list(a.prompt),
            sampling_params=sp,
            pooling_params=None,
            block_hasher=self.hasher,
        )

    def step(self) -> None:
        from vllm.v1.outputs import ModelRunnerOutput

        scheduler, meter = self.scheduler, self.meter
        step = len(self.step_ns)
        # Building the requests (hashing their prompts) is not timed.
        arrivals = [self._request(a) for a in self.by_step.get(step, ())]
        if (
            not arrivals
            and step > self.last_arrival
            and not scheduler.has_requests()
            and self.sim.idle()
        ):
            self.done = True
            return
        if step >= self.max_steps:
            self.notes.append(f"{self.kind}: stopped after {self.max_steps} steps with work left")
            self.done = True
            return
        perf, cpu = time.perf_counter_ns, time.process_time_ns

        if meter is not None:
            meter.active = True
        c0, t0 = cpu(), perf()
        for r in arrivals:
            scheduler.add_request(r)
        so = scheduler.schedule()
        t1, c1 = perf(), cpu()
        if meter is not None:
            meter.active = False

        # -- the simulated model runner and worker (not timed) --
        kv_out = self.sim.step(so.kv_connector_metadata)
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in req_ids:
            req = scheduler.requests[rid]
            # A partial prefill chunk's sample is discarded by the model runner.
            sampled.append([SAMPLED_TOKEN] if req.num_computed_tokens >= req.num_tokens else [])
        self.computed += so.total_num_scheduled_tokens
        self.preemptions += len(so.preempted_req_ids or ())
        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )

        if meter is not None:
            meter.active = True
        c2, t2 = cpu(), perf()
        outs = scheduler.update_from_output(so, output)
        t3, c3 = perf(), cpu()
        if meter is not None:
            meter.active = False
            meter.end_step()
        self.step_ns.append((t1 - t0) + (t3 - t2))
        self.step_cpu_ns.append((c1 - c0) + (c3 - c2))
        for eco in outs.values():
            self.finished += sum(1 for o in eco.outputs if o.finished)

    def finish(self) -> RunResult:
        kind, notes, scheduler = self.kind, self.notes, self.scheduler
        stats = None
        if kind == "kvferry":
            conn = scheduler.connector
            stats = conn.statistics()
            if stats.jobs_in_flight:
                notes.append(f"kvferry: {stats.jobs_in_flight} jobs still in flight at the end")
            if stats.loads_failed or stats.stores_failed:
                notes.append(
                    f"kvferry: {stats.loads_failed} loads / {stats.stores_failed} stores failed"
                )
            left = len(conn._scheduler._reqs)
            if left:
                notes.append(f"kvferry: {left} request states left after every request finished")
        elif kind == "vllm":
            cs = scheduler.connector.connector_scheduler
            if cs._jobs:
                notes.append(f"vllm: {len(cs._jobs)} jobs still pending at the end")
            if cs._req_status:
                notes.append(
                    f"vllm: {len(cs._req_status)} request states left after every request finished"
                )
        if self.finished != len(self.workload):
            notes.append(f"{kind}: {self.finished} of {len(self.workload)} requests finished")
        result = RunResult(
            kind=kind,
            steps=len(self.step_ns),
            step_ns=self.step_ns,
            step_cpu_ns=self.step_cpu_ns,
            moved=self.moved,
            computed_tokens=self.computed,
            preemptions=self.preemptions,
            host_blocks=host_capacity(scheduler, kind),
            finished=self.finished,
            notes=notes,
            stats=stats,
            meter=self.meter,
        )
        scheduler.shutdown()
        return result


def run_round(
    s: Setup,
    kinds: tuple[str, ...],
    workload: list[Arrival],
    max_steps: int,
    *,
    instrument: bool = False,
) -> dict[str, RunResult]:
    """One run of each kind, in lockstep: step i of every kind before step i+1 of any, in
    an order that rotates each step, so that whatever else the machine does at a moment
    weighs on all of them alike."""
    drivers = [Driver(s, k, workload, max_steps, instrument=instrument) for k in kinds]
    # What lives now (vLLM, the connectors, the workload) is exempt from full collections:
    # the heap of a real engine is larger still; the runs' own garbage is collected as usual.
    gc.collect()
    gc.freeze()
    try:
        i = 0
        while not all(d.done for d in drivers):
            rot = i % len(drivers)
            for d in drivers[rot:] + drivers[:rot]:
                if not d.done:
                    d.step()
            i += 1
    finally:
        gc.unfreeze()
    return {d.kind: d.finish() for d in drivers}


# -- main ----------------------------------------------------------------------------------


def import_kvferry_connector(tries: int = 6, wait_s: float = 10.0) -> None:
    """kvferry's sub-packages may be mid-edit by others: retry a failing import a few times."""
    for attempt in range(tries):
        try:
            import kvferry.connector  # noqa: F401

            return
        except Exception as exc:  # noqa: BLE001
            if attempt == tries - 1:
                raise
            print(
                f"(import kvferry.connector failed: {exc!r}; retrying in {wait_s:.0f}s)",
                file=sys.stderr,
            )
            for name in [m for m in sys.modules if m == "kvferry" or m.startswith("kvferry.")]:
                del sys.modules[name]
            time.sleep(wait_s)


def measure(
    s: Setup, args: argparse.Namespace, workload: list[Arrival], max_steps: int
) -> dict[str, Any]:
    """One mode's lockstep runs, its table and notes; its figures."""
    print()
    print(
        "== both connectors store "
        + (
            "decoded blocks too (kvferry store_decoded: true, vLLM offload_prompt_only: false)"
            if s.store_decoded
            else "prompt blocks only (vLLM's default; the headline)"
        )
    )
    kinds = ("none", "kvferry", "vllm")
    runs: dict[str, list[RunResult]] = {k: [] for k in kinds}
    t_start = time.perf_counter()
    run_round(s, kinds, workload[: 20 * args.per_step], max_steps)  # warm-up: first calls
    for _ in range(args.repeats):
        for kind, result in run_round(s, kinds, workload, max_steps).items():
            runs[kind].append(result)
    metered: dict[str, list[RunResult]] = {k: [] for k in kinds[1:]}
    for _ in range(args.instrument_repeats):
        for kind, result in run_round(s, kinds[1:], workload, max_steps, instrument=True).items():
            metered[kind].append(result)
    elapsed = time.perf_counter() - t_start

    same = {k: len({r.signature for r in runs[k]}) == 1 for k in kinds}
    wall = {k: best_steps([r.step_ns for r in runs[k]], same[k]) for k in kinds}
    cpu = {k: best_steps([r.step_cpu_ns for r in runs[k]], same[k]) for k in kinds}
    best_mean = {k: statistics.fmean(wall[k]) / 1e3 for k in kinds}
    best_median = {k: statistics.median(wall[k]) / 1e3 for k in kinds}
    best_cpu = {k: statistics.fmean(cpu[k]) / 1e3 for k in kinds}
    added = {k: best_mean[k] - best_mean["none"] for k in kinds}
    added_median = {k: best_median[k] - best_median["none"] for k in kinds}
    added_cpu = {k: best_cpu[k] - best_cpu["none"] for k in kinds}

    print(
        f"scheduler overhead: {len(workload)} requests ({args.per_step}/step), engine block "
        f"{args.block}, offloaded block {args.offload_block}, engine cache {args.gpu_blocks} "
        f"blocks, host {s.host_blocks} offloaded blocks; per step the best of {args.repeats} "
        "lockstep repeats "
        f"({elapsed:.1f}s)"
    )
    head = (
        f"{'run':<8} {'steps':>5} {'mean µs':>8} {'med µs':>7} {'added':>7} {'add med':>7} "
        f"{'cpu µs':>7} {'add cpu':>7} {'loads':>5} {'stores':>6} {'flush':>5} {'hit tok':>7} "
        f"{'stored':>7} {'computed':>8} {'preempt':>7} {'host':>5}"
    )
    print(head)
    print("-" * len(head))
    for k in kinds:
        r = runs[k][0]  # the workload's figures are the same in every repeat (checked below)
        m = r.moved
        print(
            f"{k:<8} {r.steps:>5} {best_mean[k]:>8.1f} {best_median[k]:>7.1f} {added[k]:>7.1f} "
            f"{added_median[k]:>7.1f} {best_cpu[k]:>7.1f} {added_cpu[k]:>7.1f} {m.load_jobs:>5} "
            f"{m.store_jobs:>6} {m.flushes:>5} {m.load_blocks * args.block:>7} "
            f"{m.store_blocks * args.block:>7} {r.computed_tokens:>8} {r.preemptions:>7} "
            f"{str(r.host_blocks or '-'):>5}"
        )
    print(
        "µs are per step (add_request + schedule + update_from_output); added = run − none; "
        "cpu = process CPU time; hit tok / stored = engine blocks the load / store jobs cover "
        "× block size; computed = tokens the simulated model ran"
    )

    inside: dict[str, float] = {}
    if args.instrument_repeats > 0:
        # Per step, the least time inside the connector over the instrumented repeats; the
        # per-call split is the instrumented repeat with the least total.
        best_meter: dict[str, CallMeter] = {}
        for k, rs in metered.items():
            meters = [r.meter for r in rs if r.meter is not None]
            same_k = len({r.signature for r in rs}) == 1
            inside[k] = statistics.fmean(best_steps([m.step_ns for m in meters], same_k)) / 1e3
            best_meter[k] = min(meters, key=lambda m: sum(m.step_ns))
        steps_of = {k: rs[0].steps for k, rs in metered.items()}
        print()
        print(
            f"inside the connector ({args.instrument_repeats} more runs each, every call vLLM "
            "makes timed; µs per step, and calls in the run):"
        )
        names = [n for n in CONNECTOR_CALLS if any(n in bm.calls for bm in best_meter.values())]
        print(f"{'call':<30}" + "".join(f"{k + ' µs':>12}{'calls':>7}" for k in best_meter))
        for n in ["(all)", *names]:
            cells = ""
            for k, bm in best_meter.items():
                if n == "(all)":
                    us, calls = inside[k], sum(bm.calls.values())
                else:
                    us, calls = bm.ns.get(n, 0) / 1e3 / steps_of[k], bm.calls.get(n, 0)
                cells += f"{us:>12.1f}{calls:>7}"
            print(f"{n:<30}{cells}")
        print()

    notes: list[str] = []
    for k in kinds:
        if not same[k]:
            sigs = sorted({r.signature for r in runs[k]})
            notes.append(
                f"{k}: the repeats did different work {sigs}; kept the repeat with the least mean"
            )
        notes.extend(runs[k][0].notes)
    kf, vl = runs["kvferry"][0], runs["vllm"][0]
    st = kf.stats
    if st is not None and st.tokens_hit != st.tokens_loaded:
        lookups = ""
        mk = metered.get("kvferry")
        if mk and mk[0].meter is not None:
            lookups = (
                f"; vLLM asked it {mk[0].meter.calls.get('get_num_new_matched_tokens', 0)} "
                "times for "
                f"{len(workload)} requests (it asks again while a request cannot be scheduled)"
            )
        notes.append(
            f"kvferry's counters: tokens_hit {st.tokens_hit} but tokens_loaded {st.tokens_loaded} "
            f"(its load jobs cover {kf.moved.load_blocks * args.block}): tokens_hit, "
            "tokens_looked_up "
            f"and tokens_missed grow at every get_num_new_matched_tokens call{lookups}"
        )
    if kf.moved.load_blocks != vl.moved.load_blocks:
        notes.append(
            f"hit tokens differ (kvferry {kf.moved.load_blocks * args.block}, vLLM "
            f"{vl.moved.load_blocks * args.block}): see 'Hit tokens' in this script's docstring"
        )
    if kf.moved.store_blocks != vl.moved.store_blocks and not s.store_decoded:
        notes.append(
            f"stored tokens differ (kvferry {kf.moved.store_blocks * args.block}, vLLM "
            f"{vl.moved.store_blocks * args.block}): vLLM offloads prompt blocks only "
            "(offload_prompt_only=True by default), kvferry every full block, decoded ones too"
        )
    if kf.host_blocks != vl.host_blocks:
        notes.append(
            f"host capacities differ: kvferry {kf.host_blocks}, vLLM {vl.host_blocks} blocks"
        )
    if added["vllm"] <= 0 or added["kvferry"] <= 0:
        notes.append("an added time is ≤ 0: the machine is too noisy for this figure; run again")
    for note in notes:
        print("note:", note)

    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 3) if b > 0 else None

    figures: dict[str, Any] = {
        "sched_overhead_vs_vllm": ratio(added["kvferry"], added["vllm"]),
        "kvferry_added_us_per_step": round(added["kvferry"], 2),
        "vllm_added_us_per_step": round(added["vllm"], 2),
        "baseline_us_per_step": round(best_mean["none"], 2),
        "sched_overhead_vs_vllm_median": ratio(added_median["kvferry"], added_median["vllm"]),
        "sched_overhead_vs_vllm_cpu": ratio(added_cpu["kvferry"], added_cpu["vllm"]),
        "kvferry_added_us_per_step_median": round(added_median["kvferry"], 2),
        "vllm_added_us_per_step_median": round(added_median["vllm"], 2),
        "baseline_us_per_step_median": round(best_median["none"], 2),
    }
    if inside:
        figures["sched_overhead_vs_vllm_inside"] = ratio(inside["kvferry"], inside["vllm"])
        figures["kvferry_inside_us_per_step"] = round(inside["kvferry"], 2)
        figures["vllm_inside_us_per_step"] = round(inside["vllm"], 2)
    figures |= {
        "steps": {k: runs[k][0].steps for k in kinds},
        "hit_tokens": {k: runs[k][0].moved.load_blocks * args.block for k in kinds[1:]},
        "load_jobs": {k: runs[k][0].moved.load_jobs for k in kinds[1:]},
        "store_jobs": {k: runs[k][0].moved.store_jobs for k in kinds[1:]},
        "requests": len(workload),
        "block": args.block,
        "offload_block": args.offload_block,
        "repeats": args.repeats,
        "store_decoded": s.store_decoded,
    }
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--docs", type=int, default=40)
    ap.add_argument("--per-step", type=int, default=2, help="requests arriving per step")
    ap.add_argument("--block", type=int, default=16, help="engine block size (tokens)")
    ap.add_argument("--offload-block", type=int, default=16, help="offloaded block size (tokens)")
    ap.add_argument("--gpu-blocks", type=int, default=768, help="engine KV cache size (blocks)")
    ap.add_argument(
        "--host-blocks", type=int, default=1536, help="host tier capacity (engine blocks)"
    )
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--mode",
        choices=("both", "prompt", "decoded"),
        default="both",
        help="both connectors store prompt blocks only (vLLM's default; the headline), "
        "decoded blocks too, or both modes one after the other (default)",
    )
    ap.add_argument(
        "--instrument-repeats",
        type=int,
        default=3,
        help="extra runs per connector that time each connector call (0: none)",
    )
    ap.add_argument(
        "--watermarks",
        type=float,
        nargs=2,
        metavar=("LOW", "HIGH"),
        help="kvferry's eviction_watermarks (default: its own)",
    )
    ap.add_argument("--quick", action="store_true", help="a small workload, one repeat")
    args = ap.parse_args()
    if "PYTHONHASHSEED" not in os.environ:
        # Sets of keys (bytes) iterate in an order that depends on Python's hash seed, and
        # both connectors' eviction and job order follow it: fix it, for one workload.
        os.execve(
            sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"}
        )
    if args.quick:
        args.requests, args.repeats = 150, 1
    if args.offload_block % args.block:
        ap.error("--offload-block must be a multiple of --block")

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import_kvferry_connector()
    from kvferry.testing import make_tiny_model

    bpc = args.offload_block // args.block
    tmp = tempfile.TemporaryDirectory(prefix="kvferry-sched-bench-")
    s = Setup(
        model_dir=make_tiny_model(Path(tmp.name) / "tiny-llama"),
        block=args.block,
        offload_block=args.offload_block,
        num_gpu_blocks=args.gpu_blocks,
        host_blocks=args.host_blocks // bpc,
        max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_batched_tokens,
        max_model_len=2048,
        watermarks=tuple(args.watermarks) if args.watermarks else None,
    )
    workload = make_workload(
        seed=args.seed, requests=args.requests, docs=args.docs, per_step=args.per_step
    )
    max_steps = 50 * len(workload) + 1000

    modes = {"prompt": [False], "decoded": [True], "both": [False, True]}[args.mode]
    figures: dict[str, Any] = {}
    for store_decoded in modes:
        mode_s = dataclasses.replace(s, store_decoded=store_decoded)
        mode_figures = measure(mode_s, args, workload, max_steps)
        if store_decoded and figures:
            figures["decoded"] = mode_figures
        else:
            figures |= mode_figures
    tmp.cleanup()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
