"""Long-document QA on vLLM (CPU): documents that together exceed the engine's own KV
cache are asked, then re-asked in another order, one request at a time (a user coming
back to a document). Three configurations on the same seeded workload:

  (a) prefix caching alone, small engine cache   -> pass 2 recomputes
  (b) kvferry, the same small engine cache       -> pass 2 loads from host memory
  (c) an engine cache that holds everything      -> pass 2 hits the engine's own cache

and, separately, all-unique prompts (nothing to reuse) with and without kvferry, sent
in one batch: what offloading costs when nothing is reused.

The model is a random-weight Llama large enough (hidden 768, 6 layers) that prefill
compute, not vLLM's per-step overhead, dominates a pass. Prints a table and, last, one
JSON object.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import statistics
import tempfile
import time
from typing import Any

NUM_DOCS, DOC_TOKENS = 8, 1500
SMALL_BLOCKS, LARGE_BLOCKS = 24, 160  # 128-token blocks; a document needs 12
MODEL = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 6,
         "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64}
UNIQUE_DOCS, UNIQUE_TOKENS = 12, 1000


def engine(model: str, blocks: int, kvferry: dict[str, Any] | None) -> Any:
    from vllm import LLM

    from kvferry.testing import engine_args

    return LLM(**engine_args(model, kvferry=kvferry, num_gpu_blocks=blocks, max_model_len=2048))


def close(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def one_at_a_time(llm: Any, docs: list[list[int]], order: list[int]) -> tuple[float, dict[int, list[int]], int]:
    from kvferry.testing import run_long_doc_passes

    seconds, tokens, loaded = 0.0, {}, 0
    for i in order:
        [res] = run_long_doc_passes(llm, docs, [[i]])
        seconds += res.seconds
        tokens[i] = res.tokens[i]
        loaded += res.loaded[i]
    return seconds, tokens, loaded


def reask(model: str, blocks: int, kvferry: dict[str, Any] | None, docs: list[list[int]], orders: list[list[int]]) -> dict[str, Any]:
    llm = engine(model, blocks, kvferry)
    try:
        one_at_a_time(llm, docs[-1:], [0])  # warm-up: compile before timing
        llm.reset_prefix_cache(reset_connector=kvferry is not None)
        p1 = one_at_a_time(llm, docs, orders[0])
        p2 = one_at_a_time(llm, docs, orders[1])
    finally:
        close(llm)
    return {"pass1_s": p1[0], "pass2_s": p2[0], "tokens": [p1[1], p2[1]], "loaded": p2[2]}


def unique_throughput(model: str, kvferry: dict[str, Any] | None, prompts: list[list[list[int]]]) -> tuple[float, list[Any]]:
    """Prompt tokens per second over batches of all-unique prompts (best of the batches)."""
    from kvferry.testing import run_long_doc_passes

    llm = engine(model, SMALL_BLOCKS * 4, kvferry)
    try:
        run_long_doc_passes(llm, prompts[0][:1], [[0]])  # warm-up
        rates, outs = [], []
        for batch in prompts[1:]:
            [res] = run_long_doc_passes(llm, batch, [list(range(len(batch)))])
            rates.append(sum(len(p) for p in batch) / res.seconds)
            outs.append(res.tokens)
    finally:
        close(llm)
    return statistics.median(rates), outs


def main() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    logging.getLogger("vllm").setLevel(logging.WARNING)
    from kvferry.testing import long_doc_prompts, make_tiny_model, reask_order

    docs = long_doc_prompts(NUM_DOCS, DOC_TOKENS, seed=3)
    orders = [list(range(NUM_DOCS)), reask_order(NUM_DOCS, seed=4)]
    unique = [long_doc_prompts(UNIQUE_DOCS, UNIQUE_TOKENS, seed=100 + b) for b in range(4)]
    ferry_cfg = {"cpu_bytes_to_use": 512 << 20}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(tmp, **MODEL))
        t0 = time.perf_counter()
        a = reask(model, SMALL_BLOCKS, None, docs, orders)
        b = reask(model, SMALL_BLOCKS, ferry_cfg, docs, orders)
        c = reask(model, LARGE_BLOCKS, None, docs, orders)
        plain_rate, plain_outs = unique_throughput(model, None, unique)
        ferry_rate, ferry_outs = unique_throughput(model, ferry_cfg, unique)
        took = time.perf_counter() - t0

    outputs_equal = a["tokens"] == b["tokens"] == c["tokens"] and plain_outs == ferry_outs
    print(f"\nlong-document QA: {NUM_DOCS} documents x {DOC_TOKENS} tokens, one request at a time; "
          f"engine cache {SMALL_BLOCKS} (small) or {LARGE_BLOCKS} (large) blocks of 128 tokens")
    print(f"{'configuration':<34} {'pass 1 (s)':>10} {'pass 2 (s)':>10} {'loaded tokens':>14}")
    for name, r in (("(a) prefix caching, small cache", a), ("(b) kvferry, small cache", b), ("(c) large cache (resident)", c)):
        print(f"{name:<34} {r['pass1_s']:>10.2f} {r['pass2_s']:>10.2f} {r['loaded']:>14}")
    print(f"all-unique prompts ({UNIQUE_DOCS} x {UNIQUE_TOKENS} tokens per batch): "
          f"{plain_rate:,.0f} tok/s without kvferry, {ferry_rate:,.0f} tok/s with")
    print(f"outputs equal across configurations: {outputs_equal}   (benchmark took {took:.0f} s)")
    figures = {
        "pass2_recompute_vs_kvferry": round(a["pass2_s"] / b["pass2_s"], 3),
        "pass2_kvferry_vs_resident": round(b["pass2_s"] / c["pass2_s"], 3),
        "unique_kvferry_vs_plain": round(ferry_rate / plain_rate, 3),
        "outputs_equal": outputs_equal,
        "pass2_s": {"recompute": round(a["pass2_s"], 3), "kvferry": round(b["pass2_s"], 3), "resident": round(c["pass2_s"], 3)},
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
