"""A burst of requests sharing one long prefix that only kvferry's host tier holds.

vLLM (CPU) with kvferry. One long prefix (a system prompt, a document) is computed once
and stored to host memory; then vLLM's own prefix cache is reset, so the prefix is held
only by kvferry. Sixteen requests, each the prefix and its own short question, then ask:

- **single**: one at a time, vLLM's prefix cache reset before each: every request loads
  the prefix itself, alone on the engine (its time to first token, TTFT, is the
  reference);
- **burst**: all sixteen at once, vLLM's prefix cache reset once before: the first
  request scheduled loads the prefix; the others must neither load it again nor stall
  behind that load more than the batch's own compute explains.

A request whose hit overlaps another request's load in flight is answered "ask again"
by kvferry (it then finds the blocks in vLLM's own prefix cache once that load ended).
vLLM's own connector did the same in its PR #29087 and its offload overhead went from
-6.5% to -39.9%, TTFT up to 12x worse (vLLM #44294): this benchmark watches for that.

TTFT per request is vLLM's own (``RequestOutput.metrics.first_token_latency``, arrival
to first token, stats on). Rounds alternate single and burst; figures are medians over
rounds. ``shared_prefix_burst_ttft_p99_vs_single`` = the burst's p99 TTFT ÷ the single
requests' p99 (target ≤ 1.5). A third run per round, **resident**, sends the burst again
with new questions while the prefix sits in vLLM's own cache: nothing to load, only the
batch's own compute. On a CPU the sixteen questions of a burst are computed on the same
two cores, so a burst's TTFT exceeds a single request's even with nothing to load;
``shared_prefix_burst_ttft_p99_vs_resident_burst`` isolates what loading (and waiting for
another request's load) adds to a burst. ``burst_tokens_loaded`` counts what kvferry loaded in a
burst (from its per-request ``tokens_loaded``); ``loaded_twice`` is true if any burst
loaded more than the prefix once (kvferry's own ``vllm:kvferry_tokens_loaded`` counter
is checked to agree).

``--quick`` runs one round of a shorter prefix. Prints a table and, last, one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from typing import Any

REQUESTS = 16
BLOCK = 128


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round, a shorter prefix")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefix-blocks", type=int, default=12)
    parser.add_argument("--question-tokens", type=int, default=32)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.prefix_blocks = 1, 4
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    logging.getLogger("vllm").setLevel(logging.WARNING)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvferry.testing import (
        close_engine,
        engine_args,
        equal_cpu_threads,
        kvferry_metrics,
        long_doc_prompts,
        make_tiny_model,
    )

    equal_cpu_threads()
    prefix_tokens = args.prefix_blocks * BLOCK
    [prefix] = long_doc_prompts(1, prefix_tokens, seed=11, question_tokens=0)
    qt = args.question_tokens
    questions = long_doc_prompts(REQUESTS + 1, 0, seed=12, question_tokens=qt)
    prompts = [prefix + q for q in questions[:REQUESTS]]
    warm = prefix + questions[REQUESTS]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    max_len = prefix_tokens + args.question_tokens + 2 * BLOCK
    # Room for the whole burst in the engine's cache: a stall here is kvferry's, not a
    # lack of engine blocks.
    engine_blocks = REQUESTS * (max_len // BLOCK + 1) + args.prefix_blocks

    def ask(llm: Any, batch: list[list[int]]) -> list[Any]:
        return list(
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
        )

    def ttft_ms(out: Any) -> float:
        return float(out.metrics.first_token_latency) * 1e3

    def loaded(out: Any) -> int:
        return int(((out.kv_transfer_params or {}).get("kvferry") or {}).get("tokens_loaded", 0))

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(os.path.join(tmp, "model")))
        llm = LLM(
            **engine_args(
                model,
                kvferry={"cpu_bytes_to_use": 256 << 20, "traces": {"enabled": False}},
                num_gpu_blocks=engine_blocks,
                max_model_len=max_len,
                disable_log_stats=False,
            )
        )
        try:
            t0 = time.perf_counter()
            ask(llm, [warm])  # computes and stores the prefix
            # Its stores end over the next steps: step the engine until they are counted.
            for _ in range(100):
                if kvferry_metrics(llm).get("vllm:kvferry_tokens_stored", 0) >= prefix_tokens:
                    break
                ask(llm, [questions[0]])
            else:
                raise SystemExit("the prefix was never stored: no figure to report")
            for r in range(args.rounds):
                single: list[float] = []
                single_loaded = 0
                for p in prompts:
                    llm.reset_prefix_cache()
                    [out] = ask(llm, [p])
                    single.append(ttft_ms(out))
                    single_loaded += loaded(out)
                llm.reset_prefix_cache()
                before = kvferry_metrics(llm).get("vllm:kvferry_tokens_loaded", 0)
                outs = ask(llm, prompts)
                counted = kvferry_metrics(llm).get("vllm:kvferry_tokens_loaded", 0) - before
                burst = [ttft_ms(o) for o in outs]
                burst_loaded = sum(loaded(o) for o in outs)
                # The same burst with the prefix resident in vLLM's own cache (it is, after
                # the burst) and new questions: the batch's own compute, nothing to load.
                fresh = long_doc_prompts(REQUESTS, 0, seed=100 + r, question_tokens=qt)
                resident = [ttft_ms(o) for o in ask(llm, [prefix + q for q in fresh])]
                rows.append(
                    {
                        "round": r,
                        "single_p50": statistics.median(single),
                        "single_p99": percentile(single, 99),
                        "burst_p50": statistics.median(burst),
                        "burst_p99": percentile(burst, 99),
                        "resident_p50": statistics.median(resident),
                        "resident_p99": percentile(resident, 99),
                        "single_loaded": single_loaded,
                        "burst_loaded": burst_loaded,
                        "burst_loaded_counter": int(counted),
                    }
                )
            took = time.perf_counter() - t0
        finally:
            close_engine(llm)

    print(
        f"shared-prefix burst: {REQUESTS} requests, prefix {prefix_tokens} tokens held only in "
        f"kvferry's host tier, question {args.question_tokens} tokens, {args.rounds} round(s), "
        f"{took:.1f} s"
    )
    head = (
        f"{'round':>5} {'single p50':>10} {'single p99':>10} {'burst p50':>9} {'burst p99':>9}"
        f" {'resident p50':>12} {'resident p99':>12} {'loaded single':>13} {'loaded burst':>12}"
    )
    print(head)
    print("-" * len(head))
    print("TTFT in ms; loaded: prompt tokens kvferry loaded in the round's single requests / burst")
    for row in rows:
        print(
            f"{row['round']:>5} {row['single_p50']:>10.1f} {row['single_p99']:>10.1f} "
            f"{row['burst_p50']:>9.1f} {row['burst_p99']:>9.1f} {row['resident_p50']:>12.1f} "
            f"{row['resident_p99']:>12.1f} {row['single_loaded']:>13} "
            f"{row['burst_loaded']:>12}"
        )

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    loaded_twice = any(
        r["burst_loaded"] > prefix_tokens or r["burst_loaded_counter"] > prefix_tokens for r in rows
    )
    figures = {
        "shared_prefix_burst_ttft_p99_vs_single": round(med("burst_p99") / med("single_p99"), 3),
        "shared_prefix_burst_ttft_p50_vs_single": round(med("burst_p50") / med("single_p50"), 3),
        "shared_prefix_burst_ttft_p99_vs_resident_burst": round(
            med("burst_p99") / med("resident_p99"), 3
        ),
        "resident_burst_ttft_ms_p99": round(med("resident_p99"), 2),
        "single_ttft_ms_p50": round(med("single_p50"), 2),
        "single_ttft_ms_p99": round(med("single_p99"), 2),
        "burst_ttft_ms_p50": round(med("burst_p50"), 2),
        "burst_ttft_ms_p99": round(med("burst_p99"), 2),
        "prefix_tokens": prefix_tokens,
        "burst_tokens_loaded": [r["burst_loaded"] for r in rows],
        "burst_tokens_loaded_counter": [r["burst_loaded_counter"] for r in rows],
        "single_tokens_loaded": [r["single_loaded"] for r in rows],
        "loaded_twice": loaded_twice,
        "rounds": args.rounds,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
