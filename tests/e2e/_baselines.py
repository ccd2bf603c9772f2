"""Workloads that several modules run, so that the outputs of an engine without kvferry
are computed once per session (tests/e2e/conftest.py), not once per module: an engine
start costs ~20-60 s here.

Each module runs its engines with kvferry on exactly these documents and engine
arguments, and compares with the shared outputs, token for token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from kvferry.testing import (
    PassResult,
    close_engine,
    engine_args,
    kvferry_metrics,
    long_doc_prompts,
    reask_order,
    run_long_doc_passes,
)

EAGER = {"enforce_eager": True, "disable_log_stats": False}
"""The engine arguments (beyond engine_args') of the engines of the e2e modules started in
the tests' process: eager, as tests/e2e/conftest.py says why."""


# -- asked one at a time (tests/e2e/test_disk_tier.py, tests/e2e/test_redis_tier.py)

ALONE_DOC_TOKENS = 1000  # + 8 question tokens: 7 full blocks of 128 tokens
ALONE_DOCS = long_doc_prompts(8, ALONE_DOC_TOKENS, seed=47)
ALONE_MAX_TOKENS = 6


def alone_sampling() -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=ALONE_MAX_TOKENS, temperature=0.0, ignore_eos=True)


DISK_TOKENS_HIT = "vllm:kvferry_disk_tokens_hit"  # of the lookup hits, those read from disk
REDIS_TOKENS_HIT = "vllm:kvferry_redis_tokens_hit"  # ... those read from Redis


@attrs.frozen(kw_only=True)
class Asked:
    """One request, asked alone (tests/e2e/test_disk_tier.py, tests/e2e/test_redis_tier.py)."""

    tokens: list[int]
    params: dict[str, Any]
    """Its ``kv_transfer_params["kvferry"]``."""
    delta: dict[str, float]
    """kvferry's metrics after it minus before it."""

    @property
    def loaded(self) -> int:
        return int(self.params.get("tokens_loaded", 0))

    @property
    def from_disk(self) -> int:
        return int(self.delta.get(DISK_TOKENS_HIT, 0))

    @property
    def from_redis(self) -> int:
        return int(self.delta.get(REDIS_TOKENS_HIT, 0))


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """kvferry's metrics ``after`` minus ``before``."""
    return {k: v - before.get(k, 0) for k, v in after.items()}


def ask_alone(llm: Any, prompt: Any) -> Asked:
    """``prompt`` asked alone on ``llm`` (alone_sampling): its answer and what it cost."""
    before = kvferry_metrics(llm)
    [out] = llm.generate([prompt], alone_sampling(), use_tqdm=False)
    return Asked(
        tokens=list(out.outputs[0].token_ids),
        params=dict((out.kv_transfer_params or {}).get("kvferry") or {}),
        delta=delta(before, kvferry_metrics(llm)),
    )


def answers_alone(model: Path) -> dict[int, list[int]]:
    """Each of ALONE_DOCS asked alone on an engine without kvferry: its answer."""
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    llm = LLM(**engine_args(model, kvferry=None, **EAGER))
    try:
        answers = {}
        for doc, tokens in enumerate(ALONE_DOCS):
            [out] = llm.generate(
                [TokensPrompt(prompt_token_ids=tokens)], alone_sampling(), use_tqdm=False
            )
            answers[doc] = list(out.outputs[0].token_ids)
        return answers
    finally:
        close_engine(llm)


# -- two passes, all at once (tests/e2e/test_end_to_end.py, tests/e2e/test_failures.py)

PASS_DOC_TOKENS = 1000  # + 8 question tokens: 8 engine blocks each
PASS_DOCS = long_doc_prompts(6, PASS_DOC_TOKENS)  # 48 blocks > the engine's 24
PASS_ORDERS = [list(range(len(PASS_DOCS))), reask_order(len(PASS_DOCS))]
PASS_MAX_TOKENS = 8


@attrs.frozen(kw_only=True)
class Passes:
    results: list[PassResult]
    """The first pass (in order), then the second (another order)."""
    metrics: dict[str, Any]
    """vLLM's metrics by name (the last sample of each) after both passes."""
    kvferry: dict[str, float]
    """kvferry's metrics (kvferry.testing.kvferry_metrics) after both passes."""


def two_passes(model: Path, kvferry: dict[str, Any] | None) -> Passes:
    """PASS_DOCS asked in both orders (one ``generate`` per pass) on a fresh engine."""
    from vllm import LLM

    llm = LLM(**engine_args(model, kvferry=kvferry, **EAGER))
    try:
        results = run_long_doc_passes(llm, PASS_DOCS, PASS_ORDERS, max_tokens=PASS_MAX_TOKENS)
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        return Passes(results=results, metrics=metrics, kvferry=kvferry_metrics(llm))
    finally:
        close_engine(llm)
