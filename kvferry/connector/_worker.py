"""The worker half of the connector: runs this step's jobs and reports what ended.

Who owns what: vLLM calls these methods on the worker process's engine thread. The
:class:`~kvferry.transfer.StoreActor` and :class:`~kvferry.transfer.LoadActor` own the
copy engine's completions; this object owns the bookkeeping of which request waits on
which job. One runtime call per vLLM call.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import attrs

from .. import traces
from .._config import FerryConfig, load_object
from .._errors import TransferError
from .._logging import get_logger
from ..actors import ActorRef, ActorSystem, SyncRuntime, start_runtime
from ..transfer import (
    CopyJob,
    Flushed,
    FlushJobs,
    HostPool,
    JobFailed,
    JobResult,
    LoadActor,
    PollFinished,
    StoreActor,
    SubmitJobs,
    TransferMsg,
    capture_compute,
    describe_kv_caches,
    new_copy_engine,
)
from ._metadata import JobSpec, KVFerryMetadata, KVFerryWorkerMetadata
from ._scheduler import Geometry, plan_geometry

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@attrs.frozen
class _Refs:
    store: ActorRef[TransferMsg]
    load: ActorRef[TransferMsg]


class WorkerSide:
    def __init__(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cfg: FerryConfig
    ) -> None:
        self.cfg = cfg
        self.kv_cache_config = kv_cache_config
        self.geometry: Geometry = plan_geometry(
            cfg,
            kv_cache_config,
            vllm_config.cache_config.block_size,
            vllm_config.parallel_config.world_size,
        )
        self._log = get_logger("kvferry.connector", role="worker")
        self.pool: HostPool | None = None
        self._refs: _Refs | None = None
        self.runtime: SyncRuntime | None = None
        self._load_req: dict[int, tuple[str, list[int]]] = {}
        self._store_req: dict[int, str] = {}
        self._stores_of: dict[str, set[int]] = {}
        self._releasing: set[str] = set()
        self._load_errors: set[int] = set()
        self._failed_recving: set[str] = set()
        """Requests whose load failed, for a model of several KV-cache groups (vLLM takes
        invalid block ids only for one group: block ids are per group)."""
        self._planned_failures: list[JobResult] = []
        self._failed_loads: set[int] = set()
        """Loads the scheduler ended at their deadline: reported failed when they end."""
        self._acks: dict[int, list[int]] = {}
        self._provider = traces.setup(cfg.traces, role="worker")
        self.trace = traces.WorkerTracer(self._provider, rank=vllm_config.parallel_config.rank)
        self._traceparents: dict[int, tuple[str, int]] = {}
        self._stats: dict[str, float] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        kcc = self.kv_cache_config
        tensors = getattr(kcc, "kv_cache_tensors", None) or []
        block_stride = getattr(tensors[0], "block_stride", None) if tensors else None
        layout = describe_kv_caches(
            kv_caches,
            [g.layer_names for g in kcc.kv_cache_groups],
            kcc.num_blocks,
            block_stride,
        )
        geo = self.geometry
        if layout.row_bytes > geo.row_bytes:
            raise TransferError(
                f"the KV tensors hold {layout.row_bytes} bytes per block, more than the "
                f"{geo.row_bytes} vLLM's KV-cache config announces"
            )
        self.pool = HostPool(
            geo.num_slots, geo.blocks_per_chunk, layout.row_bytes, pin=layout.device.type == "cuda"
        )
        if self.cfg.copy_engine is not None:
            factory = load_object("copy_engine", self.cfg.copy_engine)
            engine = factory(layout, self.pool)
        else:
            engine = new_copy_engine(layout, self.pool)

        async def setup(system: ActorSystem) -> _Refs:
            load = await system.spawn(
                LoadActor(engine, job_timeout_s=self.cfg.job_timeout_s), name="load"
            )
            store = await system.spawn(
                StoreActor(engine, job_timeout_s=self.cfg.job_timeout_s), name="store"
            )
            return _Refs(store=store, load=load)

        self.runtime, self._refs = start_runtime(self.cfg.runtime, setup)
        self._engine = engine
        self._log.info(
            "worker_started",
            host_pool_bytes=self.pool.nbytes,
            layout_segments=sum(len(g.segments) for g in layout.groups),
            runtime=type(self.runtime).__name__,
        )

    def handle_preemptions(self, meta: KVFerryMetadata) -> None:
        """Stores still reading blocks the engine will reuse are ordered before this step's
        forward: on CUDA the compute stream waits on their events (no CPU wait); on the
        copy threads they are waited for until they end."""
        if not meta.flush_job_ids or self._refs is None:
            return
        pending = tuple(j for j in meta.flush_job_ids if j in self._store_req)
        if not pending:
            return
        refs = self._refs
        # The compute stream to fence is this thread's (vLLM's model thread), whatever
        # thread runs the actors.
        mark = capture_compute(self._engine)
        try:
            flushed: Flushed = self.runtime.call(  # type: ignore[union-attr]
                refs.store.ask,
                lambda r: FlushJobs(
                    job_ids=pending, timeout_s=self.cfg.job_timeout_s, reply=r, compute=mark
                ),
            )
        except TimeoutError as exc:
            raise TransferError(
                f"stores {pending} did not end within job_timeout_s={self.cfg.job_timeout_s}"
            ) from exc
        self._log.debug(
            "stores_flushed",
            device_fenced=len(flushed.device_fenced),
            cpu_waited=len(flushed.cpu_waited),
            already_ended=len(flushed.already_ended),
        )

    def start_load_kv(self, meta: KVFerryMetadata) -> None:
        # Before any of this step's stores is submitted (wait_for_save): a store may now
        # write into the host slots these loads read.
        failed = meta.failed_load_job_ids
        if failed:
            self._failed_loads.update(j for j in failed if j in self._load_req)
        if not meta.loads or self._refs is None:
            return
        jobs = []
        for spec in meta.loads:
            blocks = [int(b) for p in spec.copy.parts for b in p.device_blocks]
            self._load_req[spec.copy.job_id] = (spec.req_id, blocks)
            if failed and spec.copy.job_id in failed:
                # Planned failed (the scheduler could not plan it): nothing to copy; its
                # blocks are reported invalid by the next get_finished.
                self._planned_failures.append(
                    JobFailed(
                        job_id=spec.copy.job_id,
                        direction="load",
                        error="failed by the scheduler",
                        block_ids=tuple(blocks),
                        reason="rejected",
                    )
                )
            else:
                jobs.append(spec.copy)
        self._remember_traces(meta.loads)
        if jobs:
            self._submit(self._refs.load, jobs)

    def wait_for_save(self, meta: KVFerryMetadata) -> None:
        if self._refs is None:
            return
        for spec in meta.stores:
            self._store_req[spec.copy.job_id] = spec.req_id
            self._stores_of.setdefault(spec.req_id, set()).add(spec.copy.job_id)
        self._releasing.update(meta.release_req_ids)
        self._remember_traces(meta.stores)
        if meta.stores:
            self._submit(self._refs.store, [s.copy for s in meta.stores])

    def _remember_traces(self, specs: list[JobSpec]) -> None:
        if not self.trace.enabled:
            return
        now = time.time_ns()
        for spec in specs:
            if spec.traceparent is not None:
                self._traceparents[spec.copy.job_id] = (spec.traceparent, now)

    def _submit(self, ref: ActorRef[TransferMsg], jobs: list[CopyJob]) -> None:
        """The step's jobs of one direction as one batch, ordered after the compute
        enqueued so far on this thread's stream (vLLM's model thread: its compute
        stream), whichever thread runs the actors."""
        msg = SubmitJobs(jobs=tuple(jobs), compute=capture_compute(self._engine))
        self.runtime.call(ref.tell, msg)  # type: ignore[union-attr]

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        if self._refs is None:
            return None, None
        results: list[JobResult] = self.runtime.call(self._poll, self._refs)  # type: ignore[union-attr]
        if self._planned_failures:
            results = self._planned_failures + results
            self._planned_failures = []
        finished_recving: set[str] = set()
        now = time.time_ns()
        for res in results:
            traced = self._traceparents.pop(res.job_id, None)
            if traced is not None:
                # The copy's own duration, ending when this poll saw it end.
                self.trace.record_copy(
                    traced[0],
                    job_id=res.job_id,
                    direction=res.direction,
                    nbytes=res.nbytes,
                    blocks=res.num_blocks,
                    start_ns=now - int(res.seconds * 1e9),
                    end_ns=now,
                    ok=res.ok,
                    error=res.error,
                    queued_ns=traced[1],
                )
            ok = res.ok
            if res.job_id in self._failed_loads:
                self._failed_loads.discard(res.job_id)
                ok = False
            ack = self._acks.setdefault(res.job_id, [0, 0])
            ack[0] += 1
            ack[1] += 0 if ok else 1
            key = res.direction
            self._stats[f"{key}_bytes"] = self._stats.get(f"{key}_bytes", 0.0) + res.nbytes
            self._stats[f"{key}_seconds"] = self._stats.get(f"{key}_seconds", 0.0) + res.seconds
            if res.direction == "load":
                req_id, blocks = self._load_req.pop(res.job_id)
                finished_recving.add(req_id)
                if not ok:
                    if self.geometry.num_groups > 1:
                        self._failed_recving.add(req_id)
                    else:
                        self._load_errors.update(blocks)
            else:
                req_id = self._store_req.pop(res.job_id)
                jobs = self._stores_of.get(req_id)
                if jobs is not None:
                    jobs.discard(res.job_id)
                    if not jobs:
                        del self._stores_of[req_id]
        finished_sending = {r for r in self._releasing if r not in self._stores_of}
        self._releasing -= finished_sending
        return finished_sending or None, finished_recving or None

    @staticmethod
    async def _poll(refs: _Refs) -> list[JobResult]:
        loads: list[JobResult] = await refs.load.ask(lambda r: PollFinished(reply=r))
        stores: list[JobResult] = await refs.store.ask(lambda r: PollFinished(reply=r))
        return loads + stores

    def take_failed_recving(self) -> set[str]:
        """Requests whose load failed, reported whole (several KV-cache groups); each is
        also in ``finished_recving`` of the same or an earlier ``get_finished``."""
        failed, self._failed_recving = self._failed_recving, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_worker_meta(self) -> KVFerryWorkerMetadata | None:
        if not self._acks and not self._stats:
            return None
        meta = KVFerryWorkerMetadata(acks=self._acks, stats=self._stats)
        self._acks, self._stats = {}, {}
        return meta

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.close()
        if self.pool is not None:
            self.pool.close()  # unpins at once (nothing copies to or from it any more)
