"""A hybrid model on real vLLM (CPU): a tiny Llama whose first layer attends through a
sliding window of 256 tokens and whose second attends to everything, so vLLM gives it two
KV-cache groups. Documents that do not fit the engine's cache are asked, then re-asked:
outputs with kvferry equal outputs without it, the re-asks load from host memory, and the
sliding-window group loads only its window.
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
    make_tiny_model,
    reask_order,
    run_long_doc_passes,
)

pytestmark = pytest.mark.e2e

NUM_DOCS, DOC_TOKENS, MAX_TOKENS = 4, 1000, 8
BLOCK, WINDOW = 128, 256
# One layer per group: 128 tokens x (K, V) x 2 KV heads x 64 x 2 bytes (bf16).
GROUP_BLOCK_BYTES = BLOCK * 2 * 2 * 64 * 2


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-hybrid"),
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=WINDOW,
    )


def run(model: Path, kvferry: dict[str, Any] | None) -> dict[str, Any]:
    from vllm import LLM

    llm = LLM(
        **engine_args(
            model,
            kvferry=kvferry,
            num_gpu_blocks=24,
            max_model_len=1280,
            disable_log_stats=False,
            enforce_eager=True,  # tests/e2e/conftest.py
        )
    )
    try:
        docs = long_doc_prompts(NUM_DOCS, DOC_TOKENS)
        orders = [list(range(NUM_DOCS)), reask_order(NUM_DOCS)]
        results = run_long_doc_passes(llm, docs, orders, max_tokens=MAX_TOKENS)
        metrics = kvferry_metrics(llm)
    finally:
        close_engine(llm)
    return {"results": results, "metrics": metrics}


@pytest.fixture(scope="module")
def baseline(hybrid_model: Path) -> dict[str, Any]:
    return run(hybrid_model, None)


@pytest.fixture(scope="module")
def with_kvferry(hybrid_model: Path, baseline: dict[str, Any]) -> dict[str, Any]:
    # Created after the baseline's engine: vLLM's metrics registry shows the last engine.
    return run(hybrid_model, {"cpu_bytes_to_use": 64 << 20})


def test_outputs_equal_outputs_without_kvferry(
    baseline: dict[str, Any], with_kvferry: dict[str, Any]
) -> None:
    for p in range(2):
        assert with_kvferry["results"][p].tokens == baseline["results"][p].tokens, p
    # The comparison has teeth: different documents give different answers.
    assert len({tuple(t) for t in baseline["results"][0].tokens.values()}) == NUM_DOCS


def test_re_asks_load_from_host_memory(with_kvferry: dict[str, Any]) -> None:
    first, second = with_kvferry["results"]
    assert sum(first.loaded.values()) == 0
    full = (DOC_TOKENS + 8) // BLOCK * BLOCK
    for d in range(NUM_DOCS):
        # Each offloaded block is on the device or loaded, never recomputed.
        assert second.cached[d] == full, (d, second.cached[d])
    assert sum(second.loaded.values()) >= (NUM_DOCS - 1) * full


def test_the_sliding_window_group_loads_only_its_window(with_kvferry: dict[str, Any]) -> None:
    second = with_kvferry["results"][1]
    full_blocks = (DOC_TOKENS + 8) // BLOCK
    # vLLM keeps the blocks holding the last WINDOW - 1 tokens before the first new one.
    first_in_window = (full_blocks * BLOCK - WINDOW + 1) // BLOCK
    expected = 0
    for d in range(NUM_DOCS):
        loaded = second.loaded[d] // BLOCK
        first = full_blocks - loaded
        expected += loaded + (full_blocks - max(first, first_in_window) if loaded else 0)
    assert expected > 0
    assert with_kvferry["metrics"]["vllm:kvferry_load_bytes"] == expected * GROUP_BLOCK_BYTES
    # Loading both groups whole would have moved more.
    assert expected < 2 * sum(second.loaded.values()) // BLOCK
