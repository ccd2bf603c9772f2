"""Soak: vLLM (CPU) with kvferry for a bounded time, on a seeded mix, with seeded faults.

The mix, in waves of requests added together (some a few engine steps later): multi-turn
chats (each turn's prompt is the last turn's prompt and answer plus new tokens, so the
blocks of generated tokens are reused), prompts sharing a few system prefixes, long
documents asked again and again, long generations that overflow a small engine cache
(preemption), aborts a seeded number of steps after a request was added, per-request
kvferry switches (``{"load": false}``, ``{"store": false}``, both), and resets of the
prefix cache and of kvferry's host tier in the middle of traffic. The host tier is sized
to thrash (far fewer blocks than the mix touches).

Faults come from the copy engine (``copy_engine: "kvferry.testing:soak_copy_engine"``,
see kvferry/_faults.py): failed copies, hangs past the job deadline, submissions that
raise, and an exception inside the transfer actor; drawn per job from the seed. The
engine appends every fault it injected to a log file the soak reads back.

Checks:
- every request finishes (or is aborted on purpose) within ``--request-bound-s``; a step
  that does not return within ``--stall-s`` ends the soak as hung;
- every output equals the same request's output on a baseline engine, token for token
  (greedy; aborted requests on the tokens both produced);
- kvferry's host blocks in use never exceed its capacity, and the RSS of vLLM's processes
  does not grow from the first half of the run to the second;
- the metrics add up: tokens looked up = hit + missed, tokens hit = tokens loaded + the
  tokens of the loads the injector failed (those are recomputed), and every failure the
  injector caused is counted in ``vllm:kvferry_loads_failed`` / ``stores_failed``. With
  ``--tiers``, a read the disk or Redis failed for real (a redis-server starved of CPU
  times out, and its breaker opens) fails its load too: counted, recomputed, and shown
  in ``tier_chunks_failed``, but not injected, so this check then reports a mismatch;
  ``loads_failed_by_cause`` then shows those loads as ``disk`` or ``redis``.

The baseline is an engine with kvferry configured and every request turning it off
(``{"load": false, "store": false}``: kvferry moves nothing), fed the same waves. Not a
connector-less engine: under preemption, vLLM 0.32 schedules differently as soon as any
KV connector is configured, and its greedy output then differs from a connector-less
engine's at near-ties (tests/e2e/test_connector.py shows it on a plain workload, with a
connector whose methods do nothing). ``--baseline plain`` uses a connector-less engine
anyway (``none`` compares nothing). Both engines compute in float32, so that batch
composition (which the loads, aborts and faults change) moves no near-tie.

Prints a table and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' server helpers

from kvferry._metrics import LOAD_FAILURES  # noqa: E402
from tests.tiers.redis_servers import RedisServer, redis_available  # noqa: E402

OFF = {"kvferry": {"load": False, "store": False}}
SWITCHES: list[tuple[float, dict[str, Any] | None]] = [
    (0.08, {"kvferry": {"load": False}}),
    (0.08, {"kvferry": {"store": False}}),
    (0.04, OFF),
]
DEFAULT_RATES = {"fail": 0.05, "hang": 0.02, "reject": 0.03, "crash": 0.01}
TIERS = ("host", "disk", "redis", "disk+redis")


@attrs.frozen(kw_only=True)
class Req:
    rid: str
    kind: str
    prompt: tuple[int, ...]
    max_tokens: int
    add_at: int
    """Engine steps after the wave started."""
    abort_after: int | None
    """Engine steps after it was added (None: runs to the end)."""
    params: dict[str, Any] | None
    chat: int | None = None


@attrs.frozen(kw_only=True)
class Wave:
    index: int
    reqs: tuple[Req, ...]
    reset_at: int | None
    """Engine step (after the wave started) at which the caches are reset, if any."""


@attrs.define
class Outcome:
    tokens: list[int] = attrs.Factory(list)
    added_s: float = 0.0
    ended_s: float | None = None
    aborted: bool = False
    finished: bool = False
    loaded: int = 0


class Mix:
    """Seeded waves. Chats continue from the soak engine's own answers (``answered``);
    the baseline replays the waves as recorded."""

    def __init__(self, seed: int, vocab: int = 2000) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab
        r = self.rng
        self.docs = [self._tokens(r.randrange(900, 1400)) for _ in range(8)]
        self.prefixes = [self._tokens(r.randrange(300, 600)) for _ in range(3)]
        self.chats: dict[int, list[int]] = {}
        self._next_chat = 0
        self.waves: list[Wave] = []

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    def _switches(self) -> dict[str, Any] | None:
        u = self.rng.random()
        for p, params in SWITCHES:
            if u < p:
                return params
            u -= p
        return None

    def _request(self, wave: int, i: int) -> Req:
        r = self.rng
        kind = r.choices(["doc", "shared", "chat", "long_gen"], weights=[3, 3, 3, 2])[0]
        chat = None
        if kind == "doc":
            doc = r.randrange(len(self.docs))
            prompt = self.docs[doc] + self._tokens(8)
            max_tokens = r.randrange(4, 24)
        elif kind == "shared":
            prompt = r.choice(self.prefixes) + self._tokens(r.randrange(40, 300))
            max_tokens = r.randrange(8, 64)
        elif kind == "chat":
            live = [c for c in self.chats if c not in self._busy]
            if live and r.random() < 0.75:
                chat = r.choice(live)
            else:
                chat = self._next_chat
                self._next_chat += 1
                self.chats[chat] = []
            self._busy.add(chat)
            history = self.chats[chat]
            if len(history) > 1500:  # the conversation is over: start again
                history = self.chats[chat] = []
            prompt = history + self._tokens(r.randrange(20, 120))
            max_tokens = r.randrange(16, 96)
        else:
            prompt = self._tokens(r.randrange(150, 400))
            max_tokens = r.randrange(200, 480)
        add_at = 0 if r.random() < 0.7 else r.randrange(1, 12)
        abort_after = r.randrange(1, 40) if r.random() < 0.08 else None
        return Req(
            rid=f"w{wave}-{i}-{kind}",
            kind=kind,
            prompt=tuple(prompt),
            max_tokens=max_tokens,
            add_at=add_at,
            abort_after=abort_after,
            params=self._switches(),
            chat=chat,
        )

    def next_wave(self) -> Wave:
        r = self.rng
        index = len(self.waves)
        self._busy: set[int] = set()
        reqs = tuple(self._request(index, i) for i in range(r.randrange(3, 8)))
        reset_at = r.randrange(1, 30) if r.random() < 0.12 else None
        wave = Wave(index=index, reqs=reqs, reset_at=reset_at)
        self.waves.append(wave)
        return wave

    def answered(self, req: Req, tokens: list[int]) -> None:
        if req.chat is not None:
            self.chats[req.chat] = list(req.prompt) + tokens


class Stalled(Exception):
    """An engine step did not return within the stall bound."""


@contextmanager
def bounded(seconds: float) -> Iterator[None]:
    """Raise :class:`Stalled` in this (main) thread if the block lasts over ``seconds``
    (a blocking wait for the engine's output is interrupted by the signal)."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise Stalled(f"no engine output within {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def children_rss() -> int:
    """RSS of this process's descendants (vLLM's engine core and workers), summed, bytes;
    not the Redis tier's redis-server (it holds every chunk written: the shared store's
    memory, bounded by its own ``maxmemory``, not what kvferry keeps in vLLM's)."""
    import psutil

    total = 0
    for child in psutil.Process().children(recursive=True):
        try:
            if child.name() == "redis-server":
                continue
            total += child.memory_info().rss
        except psutil.Error:  # ended meanwhile
            pass
    return total


@attrs.define
class RssByWave:
    """The RSS of vLLM's processes after each wave (the same waves on both engines, so the
    soak's growth can be set against vLLM's own on the same requests)."""

    samples: list[int] = attrs.Factory(list)

    def sample(self) -> None:
        self.samples.append(children_rss())

    def series_mib(self, points: int = 12) -> list[list[float]]:
        """About ``points`` samples spread over the run: [wave, MiB]."""
        step = max(1, len(self.samples) // points)
        return [[w, round(r / 2**20, 1)] for w, r in list(enumerate(self.samples))[::step]]

    def growth_mib(self, upto: int | None = None) -> tuple[float, float, float]:
        """(first-half median, second-half median, growth) in MiB over waves [0, upto)."""
        kept = self.samples[:upto]
        if len(kept) < 2:
            return 0.0, 0.0, 0.0
        half = len(kept) // 2
        a, b = statistics.median(kept[:half]) / 2**20, statistics.median(kept[half:]) / 2**20
        return a, b, b - a


@attrs.define
class Engine:
    """A ``vllm.LLM`` driven step by step (adds, aborts and resets at chosen steps)."""

    name: str
    llm: Any
    off: bool
    """Every request turns kvferry off (the baseline)."""
    stall_s: float
    resets: int = 0
    resets_ok: int = 0

    def run_wave(self, wave: Wave) -> dict[str, Outcome]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        out: dict[str, Outcome] = {}
        pending = sorted(wave.reqs, key=lambda q: q.add_at)
        added_at: dict[str, int] = {}
        by_id = {q.rid: q for q in wave.reqs}
        step = 0
        while pending or engine.has_unfinished_requests():
            if pending and not engine.has_unfinished_requests():
                step = max(step, pending[0].add_at)  # nothing runs: no step to wait for
            while pending and pending[0].add_at <= step:
                q = pending.pop(0)
                params = OFF if self.off else q.params
                sp = SamplingParams(
                    max_tokens=q.max_tokens,
                    temperature=0.0,
                    ignore_eos=True,
                    detokenize=False,
                    output_kind=RequestOutputKind.DELTA,
                    extra_args={"kv_transfer_params": params} if params else None,
                )
                engine.add_request(q.rid, TokensPrompt(prompt_token_ids=list(q.prompt)), sp)
                out[q.rid] = Outcome(added_s=time.monotonic())
                added_at[q.rid] = step
            for rid, o in out.items():
                q = by_id[rid]
                if (
                    q.abort_after is not None
                    and not o.finished
                    and not o.aborted
                    and step - added_at[rid] >= q.abort_after
                ):
                    engine.abort_request([rid])
                    o.aborted, o.ended_s = True, time.monotonic()
            if wave.reset_at == step:
                self.resets += 1
                # Requests are running: vLLM's own prefix cache stays, kvferry's host
                # tier is cleared (reset_connector) with stores and loads in flight.
                with bounded(self.stall_s):
                    self.resets_ok += bool(self.llm.reset_prefix_cache(reset_connector=True))
            if not engine.has_unfinished_requests():
                continue
            with bounded(self.stall_s):
                outputs = engine.step()
            step += 1
            for ro in outputs:
                o = out.get(ro.request_id)
                if o is None or o.aborted:
                    continue
                o.tokens.extend(ro.outputs[0].token_ids)
                if ro.finished:
                    o.finished, o.ended_s = True, time.monotonic()
                    kvp = ((ro.kv_transfer_params or {}).get("kvferry")) or {}
                    o.loaded = kvp.get("tokens_loaded", 0)
        return out

    def drive_idle_steps(self, rounds: int = 3) -> None:
        """Tiny requests with kvferry off, so the engine steps (and reports the stats of
        jobs that ended after the last request) after traffic stopped."""
        for i in range(rounds):
            idle = Req(
                rid=f"idle-{time.monotonic_ns()}-{i}",
                kind="idle",
                prompt=(5, 6, 7, 8),
                max_tokens=2,
                add_at=0,
                abort_after=None,
                params=OFF,
            )
            self.run_wave(Wave(index=-1, reqs=(idle,), reset_at=None))
            time.sleep(0.5)


def start_engine(
    model: str, kvferry: dict[str, Any] | None, blocks: int, eager: bool = False
) -> Any:
    from vllm import LLM

    from kvferry.testing import engine_args

    return LLM(
        **engine_args(
            model,
            kvferry=kvferry,
            num_gpu_blocks=blocks,
            dtype="float32",
            disable_log_stats=False,
            enforce_eager=eager,
        )
    )


def below_host(tiers: str, folder: str, bytes_to_use: int, stack: ExitStack) -> list[Any]:
    """The ``tiers`` entries of the soak's config for ``--tiers``; a Redis tier's server is
    started here (stopped when ``stack`` closes). The baseline engine has none: it moves
    nothing anyway."""
    out: list[Any] = []
    if "disk" in tiers:
        disk = os.path.join(folder, "disk")
        shutil.rmtree(disk, ignore_errors=True)  # a kept work folder: start empty
        out.append({"kind": "disk", "path": disk, "bytes_to_use": bytes_to_use})
    if "redis" in tiers:
        if not redis_available():
            raise SystemExit("--tiers with redis needs redis-server (make redis-server)")
        server = RedisServer(Path(folder) / "redis")
        server.start()
        stack.callback(server.kill)
        out.append({"kind": "redis", "url": server.url})
    return out


def metric(llm: Any, name: str) -> float:
    return sum(getattr(m, "value", 0) or 0 for m in llm.get_metrics() if m.name == name)


def block_bytes(model_cfg: dict[str, Any], block_tokens: int = 128, value_bytes: int = 4) -> int:
    head_dim = (
        model_cfg.get("head_dim") or model_cfg["hidden_size"] // model_cfg["num_attention_heads"]
    )
    per_token = 2 * model_cfg["num_hidden_layers"] * model_cfg["num_key_value_heads"] * head_dim
    return per_token * value_bytes * block_tokens


def first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def run_soak(
    *,
    minutes: float | None = None,
    waves: int | None = None,
    seed: int = 0,
    rates: dict[str, float] | None = None,
    engine_blocks: int = 24,
    host_blocks: int = 40,
    job_timeout_s: float = 3.0,
    request_bound_s: float = 300.0,
    stall_s: float = 180.0,
    baseline: str = "off",
    workdir: str | None = None,
    log: Any = print,
    eager: bool = False,
    tiers: str = "host",
) -> dict[str, Any]:
    """Run the soak and its baseline; return the figures (see the module docstring).

    Traffic runs for ``minutes`` of wall time, or for exactly ``waves`` waves (the same
    traffic on a busy machine as on a quiet one: what the tests use); give one.
    ``eager``: both engines without graph capture (a shorter start; the tests').
    ``tiers``: below host memory, nothing (``host``), a disk tier in the work folder
    (``disk``), a Redis tier on a redis-server of the soak's own (``redis``), or both
    (``disk+redis``); each holds several times what host memory does, so that most loads
    read from it once host memory thrashed."""
    if (minutes is None) == (waves is None):
        raise ValueError("run_soak: give minutes or waves, not both")
    if tiers not in TIERS:
        raise ValueError(f"run_soak: tiers must be one of {TIERS}, not {tiers!r}")
    from kvferry.testing import (
        TINY_LLAMA_CONFIG,
        FaultPlan,
        close_engine,
        equal_cpu_threads,
        kvferry_metrics,
        make_tiny_model,
        read_fault_log,
    )

    equal_cpu_threads()
    rates = DEFAULT_RATES if rates is None else rates
    tmp = tempfile.TemporaryDirectory() if workdir is None else None
    folder = workdir or tmp.name  # type: ignore[union-attr]
    stack = ExitStack()  # a redis-server, stopped after both engines
    try:
        model = str(make_tiny_model(os.path.join(folder, "model")))
        fault_log = os.path.join(folder, "faults.jsonl")
        if os.path.exists(fault_log):
            os.remove(fault_log)
        hang_s = 3 * job_timeout_s  # past the deadline: the deadline, not the timer, ends it
        plan = FaultPlan(seed=seed, rates=rates, log=fault_log, hang_s=hang_s)
        os.environ["KVFERRY_SOAK_FAULTS"] = plan.to_env()
        bb = block_bytes(json.loads(TINY_LLAMA_CONFIG.read_text()))
        ferry_cfg = {
            "cpu_bytes_to_use": host_blocks * bb,
            "job_timeout_s": job_timeout_s,
            "copy_engine": "kvferry.testing:soak_copy_engine",
            "traces": {"enabled": False},
        }
        if tiers != "host":
            ferry_cfg["tiers"] = below_host(tiers, folder, 8 * host_blocks * bb, stack)

        # -- the soak ------------------------------------------------------------------
        mix = Mix(seed)
        outcomes: dict[str, Outcome] = {}
        reqs: dict[str, Req] = {}
        hung: list[str] = []
        stalled: str | None = None
        engine_error: str | None = None
        gauge_samples: list[tuple[float, float]] = []
        rss = RssByWave()
        t_start = time.monotonic()
        llm = start_engine(model, ferry_cfg, engine_blocks, eager)
        eng = Engine(name="kvferry", llm=llm, off=False, stall_s=stall_s)
        startup_s = time.monotonic() - t_start
        t0 = time.monotonic()
        end = t0 + minutes * 60 if minutes is not None else float("inf")
        try:
            while time.monotonic() < end and (waves is None or len(mix.waves) < waves):
                wave = mix.next_wave()
                try:
                    res = eng.run_wave(wave)
                except Stalled as exc:
                    stalled = f"wave {wave.index}: {exc}"
                    res = {}
                    hung.extend(q.rid for q in wave.reqs)
                except Exception as exc:  # the engine died: every request of the wave is lost
                    engine_error = f"wave {wave.index}: {type(exc).__name__}: {exc}"
                    res = {}
                    hung.extend(q.rid for q in wave.reqs)
                for q in wave.reqs:
                    reqs[q.rid] = q
                    if q.rid in res:
                        outcomes[q.rid] = res[q.rid]
                        if res[q.rid].finished:
                            mix.answered(q, res[q.rid].tokens)
                rss.sample()
                m = kvferry_metrics(llm)
                gauge_samples.append(
                    (
                        m.get("vllm:kvferry_host_blocks_used", 0.0),
                        m.get("vllm:kvferry_host_blocks_capacity", 0.0),
                    )
                )
                done = sum(o.finished or o.aborted for o in outcomes.values())
                log(
                    f"  wave {wave.index:4d}: {len(wave.reqs)} requests, {done} done so far, "
                    f"{time.monotonic() - t0:6.0f} s, host blocks "
                    f"{gauge_samples[-1][0]:.0f}/{gauge_samples[-1][1]:.0f}"
                )
                if stalled or engine_error:
                    break
            traffic_s = time.monotonic() - t0
            if not (stalled or engine_error):
                # Jobs still in flight end within their deadline; step until they did.
                time.sleep(job_timeout_s + 1)
                try:
                    eng.drive_idle_steps()
                except Stalled as exc:
                    stalled = f"after traffic: {exc}"
            metrics = kvferry_metrics(llm)
            preemptions = metric(llm, "vllm:num_preemptions")
        finally:
            try:
                close_engine(llm)
            except Exception as exc:  # a dead engine
                log(f"closing the engine failed: {exc!r}")
        faults = read_fault_log(fault_log)

        # -- the baseline ----------------------------------------------------------------
        reference: dict[str, Outcome] = {}
        base_rss = RssByWave()
        base_s = 0.0
        if baseline != "none":
            base_cfg: dict[str, Any] | None = None
            if baseline == "off":
                base_cfg = {"cpu_bytes_to_use": host_blocks * bb, "traces": {"enabled": False}}
            base_llm = start_engine(model, base_cfg, engine_blocks, eager)
            base = Engine(
                name=f"baseline ({baseline})",
                llm=base_llm,
                off=base_cfg is not None,
                stall_s=stall_s,
            )
            t_base = time.monotonic()
            try:
                for wave in mix.waves:
                    reference.update(base.run_wave(wave))
                    base_rss.sample()
            finally:
                base_s = time.monotonic() - t_base
                close_engine(base_llm)
    finally:
        stack.close()
        if tmp is not None:
            tmp.cleanup()

    # -- checks ------------------------------------------------------------------------
    wrong: list[dict[str, Any]] = []
    for rid, o in outcomes.items():
        ref = reference.get(rid)
        if ref is None:
            continue
        if o.aborted or ref.aborted:
            n = min(len(o.tokens), len(ref.tokens))
            a, b = o.tokens[:n], ref.tokens[:n]
        else:
            a, b = o.tokens, ref.tokens
        if a != b:
            q = reqs[rid]
            wrong.append(
                {
                    "request": rid,
                    "params": q.params,
                    "prompt_tokens": len(q.prompt),
                    "at": first_difference(a, b),
                    "len": [len(a), len(b)],
                    "loaded": o.loaded,
                    "aborted": o.aborted,
                }
            )
    for rid, o in outcomes.items():
        if o.ended_s is None or (o.ended_s - o.added_s) > request_bound_s:
            if rid not in hung:
                hung.append(rid)
    # A request that turned loading off must not have loaded anything.
    switch_violations = [
        rid
        for rid, o in outcomes.items()
        if o.loaded and ((reqs[rid].params or {}).get("kvferry") or {}).get("load") is False
    ]
    latencies = [o.ended_s - o.added_s for o in outcomes.values() if o.ended_s is not None]

    injected = [f for f in faults if f["event"] == "injected"]
    by_kind = {k: sum(f["kind"] == k for f in injected) for k in rates}
    injected_loads = [f for f in injected if f["direction"] == "load"]
    injected_stores = [f for f in injected if f["direction"] == "store"]
    hangs_ended = {f["job_id"]: f["how"] for f in faults if f["event"] == "hang_ended"}
    loads_failed = metrics.get("vllm:kvferry_loads_failed", 0.0)
    stores_failed = metrics.get("vllm:kvferry_stores_failed", 0.0)
    counted = loads_failed + stores_failed
    ratio = counted / len(injected) if injected else 1.0
    failed_load_tokens = 128 * sum(f["num_blocks"] for f in injected_loads)
    looked_up = metrics.get("vllm:kvferry_tokens_looked_up", 0.0)
    hit = metrics.get("vllm:kvferry_tokens_hit", 0.0)
    missed = metrics.get("vllm:kvferry_tokens_missed", 0.0)
    loaded = metrics.get("vllm:kvferry_tokens_loaded", 0.0)
    metrics_add_up = (
        looked_up == hit + missed
        and hit == loaded + failed_load_tokens
        and loads_failed == len(injected_loads)
        and stores_failed == len(injected_stores)
    )
    host_ok = all(used <= cap for used, cap in gauge_samples) and bool(gauge_samples)
    rss_a, rss_b, rss_growth = rss.growth_mib()
    # vLLM's processes grow on their own (the baseline too, kvferry moving nothing); what
    # must not grow is what kvferry adds: the soak's growth beyond the baseline's, on the
    # same waves.
    base_growth = base_rss.growth_mib(len(rss.samples))[2] if base_rss.samples else 0.0
    rss_excess = rss_growth - base_growth
    rss_ok = rss_excess <= max(32.0, 0.05 * rss_a)

    figures = {
        "requests": len(outcomes),
        "finished": sum(o.finished for o in outcomes.values()),
        "aborted": sum(o.aborted for o in outcomes.values()),
        "waves": len(mix.waves),
        "faults_injected": len(injected),
        "faults_by_kind": by_kind,
        "hangs_ended": {
            h: sum(v == h for v in hangs_ended.values()) for h in ("cancelled", "timer")
        },
        "wrong_outputs": len(wrong) if baseline != "none" else None,
        "hung": len(hung),
        "stalled": stalled,
        "engine_error": engine_error,
        "rss_growth_mib": round(rss_growth, 1),
        "rss_mib": [round(rss_a, 1), round(rss_b, 1)],
        "rss_excess_mib": round(rss_excess, 1),
        "rss_series_mib": rss.series_mib(),
        "baseline_rss_growth_mib": round(base_growth, 1),
        "baseline_rss_series_mib": base_rss.series_mib(),
        "baseline_s": round(base_s, 1),
        "failures_counted_vs_injected": round(ratio, 4),
        "loads_failed": [loads_failed, len(injected_loads)],
        # Why they failed: an injected fault fails a copy (or, a hang the workers did not
        # report in time, meets the scheduler's deadline); a tier's own read failure is
        # counted as "disk" or "redis".
        "loads_failed_by_cause": {
            cause: metrics.get(f"vllm:kvferry_{name}", 0.0) for cause, name in LOAD_FAILURES
        },
        "stores_failed": [stores_failed, len(injected_stores)],
        "metrics_add_up": metrics_add_up,
        "tokens": {
            "looked_up": looked_up,
            "hit": hit,
            "missed": missed,
            "loaded": loaded,
            "failed_load_tokens": failed_load_tokens,
            "hit_on_disk": metrics.get("vllm:kvferry_disk_tokens_hit", 0.0),
            "hit_on_redis": metrics.get("vllm:kvferry_redis_tokens_hit", 0.0),
        },
        # Reads the tiers below failed for real (not injected): a redis-server starved of
        # CPU times out and its breaker opens; each fails its load, which the checks
        # above then find counted beyond the injected ones.
        "tier_chunks_failed": {
            "disk": metrics.get("vllm:kvferry_disk_reads_failed", 0.0),
            "redis": metrics.get("vllm:kvferry_redis_reads_failed", 0.0),
        },
        "host_within_bounds": host_ok,
        "switch_violations": len(switch_violations),
        "host_blocks_max": max((u for u, _ in gauge_samples), default=0),
        "host_blocks_capacity": gauge_samples[-1][1] if gauge_samples else 0,
        "evictions": metrics.get("vllm:kvferry_evictions", 0.0),
        "rss_ok": rss_ok,
        "preemptions": preemptions,
        "resets": [eng.resets_ok, eng.resets],
        "max_request_s": round(max(latencies, default=0.0), 1),
        "traffic_s": round(traffic_s, 1),
        "startup_s": round(startup_s, 1),
        "minutes": minutes,
        "seed": seed,
        "baseline": baseline,
        "tiers": tiers,
        "wrong": wrong[:5],
        "hung_requests": hung[:5],
    }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="traffic time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--faults",
        default=",".join(DEFAULT_RATES),
        help="fault kinds to inject (comma-separated; '' for none)",
    )
    parser.add_argument(
        "--fault-scale", type=float, default=1.0, help="multiply every fault rate by this"
    )
    parser.add_argument(
        "--baseline",
        choices=["off", "plain", "none"],
        default="off",
        help="off: kvferry configured and turned off by every request; plain: no connector; "
        "none: no output comparison",
    )
    parser.add_argument("--host-blocks", type=int, default=40)
    parser.add_argument(
        "--tiers",
        choices=TIERS,
        default="host",
        help="tiers below host memory: none, a disk tier in the work folder, a Redis tier on "
        "a redis-server of its own, or both",
    )
    parser.add_argument("--request-bound-s", type=float, default=300.0)
    parser.add_argument("--stall-s", type=float, default=180.0)
    parser.add_argument(
        "--workdir",
        default=None,
        help="keep the model and the fault log (faults.jsonl) here (default: a temporary one)",
    )
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    logging.getLogger("vllm").setLevel(logging.WARNING)
    kinds = [k for k in args.faults.split(",") if k]
    rates = {k: DEFAULT_RATES[k] * args.fault_scale for k in kinds}
    f = run_soak(
        minutes=args.minutes,
        seed=args.seed,
        rates=rates,
        baseline=args.baseline,
        host_blocks=args.host_blocks,
        request_bound_s=args.request_bound_s,
        stall_s=args.stall_s,
        workdir=args.workdir,
        log=lambda s: print(s, flush=True),
        tiers=args.tiers,
    )
    rows = [
        ("requests (finished / aborted)", f"{f['requests']} ({f['finished']} / {f['aborted']})"),
        ("waves, traffic", f"{f['waves']}, {f['traffic_s']:.0f} s"),
        ("faults injected", f"{f['faults_injected']} {f['faults_by_kind']}"),
        ("hangs ended by", str(f["hangs_ended"])),
        (
            "failures counted / injected",
            f"{f['failures_counted_vs_injected']} "
            f"(loads {f['loads_failed']}, stores {f['stores_failed']})",
        ),
        ("wrong outputs", str(f["wrong_outputs"])),
        ("hung requests", f"{f['hung']} {f['stalled'] or ''}"),
        ("engine died", str(f["engine_error"])),
        ("metrics add up", f"{f['metrics_add_up']} {f['tokens']}"),
        ("tier reads failed (chunks)", str(f["tier_chunks_failed"])),
        ("loads failed by cause", str(f["loads_failed_by_cause"])),
        (
            "host blocks max / capacity",
            f"{f['host_blocks_max']:.0f} / "
            f"{f['host_blocks_capacity']:.0f}, evictions {f['evictions']:.0f}",
        ),
        (
            "RSS first / second half (MiB)",
            f"{f['rss_mib'][0]} / {f['rss_mib'][1]} (growth {f['rss_growth_mib']}; "
            f"baseline's {f['baseline_rss_growth_mib']}; excess {f['rss_excess_mib']})",
        ),
        ("preemptions, resets (ok/asked)", f"{f['preemptions']:.0f}, {f['resets']}"),
        ("slowest request", f"{f['max_request_s']} s"),
    ]
    print(
        f"\nsoak: {args.minutes} min, seed {args.seed}, baseline {args.baseline}, "
        f"tiers {args.tiers}"
    )
    for name, value in rows:
        print(f"  {name:<32} {value}")
    if f["wrong"]:
        print(f"  first wrong outputs: {f['wrong']}")
    print(json.dumps(f))
    ok = (
        f["wrong_outputs"] == 0
        and f["hung"] == 0
        and f["engine_error"] is None
        and f["failures_counted_vs_injected"] == 1.0
        and f["metrics_add_up"]
        and f["host_within_bounds"]
        and f["rss_ok"]
        and f["switch_violations"] == 0
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
