"""KVFerryConnector: the vLLM adapter.

vLLM builds it twice: a SCHEDULER instance in the engine-core process and a WORKER
instance in each worker process (see docs/architecture.md). Every call is synchronous and
on the engine thread; each half forwards to :class:`SchedulerSide` or :class:`WorkerSide`.
A bad configuration raises :class:`~kvferry.ConfigError` here, at engine start.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import vllm
from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .._config import FerryConfig
from .._logging import get_logger
from ._metadata import KVFerryMetadata
from ._report import SchedulerStatistics
from ._scheduler import SchedulerSide
from ._stats import KVFerryPromMetrics, KVFerryStats
from ._versions import check_vllm_version
from ._worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def _ours(meta: KVConnectorMetadata | None) -> KVFerryMetadata:
    if not isinstance(meta, KVFerryMetadata):
        raise TypeError(f"kvferry's worker half was given {type(meta).__name__} as metadata")
    return meta


# vLLM's own default for ``kv_load_failure_policy``: a value other than this one was set by
# the user, who is told when kvferry replaces it.
_VLLM_LOAD_FAILURE_DEFAULT = "fail"


def _set_load_failure_policy(transfer_config: Any, policy: str) -> None:
    """Set vLLM's ``kv_load_failure_policy`` from kvferry's ``on_load_failure``, saying so.

    vLLM keeps no record of which fields were given, so a value other than its default was
    set by the user and replacing it is a warning; replacing the default is only noted.
    """
    before = transfer_config.kv_load_failure_policy
    transfer_config.kv_load_failure_policy = policy
    if before == policy:
        return
    log = get_logger("kvferry.connector", role="scheduler")
    emit = log.info if before == _VLLM_LOAD_FAILURE_DEFAULT else log.warning
    emit(
        "kv_load_failure_policy_replaced",
        was=before,
        now=policy,
        reason="kvferry sets it from kv_connector_extra_config.on_load_failure",
    )


class KVFerryConnector(KVConnectorBase_V1, SupportsHMA):
    """Offloads KV blocks to host memory and loads them back on a prefix hit.

    Enable with ``KVTransferConfig(kv_connector="KVFerryConnector",
    kv_connector_module_path="kvferry.connector", kv_role="kv_both",
    kv_connector_extra_config={"cpu_bytes_to_use": ...})``.
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        check_vllm_version(vllm.__version__)
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        if kv_cache_config is None:
            raise ValueError("KVFerryConnector needs vLLM's kv_cache_config")
        # The base class checked that it is set; this is the object it keeps.
        transfer_config = vllm_config.kv_transfer_config
        if transfer_config is None:
            raise ValueError("KVFerryConnector needs vLLM's kv_transfer_config")
        cfg = FerryConfig.from_dict(transfer_config.kv_connector_extra_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._meta: KVFerryMetadata | None = None  # this step's, bound by the model runner
        if role == KVConnectorRole.SCHEDULER:
            # A failed load is a cache miss: by default vLLM recomputes its blocks. The
            # scheduler reads this (a documented field of KVTransferConfig) right after
            # building its connector.
            _set_load_failure_policy(transfer_config, cfg.on_load_failure)
            self._scheduler = SchedulerSide(vllm_config, kv_cache_config, cfg)
        else:
            self._worker = WorkerSide(vllm_config, kv_cache_config, cfg)

    @property
    def _sched(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side call on kvferry's worker-side connector")
        return self._scheduler

    @property
    def _work(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker-side call on kvferry's scheduler-side connector")
        return self._worker

    @property
    @override
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped store is only a future miss

    # ==============================  worker side  ==============================

    @override
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Called by the model runner before each forward pass: this step's jobs."""
        super().bind_connector_metadata(connector_metadata)
        self._meta = _ours(connector_metadata)

    @override
    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._meta = None

    @override
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work.register_kv_caches(kv_caches)

    @override
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._work.handle_preemptions(_ours(kv_connector_metadata))

    @override
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._work.start_load_kv(_ours(self._meta))

    @override
    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: a request runs only once its load ended

    @override
    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # stores are per step, in wait_for_save

    @override
    def wait_for_save(self) -> None:
        self._work.wait_for_save(_ours(self._meta))

    @override
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._work.get_finished()

    @override
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # A failed load of a model with several KV-cache groups is reported per request:
        # vLLM refuses invalid block ids there (they are only unique within a group).
        sending, recving = self._work.get_finished()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=self._work.take_failed_recving(),
        )

    @override
    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work.get_block_ids_with_load_errors()

    @override
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._work.build_worker_meta()

    # ==============================  scheduler side  ==============================

    @override
    def on_new_request(self, request: Request) -> None:
        self._sched.on_new_request(request)

    @override
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    @override
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    @override
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched.build_connector_meta(scheduler_output)

    @override
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched.update_connector_output(connector_output)

    @override
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request, (block_ids,))

    @override
    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request, block_ids)

    @override
    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_work()

    @override
    def take_events(self) -> Iterable[Any]:
        return () if self._scheduler is None else self._scheduler.take_events()

    @override
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._scheduler is None:
            return None  # the workers' transfer counters travel in their worker metadata
        data = self._scheduler.kv_connector_stats()
        return None if data is None else KVFerryStats(data)

    @classmethod
    @override
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVFerryStats(data)

    @classmethod
    @override
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVFerryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @override
    def reset_cache(self) -> bool | None:
        return self._sched.reset()

    def statistics(self) -> SchedulerStatistics:
        """kvferry's scheduler-side counters (scheduler role only)."""
        return self._sched.statistics()

    @override
    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
