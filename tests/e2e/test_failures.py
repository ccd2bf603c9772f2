"""Injected copy failures, end to end on vLLM (CPU): a failed load is reported as invalid
blocks and recomputed, a failed store never becomes a hit, and outputs stay equal to
outputs without kvferry. A negative control garbles loads and reports them as fine:
then outputs differ, which shows the comparison catches bad KV.

The faults come from a copy engine plugged in through the ``copy_engine`` config key
(kvferry.transfer._testing wraps the real engine and damages chosen jobs after they ran).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvferry.testing import (
    close_engine,
    engine_args,
    kvferry_metrics,
    long_doc_prompts,
    reask_order,
    run_long_doc_passes,
)

pytestmark = pytest.mark.e2e

NUM_DOCS, DOC_TOKENS = 6, 1000


def run(model: Path, kvferry: dict[str, Any] | None) -> dict[str, Any]:
    from vllm import LLM

    llm = LLM(**engine_args(model, kvferry=kvferry, disable_log_stats=False))
    docs = long_doc_prompts(NUM_DOCS, DOC_TOKENS, seed=31)
    results = run_long_doc_passes(llm, docs, [list(range(NUM_DOCS)), reask_order(NUM_DOCS)])
    metrics = kvferry_metrics(llm)
    close_engine(llm)
    return {
        "tokens": [r.tokens for r in results],
        "loaded": [r.loaded for r in results],
        "metrics": metrics,
    }


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> dict[str, Any]:
    return run(tiny_model, None)


def test_failed_loads_are_recomputed_and_failed_stores_never_hit(
    tiny_model: Path, reference: dict[str, Any]
) -> None:
    faulty = run(
        tiny_model,
        {"cpu_bytes_to_use": 64 << 20, "copy_engine": "kvferry.testing:fail_loads_and_stores"},
    )
    assert faulty["tokens"] == reference["tokens"]
    m = faulty["metrics"]
    assert m["vllm:kvferry_loads_failed"] > 0
    assert m["vllm:kvferry_stores_failed"] > 0
    # loads that did not fail still served tokens from host memory
    assert m["vllm:kvferry_tokens_loaded"] > 0


def test_negative_control_garbled_loads_change_outputs(
    tiny_model: Path, reference: dict[str, Any]
) -> None:
    corrupt = run(
        tiny_model,
        {
            "cpu_bytes_to_use": 64 << 20,
            "copy_engine": "kvferry.transfer._testing:corrupt_every_load",
        },
    )
    assert sum(corrupt["loaded"][1].values()) > 0
    assert corrupt["tokens"][0] == reference["tokens"][0]  # pass 1 loads nothing
    assert corrupt["tokens"][1] != reference["tokens"][1]
