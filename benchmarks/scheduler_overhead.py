"""Scheduler-side overhead per engine step: kvferry against vLLM's OffloadingConnector.

A real ``vllm.v1.core.sched.scheduler.Scheduler`` (vLLM 0.32, no engine, no model
forward) is driven step by step on one seeded workload, three times:

  0. no connector (the baseline);
  1. kvferry's scheduler half (``KVFerryConnector`` loaded by module path);
  2. vLLM's own ``OffloadingConnector`` scheduler half (CPU backend, LRU), whose
     scheduler side needs no GPU — only its worker refuses the CPU platform.

Each step is ``schedule()`` then ``update_from_output()`` with a simulated model-runner
output: one sampled token per request whose prefill is complete, and the
``KVConnectorOutput`` each connector's real worker would report if every copy took no
time. The schedulers and the simulated workers of both connectors are in
``benchmarks/_simulators.py`` (tested by tests/connector/test_simulators.py).

Timed per step: ``add_request`` of the step's arrivals (it calls the connector's
``on_new_request``) + ``schedule()`` + ``update_from_output()``, with ``perf_counter_ns``
(wall) and ``process_time_ns`` (CPU); building the simulated output is not timed. The
three runs go in lockstep (step i of each, in an order that rotates, before step i+1 of
any), so that what the rest of the machine does weighs on all three alike; as in a real
engine, where the model runs between two scheduler steps, each step starts with caches
the others have cooled. That is repeated ``--repeats`` times, after an untimed warm-up,
and the whole (a run) ``--runs`` times.
The workload is deterministic (a fixed seed, and ``PYTHONHASHSEED=0``: the script
re-executes itself to set it), so step i does the same work in every repeat; the figure
kept for step i is its least time over the repeats (what a repeat adds on top — other
processes, interrupts — is noise), then the mean and the median over steps. Objects
alive before a run are frozen out of the garbage collector (``gc.freeze``); the runs'
own garbage is collected as usual. Added time per step = connector run − no-connector
run; the headline figure is kvferry's added time ÷ vLLM's, on the mean, as the median
over the runs (``sched_overhead_vs_vllm``; target ≤ 1.0, goal 0.5), with each run's and
the spread (``_runs``, ``_spread``: least, median, most). The same ratio on the median
step and on CPU time is printed too (medians over the runs); the table, and the µs
figures in the JSON, are of the run that gave the headline.

Then ``--instrument-repeats`` more lockstep repeats of the two connectors time every
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
from _simulators import (
    SIMULATORS,
    Moved,
    Setup,
    host_capacity,
    make_scheduler,
    model_runner_output,
    new_request,
    row_bytes,
)

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
    handled_now: tuple[int, int] | None = None
    """kvferry's asks and tells to its actors: (handled on the engine thread without a
    loop turn, sent), where the connector runs the stepped runtime."""
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


@dataclass
class Timed:
    """One run's figures: per step the best of its repeats, then mean, median and CPU time
    per step of each kind, and the time each connector adds to the baseline's."""

    runs: dict[str, list[RunResult]]
    same: dict[str, bool]
    best_mean: dict[str, float]
    best_median: dict[str, float]
    best_cpu: dict[str, float]
    added: dict[str, float]
    added_median: dict[str, float]
    added_cpu: dict[str, float]

    @classmethod
    def of(cls, runs: dict[str, list[RunResult]]) -> Timed:
        same = {k: len({r.signature for r in rs}) == 1 for k, rs in runs.items()}
        wall = {k: best_steps([r.step_ns for r in rs], same[k]) for k, rs in runs.items()}
        cpu = {k: best_steps([r.step_cpu_ns for r in rs], same[k]) for k, rs in runs.items()}
        best_mean = {k: statistics.fmean(v) / 1e3 for k, v in wall.items()}
        best_median = {k: statistics.median(v) / 1e3 for k, v in wall.items()}
        best_cpu = {k: statistics.fmean(v) / 1e3 for k, v in cpu.items()}
        return cls(
            runs=runs,
            same=same,
            best_mean=best_mean,
            best_median=best_median,
            best_cpu=best_cpu,
            added={k: v - best_mean["none"] for k, v in best_mean.items()},
            added_median={k: v - best_median["none"] for k, v in best_median.items()},
            added_cpu={k: v - best_cpu["none"] for k, v in best_cpu.items()},
        )

    def ratio(self, which: str) -> float | None:
        """kvferry's added time ÷ vLLM's (``which``: added, added_median or added_cpu)."""
        added = getattr(self, which)
        return round(added["kvferry"] / added["vllm"], 3) if added["vllm"] > 0 else None


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
        self.moved = Moved()
        self.sim = SIMULATORS[kind](row_bytes(self.scheduler.kv_cache_config), self.moved)
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

    def step(self) -> None:
        scheduler, meter = self.scheduler, self.meter
        step = len(self.step_ns)
        # Building the requests (hashing their prompts) is not timed.
        arrivals = [
            new_request(a.req_id, a.prompt, a.max_tokens, self.hasher)
            for a in self.by_step.get(step, ())
        ]
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
        output = model_runner_output(scheduler, so, self.sim)
        self.computed += so.total_num_scheduled_tokens
        self.preemptions += len(so.preempted_req_ids or ())

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
        handled_now = None
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
            runtime = conn._scheduler.runtime
            if hasattr(runtime, "handled_now"):
                handled_now = (runtime.handled_now, runtime.sent)
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
            handled_now=handled_now,
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
    t_start = time.perf_counter()
    run_round(s, kinds, workload[: 20 * args.per_step], max_steps)  # warm-up: first calls
    timed: list[Timed] = []
    for _ in range(args.runs):
        runs: dict[str, list[RunResult]] = {k: [] for k in kinds}
        for _ in range(args.repeats):
            for kind, result in run_round(s, kinds, workload, max_steps).items():
                runs[kind].append(result)
        timed.append(Timed.of(runs))
    metered: dict[str, list[RunResult]] = {k: [] for k in kinds[1:]}
    for _ in range(args.instrument_repeats):
        for kind, result in run_round(s, kinds[1:], workload, max_steps, instrument=True).items():
            metered[kind].append(result)
    elapsed = time.perf_counter() - t_start

    # The headline is the median over the runs; the table shows the run that gave it.
    ratios = [t.ratio("added") for t in timed]
    ratios_median = [t.ratio("added_median") for t in timed]
    ratios_cpu = [t.ratio("added_cpu") for t in timed]
    order = sorted(range(len(timed)), key=lambda i: (ratios[i] is None, ratios[i] or 0.0))
    shown = timed[order[(len(timed) - 1) // 2]]
    runs, same = shown.runs, shown.same
    best_mean, best_median, best_cpu = shown.best_mean, shown.best_median, shown.best_cpu
    added, added_median, added_cpu = shown.added, shown.added_median, shown.added_cpu

    print(
        f"scheduler overhead: {len(workload)} requests ({args.per_step}/step), engine block "
        f"{args.block}, offloaded block {args.offload_block}, engine cache {args.gpu_blocks} "
        f"blocks, host {s.host_blocks} offloaded blocks; per step the best of {args.repeats} "
        f"lockstep repeats, {args.runs} run(s) of them "
        f"({elapsed:.1f}s)"
    )
    if len(timed) > 1:
        print(
            "kvferry's added time ÷ vLLM's, each run (mean over steps / median / CPU): "
            + ", ".join(
                f"{a:.3f} / {b:.3f} / {c:.3f}"
                for a, b, c in zip(ratios, ratios_median, ratios_cpu, strict=True)
            )
        )
        print("the table: the run with the median ratio")
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
            f"{vl.moved.store_blocks * args.block}): both store prompt blocks only, but a "
            "block a connector loaded or holds already is not stored again, so what each "
            "stores follows what each hit"
        )
    if kf.handled_now is not None:
        now, sent = kf.handled_now
        print(
            f"kvferry's asks and tells to its actors: {now} of {sent} handled without a turn "
            "of the actor's task (its immediate messages, the sync runtime's short way)"
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

    def median_of(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return round(statistics.median(known), 3) if len(known) == len(values) else None

    def spread_of(values: list[float | None]) -> list[float | None]:
        known = sorted(v for v in values if v is not None)
        if len(known) < len(values):
            return [None, None, None]
        return [known[0], round(statistics.median(known), 3), known[-1]]

    figures: dict[str, Any] = {
        "sched_overhead_vs_vllm": median_of(ratios),
        "kvferry_added_us_per_step": round(added["kvferry"], 2),
        "vllm_added_us_per_step": round(added["vllm"], 2),
        "baseline_us_per_step": round(best_mean["none"], 2),
        "sched_overhead_vs_vllm_median": median_of(ratios_median),
        "sched_overhead_vs_vllm_cpu": median_of(ratios_cpu),
        "sched_overhead_vs_vllm_spread": spread_of(ratios),
        "sched_overhead_vs_vllm_runs": ratios,
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
        "runs": args.runs,
        "store_decoded": s.store_decoded,
    }
    if kf.handled_now is not None:
        figures["kvferry_messages_handled_now"], figures["kvferry_messages_sent"] = kf.handled_now
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
    ap.add_argument("--repeats", type=int, default=5, help="lockstep repeats in a run")
    ap.add_argument(
        "--runs",
        type=int,
        default=3,
        help="runs of --repeats each; the headline ratios are their medians (default 3)",
    )
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
        args.requests, args.repeats, args.runs = 150, 1, 1
    if args.runs < 1 or args.repeats < 1:
        ap.error("--runs and --repeats must be at least 1")
    if args.offload_block % args.block:
        ap.error("--offload-block must be a multiple of --block")

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
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
