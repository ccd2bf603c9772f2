"""benchmarks/bookkeeping.py still runs against the directory (a tiny trace, no vLLM)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bookkeeping.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bookkeeping", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_trace_is_seeded(bench: ModuleType) -> None:
    assert bench.make_trace(requests=50, docs=20) == bench.make_trace(requests=50, docs=20)
    assert bench.make_trace(seed=1, requests=50, docs=20) != bench.make_trace(requests=50, docs=20)


@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo"])
def test_every_policy_replays_the_trace(bench: ModuleType, policy: str) -> None:
    trace, distinct = bench.make_trace(requests=300, docs=40)
    hit_rate, _ = bench.replay(bench.KVFerryDriver(int(0.3 * distinct), policy), trace, 8)
    assert 0.05 < hit_rate < 1


@pytest.mark.parametrize("watermarks", [(1.0, 1.0), (0.97, 0.99)])
def test_the_scaling_run_evicts_what_it_stores(
    bench: ModuleType, watermarks: tuple[float, float]
) -> None:
    r = bench.scaling_run(2_000, "arc", watermarks, seed=1, requests=30, segments=1)
    assert r["evicted"] >= 30 * 64 - 2_000 * 0.03 and r["evict_us_per_key"] > 0
    assert r["hit_rate"] == pytest.approx(32 / 96, abs=0.05)
