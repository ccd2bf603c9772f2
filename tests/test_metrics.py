"""The one table of metric names (``kvferry/_metrics.py``): what it refuses."""

from __future__ import annotations

import pytest

from kvferry._metrics import (
    BY_FULL_NAME,
    METRICS,
    UNKNOWN_METRICS,
    MetricSink,
    UnknownMetricError,
    counter_values,
    gauge_values,
    metric,
)


def test_names_are_unique_and_prefixed() -> None:
    names = [m.full_name for m in METRICS]
    assert len(names) == len(set(names))
    assert all(n.startswith("vllm:kvferry_") for n in names)
    assert set(BY_FULL_NAME) == set(names)


def test_counter_samples_end_in_total_and_gauges_do_not() -> None:
    assert metric("vllm:kvferry_tokens_loaded").sample_name == "vllm:kvferry_tokens_loaded_total"
    assert metric("vllm:kvferry_host_usage_ratio").sample_name == "vllm:kvferry_host_usage_ratio"


def test_a_reported_value_with_an_unknown_name_raises() -> None:
    assert counter_values(tokens_hit=3) == {"vllm:kvferry_tokens_hit": 3}
    with pytest.raises(UnknownMetricError, match="tokens_hits"):
        counter_values(tokens_hits=3)
    with pytest.raises(UnknownMetricError):
        metric("vllm:kvferry_nope")


def test_a_gauge_reported_as_a_counter_raises() -> None:
    assert gauge_values(host_blocks_used=1) == {"vllm:kvferry_host_blocks_used": 1}
    with pytest.raises(UnknownMetricError):
        counter_values(host_blocks_used=1)
    with pytest.raises(UnknownMetricError):
        gauge_values(tokens_hit=1)


def test_the_sink_drops_counts_and_names_each_unknown_name_once() -> None:
    sink = MetricSink()
    payload = {
        "counters": {"vllm:kvferry_tokens_hit": 5.0, "vllm:kvferry_typo": 1.0},
        "gauges": {"vllm:kvferry_host_blocks_used": 7.0, "vllm:kvferry_tokens_hit": 2.0},
    }
    counters, gauges, new = sink.sort(payload)
    assert [(m.name, v) for m, v in counters] == [("tokens_hit", 5.0)]
    assert [(m.name, v) for m, v in gauges] == [("host_blocks_used", 7.0)]
    assert new == ["vllm:kvferry_typo", "vllm:kvferry_tokens_hit"]
    assert sink.unknown == 2
    _, _, new = sink.sort(payload)
    assert new == [] and sink.unknown == 4


def test_the_sinks_own_counter_cannot_be_reported_from_outside() -> None:
    counters, _, new = MetricSink().sort({"counters": {UNKNOWN_METRICS: 9.0}})
    assert counters == [] and new == [UNKNOWN_METRICS]
