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

from tests.e2e._baselines import Passes, two_passes

pytestmark = pytest.mark.e2e


def run(model: Path, kvferry: dict[str, Any] | None) -> dict[str, Any]:
    return as_dict(two_passes(model, kvferry))


def as_dict(passes: Passes) -> dict[str, Any]:
    return {
        "tokens": [r.tokens for r in passes.results],
        "loaded": [r.loaded for r in passes.results],
        "metrics": passes.kvferry,
    }


@pytest.fixture(scope="module")
def reference(two_passes_without_kvferry: Passes) -> dict[str, Any]:
    """Without kvferry (tests/e2e/conftest.py: one engine for this module and test_end_to_end)."""
    return as_dict(two_passes_without_kvferry)


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
    # every one a failed copy (the engine's), counted by that cause in vLLM's metrics too
    assert m["vllm:kvferry_loads_failed_copy"] == m["vllm:kvferry_loads_failed"]
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


def test_loads_that_always_fail_end_in_recomputation(
    tiny_model: Path, reference: dict[str, Any]
) -> None:
    """Every load fails: a request whose load failed is recomputed, not loaded again
    (vLLM schedules a request left with no valid prefix again from nothing, and a hit
    planned again at every retry would never let it end)."""
    faulty = run(
        tiny_model, {"cpu_bytes_to_use": 64 << 20, "copy_engine": "kvferry.testing:fail_every_load"}
    )
    assert faulty["tokens"] == reference["tokens"]
    m = faulty["metrics"]
    assert m["vllm:kvferry_loads_failed"] > 0
    assert m["vllm:kvferry_tokens_loaded"] == 0
