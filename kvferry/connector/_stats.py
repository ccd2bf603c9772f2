"""kvferry's stats in vLLM's channels: ``get_kv_connector_stats`` and Prometheus.

The scheduler half returns, once per engine step, the counters' increments since its
last report plus current gauges (:class:`KVFerryStats`); vLLM aggregates them over its
logging interval and hands the dict to :class:`KVFerryPromMetrics`, which exports them on
``/metrics`` under ``vllm:kvferry_*`` names. Every name comes from the one table in
``kvferry/_metrics.py``.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from .._logging import get_logger
from .._metrics import COUNTERS, GAUGES, UNKNOWN_METRICS, MetricSink


class KVFerryStats(KVConnectorStats):
    """``data = {"counters": {name: increment}, "gauges": {name: value}}``."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data=data if data is not None else {"counters": {}, "gauges": {}})
        self.data.setdefault("counters", {})
        self.data.setdefault("gauges", {})

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        counters = dict(self.data["counters"])
        for k, v in other.data.get("counters", {}).items():
            counters[k] = counters.get(k, 0) + v
        gauges = {**self.data["gauges"], **other.data.get("gauges", {})}
        return KVFerryStats({"counters": counters, "gauges": gauges})

    def reduce(self) -> dict[str, int | float]:
        return {**self.data["counters"], **self.data["gauges"]}

    def is_empty(self) -> bool:
        return not any(self.data["counters"].values()) and not self.data["gauges"]


class KVFerryPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM's classes for each kind (its own multiprocess-aware ones in the API
        # server), the same the base class keeps; typed as any of its metric classes.
        counter_cls: Any = metric_types[Counter]
        gauge_cls: Any = metric_types[Gauge]
        self._counters = {
            m.full_name: self._per_engine(
                counter_cls(name=m.full_name, documentation=m.help, labelnames=labelnames)
            )
            for m in COUNTERS
        }
        self._gauges = {
            m.full_name: self._per_engine(
                gauge_cls(
                    name=m.full_name,
                    documentation=m.help,
                    labelnames=labelnames,
                    multiprocess_mode="mostrecent",
                )
            )
            for m in GAUGES
        }
        self._sink = MetricSink()
        self._log = get_logger("kvferry.connector", role="metrics")

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Export one logging interval's stats. A name that is not in kvferry's table is a
        kvferry bug: it is logged once and counted in ``vllm:kvferry_unknown_metrics``,
        never raised, as this runs in vLLM's API server while it serves requests."""
        dropped_before = self._sink.unknown
        counters, gauges, new_unknown = self._sink.sort(transfer_stats_data)
        for name in new_unknown:
            self._log.error("unknown_metric_dropped", metric=name)
        for m, value in counters:
            if value:
                self._counters[m.full_name][engine_idx].inc(value)
        for m, value in gauges:
            self._gauges[m.full_name][engine_idx].set(value)
        if self._sink.unknown > dropped_before:
            self._counters[UNKNOWN_METRICS][engine_idx].inc(self._sink.unknown - dropped_before)
