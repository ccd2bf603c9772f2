"""vLLM schedulers with a connector (kvferry's, vLLM's OffloadingConnector, or none) and
simulated workers for them: the harness of ``benchmarks/scheduler_overhead.py``.

A real ``vllm.v1.core.sched.scheduler.Scheduler`` (no engine, no model forward) is built
by :func:`make_scheduler`; after each ``schedule()``, :func:`model_runner_output` gives
what the model runner would return: one sampled token per request whose prefill is
complete (none for a partial prefill chunk, as the model runner discards it), and the
``KVConnectorOutput`` each connector's real worker would report if every copy took no
time:

- kvferry (connector/_worker.py), :class:`KVFerryWorkerSim`: loads and stores are
  submitted in the step that carries them (``start_load_kv`` / ``wait_for_save``) and are
  polled done in the same step's ``get_finished``: ``finished_recving`` = the loads'
  request ids, ``finished_sending`` = ``release_req_ids`` (their stores are all done),
  worker metadata ``KVFerryWorkerMetadata(acks={job: [1, 0]}, stats={bytes, seconds})``.
- OffloadingConnector (offloading/worker.py), :class:`VLLMWorkerSim`: loads are submitted
  in ``start_load_kv`` and done in the same step (``finished_recving`` = their request
  ids); stores are *deferred* by ``wait_for_save`` to the next step's
  ``handle_preemptions`` (or submitted at once if named in ``jobs_to_flush``), so a store
  is reported one step after it was planned. Worker metadata
  ``OffloadingWorkerMetadata(completed_jobs={job: 1}, transfer_stats=...)``; stores never
  emit ``finished_sending``.

Each simulator counts what the metadata asked the workers to move (:class:`Moved`).
vLLM is imported inside the functions: importing this module needs none.
tests/connector/test_simulators.py checks the simulators against real schedulers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SAMPLED_TOKEN = 7
"""The token every simulated decode step samples (never the model's EOS, 2)."""


# -- vLLM objects --------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    model_dir: Path
    block: int
    offload_block: int
    num_gpu_blocks: int
    host_blocks: int
    max_num_seqs: int
    max_batched_tokens: int
    max_model_len: int
    store_decoded: bool = False
    """Both connectors store decoded blocks too (kvferry ``store_decoded: true``, vLLM
    ``offload_prompt_only=False``); else prompt blocks only, vLLM's default."""
    watermarks: tuple[float, float] | None = None
    """kvferry's ``eviction_watermarks`` (None: its default)."""


def kv_cache_config(s: Setup) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    cfg = json.loads((s.model_dir / "config.json").read_text())
    spec = FullAttentionSpec(
        block_size=s.block,
        num_kv_heads=cfg["num_key_value_heads"],
        head_size=cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]),
        dtype=torch.bfloat16,
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(cfg["num_hidden_layers"])]
    return KVCacheConfig(
        num_blocks=s.num_gpu_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )


def host_bytes(s: Setup, kcc: Any) -> int:
    """Bytes for ``host_blocks`` offloaded blocks, the same count for both connectors.

    kvferry: slots = bytes // (row_bytes * blocks_per_chunk); vLLM's CPU spec:
    chunks = bytes // round_up(bytes_per_block * blocks_per_chunk, page size).
    """
    import mmap

    row: int = sum(
        len(g.layer_names) * g.kv_cache_spec.page_size_bytes for g in kcc.kv_cache_groups
    )
    chunk = row * (s.offload_block // s.block)
    page = mmap.PAGESIZE
    aligned = (chunk + page - 1) // page * page
    if aligned != chunk:
        raise SystemExit(
            f"an offloaded block of {chunk} bytes is not page-aligned: pick other sizes"
        )
    return s.host_blocks * chunk


def make_scheduler(s: Setup, kind: str) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    kcc = kv_cache_config(s)
    model_config = ModelConfig(
        model=str(s.model_dir),
        skip_tokenizer_init=True,
        max_model_len=s.max_model_len,
        dtype="bfloat16",
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_batched_tokens,
        max_model_len=s.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=False,
    )
    cache_config = CacheConfig(block_size=s.block, enable_prefix_caching=True)
    kv_transfer_config = None
    if kind == "kvferry":
        kv_transfer_config = KVTransferConfig(
            kv_connector="KVFerryConnector",
            kv_connector_module_path="kvferry.connector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "cpu_bytes_to_use": host_bytes(s, kcc),
                "block_size": s.offload_block,
                "store_decoded": s.store_decoded,
                **({"eviction_watermarks": s.watermarks} if s.watermarks else {}),
            },
        )
    elif kind == "vllm":
        kv_transfer_config = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "cpu_bytes_to_use": host_bytes(s, kcc),
                "block_size": s.offload_block,
                **({"offload_prompt_only": False} if s.store_decoded else {}),
            },
        )
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=kv_transfer_config,
    )
    # What the engine core does before it builds its scheduler.
    vllm_config.cache_config.num_gpu_blocks = s.num_gpu_blocks
    if vllm_config.cache_config.kv_cache_layout is None:
        vllm_config.cache_config.kv_cache_layout = "LBHNC"
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kcc,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=s.block,
        log_stats=False,
    )


def host_capacity(scheduler: Any, kind: str) -> int | None:
    conn = scheduler.connector
    if kind == "kvferry":
        return int(conn._scheduler.geometry.num_slots)
    if kind == "vllm":
        return int(conn.connector_scheduler.manager._num_chunks)
    return None


# -- simulated workers -------------------------------------------------------------------


@dataclass
class Moved:
    """What the connector's metadata asked the workers to move, over a run."""

    load_jobs: int = 0
    store_jobs: int = 0
    load_blocks: int = 0
    store_blocks: int = 0
    flushes: int = 0
    """Store jobs named to be waited for before their blocks are reused."""
    releases: int = 0


class KVFerryWorkerSim:
    """kvferry's WorkerSide with copies that end as soon as they are submitted."""

    def __init__(self, row_bytes: int, moved: Moved) -> None:
        from vllm.v1.outputs import KVConnectorOutput

        from kvferry.connector import KVFerryMetadata, KVFerryWorkerMetadata

        self._meta_t = KVFerryMetadata
        self._wmeta = KVFerryWorkerMetadata
        self._out = KVConnectorOutput
        self.row_bytes = row_bytes
        self.moved = moved

    def step(self, meta: Any) -> Any:
        assert isinstance(meta, self._meta_t), type(meta)
        m = self.moved
        acks: dict[int, list[int]] = {}
        stats: dict[str, float] = {}
        recving: set[str] = set()
        # handle_preemptions: flush_job_ids name stores already done (they end at once).
        m.flushes += len(meta.flush_job_ids)
        # start_load_kv, then wait_for_save, then get_finished: every job is done.
        for spec in meta.loads:
            blocks = sum(len(p.device_blocks) for p in spec.copy.parts)
            m.load_jobs += 1
            m.load_blocks += blocks
            acks[spec.copy.job_id] = [1, 0]
            recving.add(spec.req_id)
            stats["load_bytes"] = stats.get("load_bytes", 0.0) + blocks * self.row_bytes
            stats["load_seconds"] = stats.get("load_seconds", 0.0) + blocks * self.row_bytes / 1e10
        for spec in meta.stores:
            blocks = sum(len(p.device_blocks) for p in spec.copy.parts)
            m.store_jobs += 1
            m.store_blocks += blocks
            acks[spec.copy.job_id] = [1, 0]
            stats["store_bytes"] = stats.get("store_bytes", 0.0) + blocks * self.row_bytes
            stats["store_seconds"] = (
                stats.get("store_seconds", 0.0) + blocks * self.row_bytes / 1e10
            )
        # A released request's stores are all done: it is finished_sending at once.
        sending = set(meta.release_req_ids)
        m.releases += len(sending)
        return self._out(
            finished_sending=sending or None,
            finished_recving=recving or None,
            kv_connector_worker_meta=self._wmeta(acks=acks, stats=stats) if acks or stats else None,
        )

    def idle(self) -> bool:
        return True


def _num_blocks(spec: Any) -> int:
    """GPU blocks of a ``GPULoadStoreSpec`` (one id per engine block, all groups)."""
    return len(spec.block_ids)


class VLLMWorkerSim:
    """OffloadingConnectorWorker with copies that end as soon as they are submitted."""

    def __init__(self, row_bytes: int, moved: Moved) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingConnectorMetadata,
            OffloadingWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput

        self._meta_t = OffloadingConnectorMetadata
        self._wmeta = OffloadingWorkerMetadata
        self._out = KVConnectorOutput
        self.row_bytes = row_bytes
        self.moved = moved
        self._unsubmitted: list[tuple[int, int]] = []  # (job id, GPU blocks), deferred stores

    def step(self, meta: Any) -> Any:
        assert isinstance(meta, self._meta_t), type(meta)
        m = self.moved
        store_jobs = dict(meta.store_jobs)  # the real worker pops from its unpickled copy
        submitted: list[tuple[int, int, str | None]] = []  # (job, blocks, load req id)
        # handle_preemptions: jobs_to_flush leave this step's store_jobs and are submitted
        # with the stores deferred from the previous step, then waited for.
        for job_id in meta.jobs_to_flush or ():
            m.flushes += 1
            entry = store_jobs.pop(job_id, None)
            if entry is not None:
                self._unsubmitted.append((job_id, _num_blocks(entry.src_spec)))
        submitted.extend((j, n, None) for j, n in self._unsubmitted)
        self._unsubmitted = []
        # start_load_kv (start_kv_transfers): this step's loads.
        for job_id, entry in meta.load_jobs.items():
            blocks = _num_blocks(entry.dst_spec)
            m.load_jobs += 1
            m.load_blocks += blocks
            submitted.append((job_id, blocks, entry.req_id))
        # wait_for_save (prepare_store_kv): the rest is deferred to the next step.
        for job_id, entry in store_jobs.items():
            self._unsubmitted.append((job_id, _num_blocks(entry.src_spec)))
        for entry in meta.store_jobs.values():
            m.store_jobs += 1
            m.store_blocks += _num_blocks(entry.src_spec)
        # get_finished: everything submitted is done.
        wmeta = self._wmeta()
        recving: set[str] = set()
        for job_id, blocks, load_req in submitted:
            nbytes = blocks * self.row_bytes
            side = wmeta.transfer_stats.load if load_req is not None else wmeta.transfer_stats.store
            side.record(nbytes, nbytes / 1e10)
            wmeta.mark_completed(job_id)
            if load_req is not None:
                recving.add(load_req)
        return self._out(
            finished_sending=set(),
            finished_recving=recving,
            kv_connector_worker_meta=wmeta if wmeta.completed_jobs else None,
        )

    def idle(self) -> bool:
        return not self._unsubmitted


class NoWorkerSim:
    def __init__(self, row_bytes: int, moved: Moved) -> None:
        self.moved = moved

    def step(self, meta: Any) -> Any:
        return None

    def idle(self) -> bool:
        return True


SIMULATORS: dict[str, Callable[[int, Moved], Any]] = {
    "none": NoWorkerSim,
    "kvferry": KVFerryWorkerSim,
    "vllm": VLLMWorkerSim,
}
"""The simulated worker of each kind of run, built with (row bytes, its Moved)."""


def row_bytes(kcc: Any) -> int:
    """Bytes of one engine block, all layers, on one worker."""
    return int(
        sum(len(g.layer_names) * g.kv_cache_spec.page_size_bytes for g in kcc.kv_cache_groups)
    )


def new_request(req_id: str, prompt: Sequence[int], max_tokens: int, hasher: Any) -> Any:
    """A vLLM ``Request`` as the engine builds it (its block hashes from ``hasher``)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config({}, 2)
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=sp,
        pooling_params=None,
        block_hasher=hasher,
    )


def model_runner_output(scheduler: Any, so: Any, sim: Any) -> Any:
    """The simulated model runner's output for ``schedule()``'s ``so``, with ``sim``'s
    connector output: a token sampled for every request whose prefill is complete."""
    from vllm.v1.outputs import ModelRunnerOutput

    kv_out = sim.step(so.kv_connector_metadata)
    req_ids = list(so.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for rid in req_ids:
        req = scheduler.requests[rid]
        # A partial prefill chunk's sample is discarded by the model runner.
        sampled.append([SAMPLED_TOKEN] if req.num_computed_tokens >= req.num_tokens else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=kv_out,
    )
