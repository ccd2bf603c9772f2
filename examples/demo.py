"""`make demo`: kvferry on vLLM (CPU) with a tiny random-weight Llama, on long-document QA.

Documents that together do not fit the engine's own KV cache are asked once, then
re-asked in another order: first with vLLM's prefix caching alone, then with kvferry.
Prints the time of each pass, the tokens loaded from kvferry, and whether the outputs
(greedy token ids) matched.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from typing import Any

NUM_DOCS, DOC_TOKENS, ENGINE_BLOCKS = 10, 1500, 32  # 12 blocks of 128 tokens per document


def run(model: str, kvferry: dict[str, Any] | None, docs: list[list[int]], orders: list[list[int]]) -> Any:
    from vllm import LLM

    from kvferry.testing import close_engine, engine_args, run_long_doc_passes

    llm = LLM(**engine_args(model, kvferry=kvferry, num_gpu_blocks=ENGINE_BLOCKS))
    run_long_doc_passes(llm, docs[:1], [[0]])  # warm-up, so pass 1 times no compilation
    llm.reset_prefix_cache()
    results = run_long_doc_passes(llm, docs, orders)
    close_engine(llm)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=NUM_DOCS)
    parser.add_argument("--doc-tokens", type=int, default=DOC_TOKENS)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    logging.getLogger("vllm").setLevel(logging.WARNING)

    from kvferry.testing import equal_cpu_threads, long_doc_prompts, make_tiny_model, reask_order

    equal_cpu_threads()  # else vLLM-CPU gives the engine with kvferry one more core

    docs = long_doc_prompts(args.docs, args.doc_tokens)
    orders = [list(range(args.docs)), reask_order(args.docs)]
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(tmp))
        plain = run(model, None, docs, orders)
        ferry = run(model, {"cpu_bytes_to_use": 256 << 20}, docs, orders)

    matched = all(p.tokens == f.tokens for p, f in zip(plain, ferry, strict=True))
    rows = [
        ("prefix caching alone", plain),
        ("prefix caching + kvferry", ferry),
    ]
    print()
    print(f"long-document QA: {args.docs} documents x {args.doc_tokens} tokens, "
          f"engine cache {ENGINE_BLOCKS} blocks x 128 tokens, asked twice")
    print(f"{'configuration':<26} {'pass 1 (s)':>10} {'pass 2 (s)':>10} {'tokens loaded':>14} {'cached in pass 2':>17}")
    for name, res in rows:
        print(
            f"{name:<26} {res[0].seconds:>10.2f} {res[1].seconds:>10.2f} "
            f"{sum(res[1].loaded.values()):>14} {sum(res[1].cached.values()):>17}"
        )
    print(f"outputs matched (greedy token ids, every request, both passes): {matched}")
    if not matched:
        raise SystemExit("outputs differ with kvferry")


if __name__ == "__main__":
    main()
