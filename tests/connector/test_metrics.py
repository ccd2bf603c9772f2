"""The connector's two ends of the metric table: the scheduler half reports exactly the
table's names, and the Prometheus exporter exports them and counts anything else."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvferry._metrics import COUNTERS, GAUGES, UNKNOWN_METRICS

from ._steps import scheduler_side


@pytest.fixture
def scheduler(make_vllm_config: Any, kv_cache_config: Any) -> Iterator[Any]:
    with scheduler_side(make_vllm_config, kv_cache_config) as side:
        yield side


DISK = "vllm:kvferry_disk_"
REDIS = "vllm:kvferry_redis_"


def test_the_scheduler_reports_every_name_of_the_table_and_no_other(scheduler: Any) -> None:
    first = scheduler.kv_connector_stats()
    # Counters are increments: a new connector has none; the names are still all checked.
    assert first == {"counters": {}, "gauges": first["gauges"]}
    # Without a disk or Redis tier, none of their series.
    assert set(first["gauges"]) == {m.full_name for m in GAUGES if not m.full_name.startswith(DISK)}
    reported = set(scheduler._report.reported)
    assert reported == {
        m.full_name for m in COUNTERS if not m.full_name.startswith((DISK, REDIS))
    } - {UNKNOWN_METRICS}


def test_with_a_disk_tier_the_scheduler_reports_its_series_too(
    make_vllm_config: Any, kv_cache_config: Any, tmp_path: Any
) -> None:
    tiers = [{"kind": "disk", "path": str(tmp_path), "bytes_to_use": 64 << 20}]
    with scheduler_side(make_vllm_config, kv_cache_config, tiers=tiers) as side:
        first = side.kv_connector_stats()
        assert set(first["gauges"]) == {m.full_name for m in GAUGES}
        assert first["gauges"][DISK + "blocks_used"] == 0
        assert first["gauges"][DISK + "blocks_capacity"] == side.disk.capacity > 0
        assert set(side._report.reported) == {
            m.full_name for m in COUNTERS if not m.full_name.startswith(REDIS)
        } - {UNKNOWN_METRICS}


def make_exporter(make_vllm_config: Any) -> tuple[Any, CollectorRegistry]:
    from kvferry.connector._stats import KVFerryPromMetrics

    registry = CollectorRegistry()
    types: dict[Any, Any] = {
        Gauge: functools.partial(Gauge, registry=registry),
        Counter: functools.partial(Counter, registry=registry),
        Histogram: functools.partial(Histogram, registry=registry),
    }
    config = make_vllm_config({"cpu_bytes_to_use": 1 << 20})
    exporter = KVFerryPromMetrics(config, types, ["model_name", "engine"], {0: ["tiny", "0"]})
    return exporter, registry


def test_the_exporter_exports_known_names_and_counts_unknown_ones(
    make_vllm_config: Any, caplog: pytest.LogCaptureFixture
) -> None:
    exporter, registry = make_exporter(make_vllm_config)
    labels = {"model_name": "tiny", "engine": "0"}
    payload = {
        "counters": {"vllm:kvferry_tokens_loaded": 256, "vllm:kvferry_tokens_lodaed": 128},
        "gauges": {"vllm:kvferry_host_blocks_used": 3},
    }
    with caplog.at_level(logging.ERROR, logger="kvferry.connector"):
        exporter.observe(payload)
        exporter.observe(payload)

    def sample(name: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert sample("vllm:kvferry_tokens_loaded_total") == 512
    assert sample("vllm:kvferry_host_blocks_used") == 3
    assert sample(UNKNOWN_METRICS + "_total") == 2
    logged = [r for r in caplog.records if "unknown_metric_dropped" in r.getMessage()]
    assert len(logged) == 1 and "tokens_lodaed" in logged[0].getMessage()
