"""The shared Redis tier's own cost: chunk writes and reads through RedisStore against raw
pipelined SET / GET of values of the same size, with the same client, on the same server.

What kvferry adds on top of the raw commands: the compact chunk header, an xxh3 checksum
of every payload on write and on read, the header's verification, and the copy of each
payload into its host slot (a raw GET leaves the value in a bytes object). A write sends
each value as its header and a view of the payload in its slot (no copy); a read takes
each reply from the connection's stream straight into its slot, a piece at a time (the
raw GET's parser copies it three times into the bytes object it returns). The figures
(``*_vs_raw`` = kvferry GB/s / raw GB/s, the lower of the chunk sizes; target >= 0.8):

- ``redis_write_vs_raw``, ``redis_read_vs_raw``: one ``redis-server`` on loopback;
- ``cluster_write_vs_raw``, ``cluster_read_vs_raw``: a 3-master Redis Cluster on loopback.

Both start their own ``redis-server`` processes (Debian's package; ``make bench``
installs it when missing), nothing persisted. Each trial moves ``TRIAL_BYTES`` per
direction in pipelines of ``BATCH_BYTES`` (the Redis actor's batch), all its writes then
all its reads. Raw and kvferry take turns pipeline by pipeline, each going first every
other time, so that both see the same moments of a shared machine; a trial sums its
pipelines' times, and a figure is the median of the trials.

Part 2, two engines sharing one Redis: three vLLM (CPU) engines, each in a process of
its own (this script, ``--engine``, driven over a pipe), all alive at once and computing
on the same cores (``equal_cpu_threads``):

  A          kvferry, a host tier of two documents and a bit, the Redis tier;
  B          the same configuration, its own host tier (empty of the documents);
  recompute  no kvferry: what B's requests cost without the tier.

Each round takes fresh documents: A answers them (untimed), one request at a time, and
its writes to Redis are waited for; then B and the recompute engine (engine caches
emptied, serpentine order) answer the same documents, one request at a time, timed as
the sum of their requests. ``b_recompute_vs_shared`` = the median recompute pass / the
median pass of B, which reads A's chunks Redis -> host -> device (target >= 5). The
recompute engine then answers the same documents again from its own prefix cache
(``resident``: vLLM at its best, nothing to load): ``recompute_vs_resident`` bounds what
any tier can reach on whole requests, which include the decoding of their answers (the
same in every engine). ``b_recompute_vs_shared_ttft`` is the same ratio on vLLM's own
time to first token (arrival to first token, summed over the pass), which is what a
loaded prefix saves.

Then Redis dies: A stores another set of fresh documents, B answers them and
``redis-server`` is killed (SIGKILL) after its first ``kill_after`` requests. Every
request must finish. The requests B began after its log said ``redis_breaker_opened``
are timed against the recompute engine's for the same documents (one pass before B's,
one after, averaged): ``slowdown_vs_no_tier`` (target <= 1.1).

Outputs: B's answer to a document it loaded is compared with the recompute engine's
answer from its own prefix cache (the same computation: a cached prefix, the rest
computed), a document computed in full with a full recompute (``outputs_equal``); as in
benchmarks/tiers.py, ``outputs_equal_full_recompute`` compares every answer with a full
recompute (a cached prefix can round differently on the large model, vLLM's own cache
alike).

The model is long_doc_qa's (hidden 768, 6 layers: prefill compute dominates), 4
documents of 6000 tokens a round, 2 rounds, 8 documents in the pass Redis dies in;
``--quick`` runs the tiny model on short documents, one round, and one raw trial of
less data (figures mean little). ``--only raw|engines`` runs one part.

The last line printed is one JSON object of every figure.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import attrs
import numpy as np
from long_doc_qa import serpentine
from tiers import QA_FULL, QA_QUICK, QUESTION_TOKENS, block_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' server helpers

from kvferry.tiers import Fingerprint, Outcome, RedisStore  # noqa: E402
from tests.tiers.redis_servers import RedisClusterProcs, RedisServer  # noqa: E402

SIZES = (256 << 10, 2 << 20)
TRIAL_BYTES = 64 << 20
QUICK_TRIAL_BYTES = 16 << 20
BATCH_BYTES = 8 << 20
TRIALS = 5
FP = Fingerprint(
    model="bench",
    dtype="bfloat16",
    layout="LBHNC",
    block_size=16,
    tp_rank=0,
    tp_world_size=1,
    block_hash_algorithm="sha256_cbor",
)


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


async def _timed(fn: Callable[[], Awaitable[None]]) -> float:
    start = time.perf_counter()
    await fn()
    return time.perf_counter() - start


async def _measure(store: RedisStore, size: int, trials: int, trial_bytes: int) -> dict[str, float]:
    """GB/s of each of the four ways, median over the trials."""
    client = store.client
    count = trial_bytes // size
    per_batch = max(1, BATCH_BYTES // size)
    rng = np.random.default_rng(0)
    slots = rng.integers(0, 256, (count, size), dtype=np.uint8)
    into = np.zeros_like(slots)
    raw_values = [slots[i].tobytes() for i in range(count)]
    keys = [_key(i) for i in range(count)]
    raw_keys = [b"raw:" + k.hex().encode() for k in keys]
    batches = [range(b, min(b + per_batch, count)) for b in range(0, count, per_batch)]
    ttl = store.ttl_s

    async def raw_write(batch: range) -> None:
        pipe = client.pipeline(transaction=False)
        for i in batch:
            pipe.set(raw_keys[i], raw_values[i], ex=ttl)
        await pipe.execute()

    async def raw_read(batch: range) -> None:
        pipe = client.pipeline(transaction=False)
        for i in batch:
            pipe.get(raw_keys[i])
        got = await pipe.execute()
        assert all(len(v) == size for v in got)

    async def kv_write(batch: range) -> None:
        outcomes = await store.write([keys[i] for i in batch], [slots[i] for i in batch])
        assert (outcomes == Outcome.OK).all(), outcomes

    async def kv_read(batch: range) -> None:
        outcomes = await store.read([keys[i] for i in batch], [into[i] for i in batch])
        assert (outcomes == Outcome.OK).all(), outcomes

    ways: dict[str, Callable[[range], Awaitable[None]]] = {
        "raw_write": raw_write,
        "kv_write": kv_write,
        "raw_read": raw_read,
        "kv_read": kv_read,
    }
    seconds: dict[str, list[float]] = {name: [0.0] * trials for name in ways}
    for t in range(trials):
        # All the trial's writes, then its reads (a value is read a trial's worth of
        # traffic after its write, not while it is still warm in the server's caches).
        # Raw and kvferry take turns pipeline by pipeline, each going first every other
        # time, so that both see the same moments of a shared machine.
        for direction in ("write", "read"):
            for n, batch in enumerate(batches):
                order = ("raw", "kv") if (t + n) % 2 == 0 else ("kv", "raw")
                for way in order:
                    name = f"{way}_{direction}"
                    seconds[name][t] += await _timed(functools.partial(ways[name], batch))
    assert np.array_equal(into, slots)
    await store.delete(keys)
    pipe = client.pipeline(transaction=False)
    for k in raw_keys:
        pipe.delete(k)
    await pipe.execute()
    return {name: count * size / statistics.median(s) / 1e9 for name, s in seconds.items()}


async def _run(label: str, store: RedisStore, trials: int, trial_bytes: int) -> dict[str, Any]:
    await store.connect()
    rows: dict[str, Any] = {}
    try:
        for size in SIZES:
            gbs = await _measure(store, size, trials, trial_bytes)
            rows[size] = gbs
            print(
                f"{label:8} {size >> 10:5} KiB  "
                f"write raw {gbs['raw_write']:6.2f} kvferry {gbs['kv_write']:6.2f} GB/s "
                f"({gbs['kv_write'] / gbs['raw_write']:.2f})  "
                f"read raw {gbs['raw_read']:6.2f} kvferry {gbs['kv_read']:6.2f} GB/s "
                f"({gbs['kv_read'] / gbs['raw_read']:.2f})",
                flush=True,
            )
    finally:
        await store.aclose()
    out: dict[str, Any] = {}
    for direction in ("write", "read"):
        ratios = {s: g[f"kv_{direction}"] / g[f"raw_{direction}"] for s, g in rows.items()}
        out[f"{label}_{direction}_vs_raw"] = round(min(ratios.values()), 3)
        for s, g in rows.items():
            out[f"{label}_{direction}_gbps_{s >> 10}k"] = round(g[f"kv_{direction}"], 3)
            out[f"{label}_{direction}_raw_gbps_{s >> 10}k"] = round(g[f"raw_{direction}"], 3)
    return out


# ----------------------------------------------------------------------------- part 2


# The model of benchmarks/tiers.py's long-document QA (there from disk), fewer and longer
# documents: 6000 tokens (vLLM's own long-document benchmark defaults to 20000, the tiny
# model's positions end at 8192). With 1500 tokens, a prefill took ~0.4 s on 2 cores and
# the 7 decoding steps of an answer (~16 ms each, the same in every engine) bounded the
# whole-request ratio at ~3.5 even for a prefix resident in vLLM's own cache. The engines'
# own caches hold two documents. Eager: a compiled start costs minutes.
ENGINES_FULL = attrs.evolve(
    QA_FULL, docs=4, doc_tokens=6000, engine_blocks=100, max_model_len=6144, rounds=2, eager=True
)
ENGINES_QUICK = QA_QUICK
KILL_AFTER = 2
"""B's requests answered before redis-server is killed."""
KILL_EXTRA_DOCS = 4
"""The pass Redis dies in has this many documents more than a round: the breakers (the
existence checks' and the worker's, each opened by ``breaker_threshold`` failures of its
own operations) take a few requests to open, and the figure times those after."""
TOKENS_HIT = "vllm:kvferry_redis_tokens_hit"
REPLY = "KVFERRY-BENCH "
REQUEST_TIMEOUT_S = 300.0
START_TIMEOUT_S = 600.0
BREAKER_OPENED = "redis_breaker_opened"


def engine_main(spec: dict[str, Any]) -> None:
    """An engine's process (``--engine SPEC``): starts ``vllm.LLM``, then answers one JSON
    command a line from stdin with one line ``REPLY + JSON`` on the original stdout
    (everything else the process and its engine core print goes to stderr)."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvferry.testing import engine_args, kvferry_metrics, reset_engine_cache

    llm = LLM(
        **engine_args(
            spec["model"],
            kvferry=spec["kvferry"],
            num_gpu_blocks=spec["blocks"],
            max_model_len=spec["max_model_len"],
            enforce_eager=spec["eager"],
            disable_log_stats=False,
        )
    )
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out.write(REPLY + json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        reply: dict[str, Any] = {}
        if cmd["op"] == "ask":
            before = kvferry_metrics(llm).get(TOKENS_HIT, 0)
            start = time.perf_counter()
            [res] = llm.generate(
                [TokensPrompt(prompt_token_ids=cmd["doc"])], params, use_tqdm=False
            )
            seconds = time.perf_counter() - start
            metrics = res.metrics  # stats on: vLLM's own, arrival to first token
            reply = {
                "seconds": seconds,
                "ttft": getattr(metrics, "first_token_latency", None),
                "tokens": list(res.outputs[0].token_ids),
                "loaded": ((res.kv_transfer_params or {}).get("kvferry") or {}).get(
                    "tokens_loaded", 0
                ),
                "from_redis": kvferry_metrics(llm).get(TOKENS_HIT, 0) - before,
            }
        elif cmd["op"] == "reset":
            reset_engine_cache(llm)
        elif cmd["op"] == "metrics":
            reply = kvferry_metrics(llm)
        elif cmd["op"] == "quit":
            break
        out.write(REPLY + json.dumps(reply) + "\n")
    from kvferry.testing import close_engine

    close_engine(llm)
    out.write(REPLY + json.dumps({"closed": True}) + "\n")


class Engine:
    """An engine in a child process: this script with ``--engine``; its log in a file."""

    def __init__(self, name: str, spec: dict[str, Any], log: Path) -> None:
        self.name = name
        self.kvferry = spec["kvferry"] is not None
        self.log = log
        self._log_file = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--engine", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            text=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                self._lines.put(line[len(REPLY) :])
        self._lines.put(None)

    def reply(self, timeout_s: float = REQUEST_TIMEOUT_S) -> Any:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(
                f"{self.name}: no answer in {timeout_s} s (see {self.log})"
            ) from None
        if line is None:
            raise RuntimeError(f"{self.name} exited: {self.log_tail()}")
        return json.loads(line)

    def send(self, op: str, **args: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self.reply()

    def ask(self, doc: list[int]) -> dict[str, Any]:
        answer: dict[str, Any] = self.send("ask", doc=doc)
        return answer

    def breaker_opened(self) -> int:
        """How many times its log says a Redis circuit breaker opened."""
        return self.log.read_text(errors="replace").count(BREAKER_OPENED)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.reply(timeout_s=60)
            except (TimeoutError, RuntimeError, BrokenPipeError):
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=60)
        self._log_file.close()


@attrs.define
class Timed:
    """One timed pass of one engine: per document, in order."""

    seconds: list[float] = attrs.Factory(list)
    ttft: list[float] = attrs.Factory(list)
    """vLLM's time to first token (arrival to first token) of each request."""
    tokens: list[list[int]] = attrs.Factory(list)
    loaded: list[int] = attrs.Factory(list)
    from_redis: list[int] = attrs.Factory(list)


def timed_pass(
    eng: Engine, docs: list[list[int]], between: Callable[[int], None] | None = None
) -> Timed:
    """``docs`` one request at a time after emptying the engine's cache; ``between(i)``
    runs before request ``i`` (untimed)."""
    eng.send("reset")
    run = Timed()
    for i, doc in enumerate(docs):
        if between is not None:
            between(i)
        r = eng.ask(doc)
        run.seconds.append(r["seconds"])
        run.ttft.append(r["ttft"] if r["ttft"] is not None else float("nan"))
        run.tokens.append(r["tokens"])
        run.loaded.append(int(r["loaded"]))
        run.from_redis.append(int(r["from_redis"]))
    return run


def store_in_redis(a: Engine, url: str, docs: list[list[int]], full_blocks: int) -> None:
    """A answers ``docs``, each one's writes to Redis waited for (A's host tier is small:
    a block being written through is in use)."""
    from kvferry.testing import redis_chunk_keys, wait_for_redis_chunks

    for doc in docs:
        count = len(redis_chunk_keys(url))
        a.ask(doc)
        wait_for_redis_chunks(url, count + full_blocks, timeout_s=120)


def reference(recompute: Engine, docs: list[list[int]]) -> tuple[Timed, Timed]:
    """The recompute engine's timed pass (full prefills), then the same documents again
    from its own prefix cache, which holds the pass (``resident``: vLLM at its best, the
    bound on what any tier can give)."""
    full = timed_pass(recompute, docs)
    resident = Timed()
    for doc in docs:
        r = recompute.ask(doc)
        resident.seconds.append(r["seconds"])
        resident.ttft.append(r["ttft"] if r["ttft"] is not None else float("nan"))
        resident.tokens.append(r["tokens"])
    return full, resident


def engines_part(quick: bool) -> dict[str, Any]:
    """Part 2: prints its table, returns its figures."""
    from kvferry.testing import equal_cpu_threads, long_doc_prompts, make_tiny_model

    sizes = ENGINES_QUICK if quick else ENGINES_FULL
    equal_cpu_threads()  # inherited by the engines' processes
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    full_blocks = (sizes.doc_tokens + QUESTION_TOKENS) // 128
    host_blocks = 2 * full_blocks + 2
    rounds = [
        long_doc_prompts(sizes.docs, sizes.doc_tokens, seed=400 + r) for r in range(sizes.rounds)
    ]
    kill_docs = long_doc_prompts(sizes.docs + KILL_EXTRA_DOCS, sizes.doc_tokens, seed=500)
    kill_after = min(KILL_AFTER, sizes.docs - 1)
    warm = long_doc_prompts(1, sizes.doc_tokens, seed=600)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvferry-bench-shared-") as tmp:
        model = str(make_tiny_model(Path(tmp) / "model", **sizes.model))
        server = RedisServer(Path(tmp) / "redis")
        server.start()
        ferry = {
            "cpu_bytes_to_use": host_blocks * block_bytes(sizes.model),
            "traces": {"enabled": False},
            "tiers": [
                {
                    "kind": "redis",
                    "url": server.url,
                    "lookup_wait_ms": 50,
                    "ttl_s": 3600,
                    "op_timeout_s": 1.0,
                    "breaker_threshold": 5,
                    "breaker_cooldown_s": 5.0,
                }
            ],
        }
        common = {"model": model, "max_model_len": sizes.max_model_len, "eager": sizes.eager}
        # The recompute engine's cache holds a pass (its cached answers: the reference).
        ref_blocks = len(kill_docs) * (full_blocks + 2) + 16
        specs = {
            "A": {**common, "kvferry": ferry, "blocks": sizes.engine_blocks},
            "B": {**common, "kvferry": ferry, "blocks": sizes.engine_blocks},
            "recompute": {**common, "kvferry": None, "blocks": ref_blocks},
        }
        engines: dict[str, Engine] = {}
        shared: list[Timed] = []
        full: list[Timed] = []
        resident: list[Timed] = []
        try:
            # One after the other: on 2 cores, three starting at once take longer.
            for n, spec in specs.items():
                engines[n] = Engine(n, spec, Path(tmp) / f"{n}.log")
                engines[n].reply(timeout_s=START_TIMEOUT_S)  # started
            a, b, recompute = engines["A"], engines["B"], engines["recompute"]
            started = time.perf_counter() - t0
            print(f"  three engines started in {started:.0f} s", flush=True)
            store_in_redis(a, server.url, warm, full_blocks)  # compiles; B's warm-up loads
            for eng in (b, recompute):
                eng.ask(warm[0])
            for r, docs in enumerate(rounds):
                store_in_redis(a, server.url, docs, full_blocks)
                for eng in serpentine([b, recompute], r):
                    if eng is b:
                        shared.append(timed_pass(b, docs))
                    else:
                        f, c = reference(recompute, docs)
                        full.append(f)
                        resident.append(c)
                print(
                    f"  round {r + 1}/{sizes.rounds}: B from Redis {sum(shared[-1].seconds):.2f} s "
                    f"({sum(shared[-1].from_redis)} tokens from Redis), recompute "
                    f"{sum(full[-1].seconds):.2f} s",
                    flush=True,
                )

            # Redis dies in the middle of B's pass.
            store_in_redis(a, server.url, kill_docs, full_blocks)
            before_kill, before_cached = reference(recompute, kill_docs)
            first_open: list[int] = []
            opened_before = b.breaker_opened()

            def kill_between(i: int) -> None:
                if i == kill_after:
                    server.kill()
                if i >= kill_after and not first_open and b.breaker_opened() > opened_before:
                    first_open.append(i)

            killed = timed_pass(b, kill_docs, kill_between)
            after_kill = timed_pass(recompute, kill_docs)
            print(
                f"  redis-server killed before B's request {kill_after + 1} of "
                f"{len(kill_docs)}; breaker opened before request "
                f"{first_open[0] + 1 if first_open else '-'}",
                flush=True,
            )
        finally:
            for eng in engines.values():
                eng.close()
            server.kill()
    took = time.perf_counter() - t0

    med = statistics.median
    shared_s = [sum(t.seconds) for t in shared]
    recompute_s = [sum(t.seconds) for t in full]
    resident_s = [sum(t.seconds) for t in resident]
    ratio = med(recompute_s) / med(shared_s)
    ttft = {
        name: [sum(t.ttft) for t in runs]
        for name, runs in (("shared", shared), ("recompute", full), ("resident", resident))
    }
    ratio_ttft = med(ttft["recompute"]) / med(ttft["shared"])
    bound = med(recompute_s) / med(resident_s)

    def differ(
        ours: Timed, full_ref: Timed, cached_ref: Timed, label: str
    ) -> tuple[list[str], list[str]]:
        """Documents whose answer differs from the reference for how B got it, and from
        a full recompute."""
        ref, strict = [], []
        for i, tokens in enumerate(ours.tokens):
            expected = cached_ref.tokens[i] if ours.loaded[i] else full_ref.tokens[i]
            if tokens != expected:
                ref.append(f"{label} doc {i}")
            if tokens != full_ref.tokens[i]:
                strict.append(f"{label} doc {i}")
        return ref, strict

    differ_ref: list[str] = []
    differ_full: list[str] = []
    for r in range(sizes.rounds):
        d_ref, d_full = differ(shared[r], full[r], resident[r], f"round {r + 1}")
        differ_ref += d_ref
        differ_full += d_full
    d_ref, d_full = differ(killed, before_kill, before_cached, "killed pass")
    differ_ref += d_ref
    differ_full += d_full
    finished = len(killed.tokens) == len(kill_docs)

    after = first_open[0] if first_open else len(kill_docs)
    dead_s = sum(killed.seconds[after:])
    no_tier_s = sum(
        (x + y) / 2
        for x, y in zip(before_kill.seconds[after:], after_kill.seconds[after:], strict=True)
    )
    slowdown = dead_s / no_tier_s if no_tier_s else None  # None: it never opened
    after_kill_s = sum(killed.seconds[kill_after:])
    no_tier_after_kill_s = sum(
        (x + y) / 2
        for x, y in zip(
            before_kill.seconds[kill_after:],
            after_kill.seconds[kill_after:],
            strict=True,
        )
    )
    full_tokens = sizes.docs * full_blocks * 128
    print(
        f"\ntwo engines sharing one Redis: {sizes.docs} documents x {sizes.doc_tokens} tokens a "
        f"round, one request at a time; engine caches {sizes.engine_blocks} blocks, host tiers "
        f"{host_blocks} blocks (a document is {full_blocks}); {sizes.rounds} rounds, medians"
    )
    print(f"{'engine':<34} {'pass (s)':>9} {'TTFT (s)':>9}   per round: pass / TTFT (s)")
    for name, secs, key in (
        ("B, from A's chunks in Redis", shared_s, "shared"),
        ("recompute (no kvferry)", recompute_s, "recompute"),
        ("resident (vLLM's own cache)", resident_s, "resident"),
    ):
        rounds = "  ".join(f"{x:.2f}/{y:.3f}" for x, y in zip(secs, ttft[key], strict=True))
        print(f"{name:<34} {med(secs):>9.2f} {med(ttft[key]):>9.3f}   {rounds}")
    print(
        f"b_recompute_vs_shared = {ratio:.2f} (whole requests; with the prefix resident in "
        f"vLLM's own cache {bound:.2f}: what no tier can beat); on time to first token "
        f"{ratio_ttft:.2f}; tokens B read from Redis a round: "
        f"{[sum(t.from_redis) for t in shared]} (full blocks: {full_tokens})"
    )
    print(
        f"Redis killed after {kill_after} of B's requests: all {len(kill_docs)} finished: "
        f"{finished}; after the breaker opened ({len(kill_docs) - after} requests) "
        f"{dead_s:.2f} s vs {no_tier_s:.2f} s without any tier: slowdown "
        f"{'-' if slowdown is None else f'{slowdown:.3f}'}; "
        f"every request after the kill {after_kill_s:.2f} s vs {no_tier_after_kill_s:.2f} s"
    )
    print(f"outputs equal: {not differ_ref}   (part took {took:.0f} s)")
    if differ_ref:
        print(f"outputs that differ from the engine without kvferry: {', '.join(differ_ref)}")
    print(
        f"equal to a full recompute too: {not differ_full}"
        + (f" (not: {', '.join(differ_full)})" if differ_full else "")
    )
    return {
        "b_recompute_vs_shared": round(ratio, 3),
        "b_recompute_vs_shared_ttft": round(ratio_ttft, 3),
        "recompute_vs_resident": round(bound, 3),
        "slowdown_vs_no_tier": None if slowdown is None else round(slowdown, 3),
        "slowdown_after_kill_vs_no_tier": round(after_kill_s / no_tier_after_kill_s, 3),
        "killed_pass_all_finished": finished,
        "outputs_equal": not differ_ref,
        "outputs_differ": differ_ref,
        "outputs_equal_full_recompute": not differ_full,
        "b_pass_s": {
            "shared": round(med(shared_s), 3),
            "recompute": round(med(recompute_s), 3),
            "resident": round(med(resident_s), 3),
        },
        "b_pass_ttft_s": {k: round(med(v), 4) for k, v in ttft.items()},
        "b_tokens_from_redis": [sum(t.from_redis) for t in shared],
        "full_block_tokens": full_tokens,
        "kill_after": kill_after,
        "requests_after_breaker_opened": len(kill_docs) - after,
        "engines_part_s": round(took, 1),
        "engines_start_s": round(started, 1),
    }


def raw_part(trials: int, trial_bytes: int) -> dict[str, Any]:
    """Part 1: prints its table, returns its figures."""
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvferry-bench-redis-") as tmp:
        server = RedisServer(Path(tmp) / "single")
        cluster = RedisClusterProcs(Path(tmp) / "cluster")
        try:
            server.start()
            store = RedisStore(url=server.url, fingerprint=FP, op_timeout_s=30)
            result |= anyio.run(_run, "redis", store, trials, trial_bytes)
            server.kill()
            cluster.start()
            cstore = RedisStore(cluster=cluster.urls, fingerprint=FP, op_timeout_s=30)
            result |= anyio.run(_run, "cluster", cstore, trials, trial_bytes)
        finally:
            server.kill()
            cluster.stop()
    result["trial_bytes"] = trial_bytes
    result["batch_bytes"] = BATCH_BYTES
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=TRIALS)
    parser.add_argument("--only", choices=("raw", "engines"), help="run one part only")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: one raw trial, the tiny model"
    )
    parser.add_argument("--engine", help=argparse.SUPPRESS)  # an engine's process (part 2)
    args = parser.parse_args()
    if args.engine is not None:
        engine_main(json.loads(args.engine))
        return
    result: dict[str, Any] = {}
    if args.only != "engines":
        result |= raw_part(
            1 if args.quick else args.trials, QUICK_TRIAL_BYTES if args.quick else TRIAL_BYTES
        )
    if args.only != "raw":
        result |= engines_part(args.quick)
    result["quick"] = args.quick
    print(json.dumps(result))


if __name__ == "__main__":
    main()
