"""kvferry's stats in vLLM's channels: ``get_kv_connector_stats`` and Prometheus.

The scheduler half returns, once per engine step, the counters' increments since its
last report plus current gauges (:class:`KVFerryStats`); vLLM aggregates them over its
logging interval and hands the dict to :class:`KVFerryPromMetrics`, which exports them on
``/metrics`` under ``vllm:kvferry_*`` names.
"""

from __future__ import annotations

from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

COUNTERS: dict[str, str] = {
    "vllm:kvferry_tokens_looked_up": "Prompt tokens beyond the engine's own cache that kvferry was asked for.",
    "vllm:kvferry_tokens_hit": "Tokens found in kvferry's host tier (lookup hits).",
    "vllm:kvferry_tokens_missed": "Tokens asked for that kvferry did not hold.",
    "vllm:kvferry_tokens_loaded": "Tokens loaded from host memory into the engine's KV cache.",
    "vllm:kvferry_tokens_stored": "Tokens stored from the engine's KV cache into host memory.",
    "vllm:kvferry_load_bytes": "Bytes copied host -> device.",
    "vllm:kvferry_store_bytes": "Bytes copied device -> host.",
    "vllm:kvferry_load_seconds": "Seconds spent in host -> device copies.",
    "vllm:kvferry_store_seconds": "Seconds spent in device -> host copies.",
    "vllm:kvferry_loads_failed": "Load jobs that failed (their blocks were recomputed).",
    "vllm:kvferry_stores_failed": "Store jobs that failed (their blocks were dropped).",
    "vllm:kvferry_stores_fenced": (
        "Store jobs still reading blocks the engine reused (a preemption, a sliding window "
        "moving on): the engine's next compute was ordered after them."
    ),
    "vllm:kvferry_lookups_deferred": (
        "Lookups answered 'ask again' because another request was loading the same blocks."
    ),
    "vllm:kvferry_stores_skipped": "Offloaded blocks not stored (already stored, or no room).",
    "vllm:kvferry_evictions": "Offloaded blocks evicted from host memory.",
}
GAUGES: dict[str, str] = {
    "vllm:kvferry_host_blocks_used": "Offloaded blocks held in host memory (ready or being stored).",
    "vllm:kvferry_host_blocks_capacity": "Offloaded blocks host memory can hold.",
    "vllm:kvferry_host_usage_ratio": "Share of kvferry's host memory in use.",
}


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
        self._counters = {
            name: self._per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            )
            for name, doc in COUNTERS.items()
        }
        self._gauges = {
            name: self._per_engine(
                self._gauge_cls(
                    name=name,
                    documentation=doc,
                    labelnames=labelnames,
                    multiprocess_mode="mostrecent",
                )
            )
            for name, doc in GAUGES.items()
        }

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.get("counters", {}).items():
            if name in self._counters and value:
                self._counters[name][engine_idx].inc(value)
        for name, value in transfer_stats_data.get("gauges", {}).items():
            if name in self._gauges:
                self._gauges[name][engine_idx].set(value)
