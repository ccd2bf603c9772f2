"""The worker half of the connector: runs this step's jobs and reports what ended.

Who owns what: vLLM calls these methods on the worker process's engine thread. The
:class:`~kvferry.transfer.StoreActor` and :class:`~kvferry.transfer.LoadActor` own the
copy engine's completions, the :class:`~kvferry.tiers.DiskIOActor` (with a disk tier)
this worker's chunk files; this object owns the bookkeeping of which request waits on
which job. One runtime call per vLLM call.

The disk tier, on this side:

- at start (``register_kv_caches``) a :class:`~kvferry.tiers.DiskStore` under the tier's
  path, for this rank's fingerprint (:func:`~kvferry.connector._tiers.disk_fingerprint`)
  and its share of ``bytes_to_use``, in a namespace of its own (locked until
  ``shutdown``, its lock naming the engine: :func:`~._disk_tier.engine_owner`); the
  layout observed on the KV tensors is compared with the one recorded beside the files
  (``layout.json``), and on a change every chunk file of the namespace is deleted before
  the warm-restart scan, so none is ever read;
  then the scan, synchronously, before the engine's first step;
- a load with ``disk_reads`` reads its chunks into its host slots first, and its copy is
  chained after the read in the disk actor's task (``ReadChunks.then``: the load actor's
  ``tell``), ordered after the compute captured when ``start_load_kv`` was called. The
  engine never waits for it: it runs across engine steps, driven by the loop thread
  (thread runtime) or by the engine's own calls (stepped). A load whose chunks did not
  all read back verified fails on this worker (reason ``"disk"``), never copied;
- ``wait_for_save`` queues the step's disk deletes, then its disk writes (host slots the
  scheduler keeps pinned until the write's ack);
- every disk job's per-chunk outcome goes back in ``disk_failed`` with the job's ack, in
  the same worker metadata. A read's chunk that failed is reported gone (1) when this
  rank's store no longer holds it (corrupt, absent, another fingerprint's, deleted for an
  error that says the file is bad), else kept (:data:`~._metadata.KEPT`: a transient
  error such as EMFILE or ENOMEM, a job aborted): either fails the load, but the
  scheduler drops only a chunk gone on some rank.

The Redis tier, on this side, takes the disk tier's paths with a
:class:`~kvferry.tiers.RedisIOActor` (the same messages) in place of the disk actor: a
:class:`~kvferry.tiers.RedisStore` for this rank's fingerprint, connected at start (a URL
that does not parse or a server that cannot be reached fails the start, naming the key);
no scan, no layout file (the layout is in the fingerprint). Its sockets need a loop that
runs between engine steps: with a Redis tier the actors run on a loop thread (the
``"thread"`` runtime; ``"stepped"`` is refused by the configuration).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import attrs
import numpy as np

from .. import traces
from .._config import DiskTierConfig, FerryConfig, RedisTierConfig, load_object
from .._errors import ConfigError, TransferError
from .._logging import get_logger
from ..actors import ActorRef, ActorSystem, SyncRuntime, start_runtime
from ..tiers import (
    DeleteChunks,
    DiskIOActor,
    DiskIOMsg,
    DiskJobResult,
    DiskStore,
    FileOps,
    Outcome,
    PollDiskJobs,
    ReadChunks,
    RedisIOActor,
    RedisIOMsg,
    RedisStore,
    ScanDisk,
    ScanReport,
    WriteChunks,
    keys_array,
)
from ..tiers._disk import LAYOUT_FILE
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
from ..transfer._layout import KVLayout, _block_dim
from ._disk_tier import engine_owner
from ._geometry import Geometry, largest_stage, plan_geometry
from ._metadata import KEPT, DiskWriteSpec, JobSpec, KVFerryMetadata, KVFerryWorkerMetadata
from ._redis_tier import make_store
from ._tiers import disk_fingerprint, disk_leader

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


LAYOUT_FORMAT = 1

_CORRUPT = (Outcome.CORRUPT, Outcome.FOREIGN)


@attrs.frozen
class _Refs:
    store: ActorRef[TransferMsg]
    load: ActorRef[TransferMsg]
    disk: ActorRef[DiskIOMsg] | None = None
    redis: ActorRef[RedisIOMsg] | None = None


@attrs.frozen
class _Polled:
    copies: list[JobResult]
    disk: list[DiskJobResult]
    redis: list[DiskJobResult]


class _ReadGate:
    """Whether a load whose chunks are read first (disk, Redis) may still start its copy.

    The scheduler may end such a load at its deadline while a read has not returned (a
    disk that stopped answering): the facade then gives it up (:meth:`give_up`, on the
    engine thread), and, if its copy had not started, answers vLLM at once (its blocks
    recomputed) and never copies; the copy, chained after the reads, asks
    :meth:`start_copy` first (on the actors' loop thread). One lock orders the two."""

    __slots__ = ("_lock", "_copying", "_given_up")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._copying = False
        self._given_up = False

    def start_copy(self) -> bool:
        """Whether the copy may start (not given up); if so, it can no longer be."""
        with self._lock:
            self._copying = not self._given_up
            return self._copying

    def give_up(self) -> bool:
        """Give the load up unless its copy started (or it was given up already): True if
        given up now (no copy ever)."""
        with self._lock:
            if self._copying or self._given_up:
                return False
            self._given_up = True
            return True


@attrs.frozen(eq=False)
class _CopyWhenRead:
    """A disk-read load's next step (``ReadChunks.then``): its copy, once every chunk was
    read and verified; ordered after ``compute``, the engine's mark taken when the load
    was started. A failed read starts nothing (the facade reports the load failed). A
    load given up meanwhile (``gate``) is not copied: ``given_up`` gets its end."""

    load: ActorRef[TransferMsg]
    job: CopyJob
    compute: object | None
    gate: _ReadGate
    given_up: Callable[[JobResult], object]

    async def __call__(self, result: DiskJobResult) -> None:
        if not result.ok:
            return
        if self.gate.start_copy():
            await self.load.tell(SubmitJobs(jobs=(self.job,), compute=self.compute))
            return
        self.given_up(
            JobFailed(
                job_id=self.job.job_id,
                direction="load",
                error="ended by the scheduler at its deadline while its chunks were "
                "read: not copied",
                reason="deadline",
            )
        )


@attrs.frozen(eq=False)
class _ThenRead:
    """A load's next read (``ReadChunks.then``): its Redis chunks once its disk chunks were
    all read and verified. A failed read starts nothing. (A load given up still reads:
    its copy, next, is what it must not start; a Redis read ends at its deadline.)"""

    ref: ActorRef[RedisIOMsg]
    read: ReadChunks

    async def __call__(self, result: DiskJobResult) -> None:
        if result.ok:
            await self.ref.tell(self.read)


def _block_bytes(t: torch.Tensor, num_blocks: int, block_stride_bytes: int | None) -> list[Any]:
    """How one block of a layer's tensor lies in memory: its dimensions (the block's own
    excepted, and those of size 1), outermost first, as ``[dim, size, stride]``; the
    stride (in elements) is None for a dimension outside the block (it scales with the
    number of blocks, which decides where a block lives, not what its bytes mean)."""
    bd = _block_dim(t, num_blocks, block_stride_bytes)
    block_stride = t.stride(bd)
    dims = [
        (d, int(n), int(st))
        for d, (n, st) in enumerate(zip(t.shape, t.stride(), strict=True))
        if d != bd and n != 1
    ]
    dims.sort(key=lambda d: d[2], reverse=True)
    return [[d, n, st if st < block_stride else None] for d, n, st in dims]


def observed_layout(
    kv_caches: dict[str, torch.Tensor],
    group_layers: Sequence[Sequence[str]],
    layout: KVLayout,
    block_stride_bytes: int | None,
    blocks_per_chunk: int,
) -> dict[str, Any]:
    """What decides the bytes of a host slot, as observed on the engine's KV tensors: per
    group its layers (dtype, how a block lies in memory), the segments and regions of a
    host row (offsets and byte sizes), the row's bytes; the device type and the rows per
    slot. Stable across restarts of the same engine (nothing depends on the number of
    blocks or on addresses)."""
    groups = []
    for layers, group in zip(group_layers, layout.groups, strict=True):
        groups.append(
            {
                "row_bytes": group.row_bytes,
                "segments": [[s.offset, s.nbytes] for s in group.segments],
                "regions": [[r.offset, r.count, r.nbytes] for r in group.regions],
                "layers": [
                    {
                        "name": name,
                        "dtype": str(kv_caches[name].dtype),
                        "block": _block_bytes(
                            kv_caches[name], layout.num_blocks, block_stride_bytes
                        ),
                    }
                    for name in layers
                    if name in kv_caches
                ],
            }
        )
    return {
        "format": LAYOUT_FORMAT,
        "device": layout.device.type,
        "row_bytes": layout.row_bytes,
        "blocks_per_chunk": blocks_per_chunk,
        "groups": groups,
    }


def _changed_keys(recorded: object, observed: dict[str, Any]) -> list[str]:
    """The top-level keys of the layout record that differ (for the log)."""
    if not isinstance(recorded, dict):
        return ["(no readable record)" if recorded is None else str(recorded)]
    return sorted(
        k for k in recorded.keys() | observed.keys() if recorded.get(k) != observed.get(k)
    )


def clear_chunk_files(namespace: Path, *, temp: bool = True) -> int:
    """Delete every chunk file (and, with ``temp``, temporary one) under ``namespace``;
    how many. ``temp`` only in a namespace the store holds locked: in a shared one (no
    ``flock``) a ``.tmp`` may be another engine's write in flight (the scan deletes the
    stale ones)."""
    suffixes = (".kvc", ".tmp") if temp else (".kvc",)
    removed = 0
    with os.scandir(namespace) as top:
        fans = [e.path for e in top if e.is_dir(follow_symlinks=False)]
    for fan in fans:
        with os.scandir(fan) as entries:
            for entry in entries:
                if entry.name.endswith(suffixes):
                    try:
                        os.unlink(entry.path)
                    except FileNotFoundError:
                        continue
                    removed += 1
    return removed


class WorkerSide:
    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        cfg: FerryConfig,
        *,
        disk_ops: FileOps | None = None,
    ) -> None:
        """``disk_ops``: the disk tier's operating-system calls (tests inject faults)."""
        self.cfg = cfg
        self.kv_cache_config = kv_cache_config
        self.geometry: Geometry = plan_geometry(
            cfg,
            kv_cache_config,
            vllm_config.cache_config.block_size,
            vllm_config.parallel_config.world_size,
            stage_layers=largest_stage(vllm_config),
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
        self._gates: dict[int, _ReadGate] = {}
        """Loads whose chunks are read first, until they end: see :class:`_ReadGate`."""
        self._answered: set[int] = set()
        """Loads given up (:meth:`_give_up`) and answered to vLLM already, whose reads have
        not ended: their end is acknowledged, not reported again."""
        self._answered_now: set[str] = set()
        """Requests answered by :meth:`_give_up` since the last ``get_finished``."""
        self._given_up_ended: deque[JobResult] = deque()
        """Loads given up whose reads ended (appended on the actors' loop thread)."""
        self._acks: dict[int, list[int]] = {}
        self._provider = traces.setup(cfg.traces, role="worker")
        self.trace = traces.WorkerTracer(self._provider, rank=vllm_config.parallel_config.rank)
        self._traceparents: dict[int, tuple[str, int]] = {}
        self._stats: dict[str, float] = {}
        self.vllm_config = vllm_config
        self._disk_ops = disk_ops
        self.disk: DiskStore | None = None
        self.disk_scan: ScanReport | None = None
        self._disk_failed: dict[int, list[int]] = {}
        """Per-chunk disk outcomes (0 ok, 1 failed; a read's chunk failed with its file
        kept: :data:`~._metadata.KEPT`) to report with their jobs' acks."""
        self._disk_read_keys: dict[int, Any] = {}
        """Load job id -> the keys of its disk read in flight (whether this rank still
        holds a chunk that failed is asked of the store when the read ends)."""
        self._redis_failed: dict[int, list[int]] = {}
        """The same for the Redis tier."""
        self._read_outcomes: dict[tuple[str, int], list[int]] = {}
        """Disk-read loads whose reads ended: their outcomes wait for the load's own end
        (its copy's, or its failure), reported in the same worker metadata."""
        self._disk_ended: list[tuple[str, DiskJobResult]] = []
        """Jobs of a tier ended without its actor (no such tier on this worker)."""
        self._disk_load_failure_logged = False
        self.redis: RedisStore | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        kcc = self.kv_cache_config
        tensors = getattr(kcc, "kv_cache_tensors", None) or []
        block_stride = getattr(tensors[0], "block_stride", None) if tensors else None
        group_layers = [g.layer_names for g in kcc.kv_cache_groups]
        layout = describe_kv_caches(kv_caches, group_layers, kcc.num_blocks, block_stride)
        geo = self.geometry
        if layout.row_bytes > geo.row_bytes:
            raise TransferError(
                f"the KV tensors hold {layout.row_bytes} bytes per block, more than the "
                f"{geo.row_bytes} vLLM's KV-cache config announces"
            )
        if layout.row_bytes > geo.slot_row_bytes:
            # Pipeline parallelism only (else a slot's row is this config's): layers vLLM
            # placed on this stage beyond what every rank can count alike.
            share = geo.num_slots * geo.blocks_per_chunk * geo.slot_row_bytes
            self._log.warning(
                "host_row_beyond_share",
                row_bytes=layout.row_bytes,
                slot_row_bytes=geo.slot_row_bytes,
                host_bytes=geo.num_slots * geo.blocks_per_chunk * layout.row_bytes,
                share_bytes=share,
                note="this pipeline stage's KV rows are larger than the largest stage's "
                "layers times the largest page (a drafter's pages larger than the "
                "model's?): its host memory goes beyond its share of cpu_bytes_to_use",
            )
        tiers = self.cfg.tiers
        tier = next((t for t in tiers if isinstance(t, DiskTierConfig)), None)
        redis_tier = next((t for t in tiers if isinstance(t, RedisTierConfig)), None)
        if tier is not None:
            # Before the host pool: a bad path or size fails the start at once.
            observed = observed_layout(
                kv_caches, group_layers, layout, block_stride, geo.blocks_per_chunk
            )
            self.disk = self._open_disk(tier, observed)
        if redis_tier is not None:
            parallel = self.vllm_config.parallel_config
            fingerprint = disk_fingerprint(
                self.vllm_config, self.kv_cache_config, geo.chunk_tokens, parallel.rank
            )
            self.redis = make_store(redis_tier, fingerprint)
        self.pool = HostPool(
            geo.num_slots, geo.blocks_per_chunk, layout.row_bytes, pin=layout.device.type == "cuda"
        )
        if self.cfg.copy_engine is not None:
            factory = load_object("copy_engine", self.cfg.copy_engine)
            engine = factory(layout, self.pool)
        else:
            engine = new_copy_engine(layout, self.pool)
        store_ = self.disk
        redis_ = self.redis
        # The host pool as the disk actor sees it: a slot (one chunk) per row, no copy.
        slots = self.pool.rows.numpy().reshape(geo.num_slots, -1)

        async def setup(system: ActorSystem) -> _Refs:
            load = await system.spawn(
                LoadActor(engine, job_timeout_s=self.cfg.job_timeout_s), name="load"
            )
            store = await system.spawn(
                StoreActor(engine, job_timeout_s=self.cfg.job_timeout_s), name="store"
            )
            disk = redis = None
            if store_ is not None and tier is not None:
                # Spawned after the load actor it chains copies to: stopped before it.
                disk = await system.spawn(
                    DiskIOActor(store_, slots, io_depth=tier.io_depth), name="disk"
                )
            if redis_ is not None and redis_tier is not None:
                try:
                    await redis_.connect()  # a ConfigError naming tiers[i].url if unreachable
                except BaseException:
                    await redis_.aclose()
                    raise
                redis = await system.spawn(
                    RedisIOActor(
                        redis_,
                        slots,
                        io_depth=redis_tier.io_depth,
                        max_queued_writes=redis_tier.max_queued_writes,
                        job_timeout_s=self.cfg.job_timeout_s,
                    ),
                    name="redis",
                )
            return _Refs(store=store, load=load, disk=disk, redis=redis)

        # Redis's sockets need a loop running between engine steps: a loop thread.
        kind = "thread" if redis_ is not None else self.cfg.runtime
        try:
            self.runtime, refs = start_runtime(kind, setup)
        except BaseException:
            # (Redis unreachable, say): nothing else would close them.
            engine.close()
            self.pool.close()
            if self.disk is not None:
                self.disk.close()
            raise
        self._refs = refs
        self._engine = engine
        if refs.disk is not None and tier is not None:
            # The warm restart: the index rebuilt from the files before the first step
            # (the scan logs its progress), its first message. The scheduler finds the
            # same files by its own scan.
            budget = tier.scan_budget_s
            self.disk_scan = self.runtime.call(
                refs.disk.ask, lambda r: ScanDisk(reply=r, budget_s=budget)
            )
        self._log.info(
            "worker_started",
            host_pool_bytes=self.pool.nbytes,
            layout_segments=sum(len(g.segments) for g in layout.groups),
            runtime=type(self.runtime).__name__,
            disk_chunks=None if self.disk_scan is None else self.disk_scan.chunks,
        )

    def _open_disk(self, tier: DiskTierConfig, observed: dict[str, Any]) -> DiskStore:
        """This rank's store (its share of ``bytes_to_use``), its chunk files deleted if
        they were written for another host row layout than ``observed``, which is then
        recorded beside them."""
        parallel = self.vllm_config.parallel_config
        fingerprint = disk_fingerprint(
            self.vllm_config, self.kv_cache_config, self.geometry.chunk_tokens, parallel.rank
        )
        store = DiskStore(
            tier.path,
            tier.bytes_to_use // max(1, parallel.world_size),
            fingerprint,
            tier_index=tier.index,
            fsync=tier.fsync,
            ops=self._disk_ops,
            owner=engine_owner(self.vllm_config),
            # The other ranks take the namespace index rank 0 took (the scheduler keeps
            # only the chunks every rank holds).
            leader=disk_leader(
                self.vllm_config, self.kv_cache_config, self.geometry.chunk_tokens, parallel.rank
            ),
        )
        target = store.namespace / LAYOUT_FILE
        try:
            recorded: object = json.loads(target.read_text())
        except FileNotFoundError:
            recorded = None
        except (OSError, ValueError) as exc:
            recorded = f"unreadable: {exc!r}"
        if recorded == observed:
            return store
        # Before the scan: a chunk written for another layout is never indexed, never
        # read. No record at all: none written yet, or files of a writer that kept none.
        removed = clear_chunk_files(store.namespace, temp=store.locked)
        if recorded is not None or removed:
            self._log.warning(
                "disk_layout_changed",
                path=str(store.namespace),
                chunks_deleted=removed,
                changed=_changed_keys(recorded, observed),
            )
        tmp = target.with_name(f"{LAYOUT_FILE}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(observed, sort_keys=True, indent=1) + "\n")
            os.replace(tmp, target)
        except OSError as exc:
            raise ConfigError(
                f"tiers[{tier.index}].path", f"cannot write in {store.namespace}: {exc}"
            ) from exc
        return store

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
            self._give_up(failed)
        if not meta.loads or self._refs is None:
            return
        jobs = []
        reads: list[JobSpec] = []
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
            elif spec.disk_reads is not None or spec.redis_reads is not None:
                reads.append(spec)
            else:
                jobs.append(spec.copy)
        self._remember_traces(meta.loads)
        if jobs:
            self._submit(self._refs.load, jobs)
        if reads:
            self._start_disk_loads(reads)

    def _give_up(self, failed: list[int]) -> None:
        """Loads the scheduler ended at their deadline while their chunks are still being
        read, their copies not started: answered to vLLM now (``finished_recving``, their
        blocks recomputed), not when a read that may not return ends; never copied. The
        host slots they read into stay reserved until the reads ended (acknowledged
        then)."""
        for job_id in failed:
            gate = self._gates.get(job_id)
            if gate is None or not gate.give_up():
                continue
            req_id, blocks = self._load_req[job_id]
            self._answered.add(job_id)
            self._traceparents.pop(job_id, None)  # no copy: none to record
            self._answered_now.add(req_id)
            if self.geometry.num_groups > 1:
                self._failed_recving.add(req_id)
            else:
                self._load_errors.update(blocks)
            self._log.warning(
                "load_given_up",
                job_id=job_id,
                req_id=req_id,
                note="ended by the scheduler at its deadline while its chunks were read: "
                "recomputed now, never copied",
            )

    def _start_disk_loads(self, specs: list[JobSpec]) -> None:
        """Read each load's chunks into its host slots (its disk chunks, then its Redis
        chunks), then copy: each step chained in the actor that ends the one before,
        ordered after the compute enqueued so far on this thread."""
        refs = self._refs
        if refs is None:
            return
        mark = capture_compute(self._engine)
        disk_msgs: list[DiskIOMsg] = []
        redis_msgs: list[RedisIOMsg] = []
        for spec in specs:
            job_id = spec.copy.job_id
            missing = [
                tier
                for tier, chunks, ref in (
                    ("disk", spec.disk_reads, refs.disk),
                    ("redis", spec.redis_reads, refs.redis),
                )
                if chunks is not None and ref is None
            ]
            if missing:
                # The scheduler planned reads of a tier this worker lacks (configs that
                # differ): the load fails here.
                self._log.error("read_without_its_tier", job_id=job_id, tiers=missing)
                chunks = spec.disk_reads if missing[0] == "disk" else spec.redis_reads
                n = len(chunks.keys) if chunks is not None else 0
                self._disk_ended.append((missing[0], _not_run(job_id, "read", n)))
                continue
            gate = self._gates[job_id] = _ReadGate()
            then: Any = _CopyWhenRead(
                load=refs.load,
                job=spec.copy,
                compute=mark,
                gate=gate,
                given_up=self._given_up_ended.append,
            )
            if spec.redis_reads is not None and refs.redis is not None:
                read = ReadChunks(
                    job_id=job_id,
                    keys=keys_array(spec.redis_reads.keys),
                    slots=spec.redis_reads.slots,
                    then=then,
                )
                if spec.disk_reads is None:
                    redis_msgs.append(read)
                    continue
                then = _ThenRead(ref=refs.redis, read=read)
            if spec.disk_reads is not None:
                msg = ReadChunks(
                    job_id=job_id,
                    keys=keys_array(spec.disk_reads.keys),
                    slots=spec.disk_reads.slots,
                    then=then,
                )
                self._disk_read_keys[job_id] = msg.keys
                disk_msgs.append(msg)
        if refs.disk is not None:
            self._tell_disk(refs.disk, disk_msgs)
        if refs.redis is not None:
            self._tell_disk(refs.redis, redis_msgs)

    def _tell_disk(self, ref: ActorRef[Any], msgs: Sequence[DiskIOMsg | RedisIOMsg]) -> None:
        """``msgs`` to a tier's actor, in order, in one runtime call."""
        if len(msgs) == 1:
            self.runtime.call(ref.tell, msgs[0])  # type: ignore[union-attr]
        elif msgs:
            self.runtime.call(_tell_all, ref, list(msgs))  # type: ignore[union-attr]

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
        if meta.disk_deletes or meta.disk_writes:
            self._write_down(self._refs.disk, "disk", meta.disk_writes, meta.disk_deletes)
        if meta.redis_writes:
            self._write_down(self._refs.redis, "redis", meta.redis_writes, [])

    def _write_down(
        self,
        ref: ActorRef[Any] | None,
        tier: Literal["disk", "redis"],
        writes: list[DiskWriteSpec],
        deletes: list[bytes],
    ) -> None:
        """This step's deletes, then its writes of a tier: after its stores (the slots
        written down were stored and acknowledged before; pinned until the write's ack)."""
        if ref is None:
            if writes:
                self._log.error(
                    "write_without_its_tier", tier=tier, job_ids=[w.job_id for w in writes]
                )
            for w in writes:
                self._disk_ended.append((tier, _not_run(w.job_id, "write", len(w.chunks.keys))))
            return
        msgs: list[DiskIOMsg] = []
        if deletes:
            msgs.append(DeleteChunks(keys=keys_array(deletes)))
        msgs.extend(
            WriteChunks(job_id=w.job_id, keys=keys_array(w.chunks.keys), slots=w.chunks.slots)
            for w in writes
        )
        self._tell_disk(ref, msgs)

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
        # Before the poll: a load given up ended after its reads' results were queued,
        # so the poll below (or an earlier one) has them.
        given_up = [self._given_up_ended.popleft() for _ in range(len(self._given_up_ended))]
        polled: _Polled = self.runtime.call(self._poll, self._refs)  # type: ignore[union-attr]
        results = given_up + polled.copies
        ended = [*self._disk_ended, *(("disk", r) for r in polled.disk)]
        ended.extend(("redis", r) for r in polled.redis)
        self._disk_ended = []
        if ended:
            # Before the copies: a load's reads ended no later than its copy did.
            results = self._disk_jobs_ended(ended) + results
        if self._planned_failures:
            results = self._planned_failures + results
            self._planned_failures = []
        finished_recving, self._answered_now = self._answered_now, set()
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
            for tier, outcomes in (("disk", self._disk_failed), ("redis", self._redis_failed)):
                read = self._read_outcomes.pop((tier, res.job_id), None)
                if read is not None:
                    outcomes[res.job_id] = read
            key = res.direction
            self._stats[f"{key}_bytes"] = self._stats.get(f"{key}_bytes", 0.0) + res.nbytes
            self._stats[f"{key}_seconds"] = self._stats.get(f"{key}_seconds", 0.0) + res.seconds
            if res.direction == "load":
                req_id, blocks = self._load_req.pop(res.job_id)
                self._gates.pop(res.job_id, None)
                if res.job_id in self._answered:
                    self._answered.discard(res.job_id)  # vLLM had its answer (_give_up)
                    continue
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
    async def _poll(refs: _Refs) -> _Polled:
        loads: list[JobResult] = await refs.load.ask(lambda r: PollFinished(reply=r))
        stores: list[JobResult] = await refs.store.ask(lambda r: PollFinished(reply=r))
        # After the loads: a copy chained after a read is submitted only once the read's
        # result is queued here, so a copy seen ended above has its read's result below
        # (or in an earlier poll).
        disk: list[DiskJobResult] = (
            [] if refs.disk is None else await refs.disk.ask(lambda r: PollDiskJobs(reply=r))
        )
        # After the disk: a Redis read chained after a disk read starts once that ended.
        redis: list[DiskJobResult] = (
            [] if refs.redis is None else await refs.redis.ask(lambda r: PollDiskJobs(reply=r))
        )
        return _Polled(copies=loads + stores, disk=disk, redis=redis)

    def _disk_jobs_ended(self, ended: list[tuple[str, DiskJobResult]]) -> list[JobResult]:
        """Account for the jobs of the tiers below (disk, Redis) that ended: a write is
        acknowledged now, with its chunks' outcomes; a read's outcomes wait for its load's
        end. Returns the loads whose reads failed, as failed jobs (their copies were never
        started)."""
        failed: list[JobResult] = []
        stats = self._stats
        for tier, res in ended:
            bad = res.outcomes != Outcome.OK
            per_chunk = [int(b) for b in bad]
            n_bad = int(bad.sum())
            if res.kind == "write":
                ack = self._acks.setdefault(res.job_id, [0, 0])
                ack[0] += 1
                ack[1] += 1 if n_bad else 0
                (self._redis_failed if tier == "redis" else self._disk_failed)[res.job_id] = (
                    per_chunk
                )
                _add(stats, f"{tier}_write_bytes", res.nbytes)
                _add(stats, f"{tier}_write_seconds", res.seconds)
                _add(stats, f"{tier}_writes_failed", n_bad)
                continue
            if tier == "disk":
                per_chunk = self._disk_read_report(res, bad, per_chunk)
            _add(stats, f"{tier}_read_bytes", res.nbytes)
            _add(stats, f"{tier}_read_seconds", res.seconds)
            _add(stats, f"{tier}_reads_failed", n_bad)
            _add(stats, f"{tier}_chunks_corrupt", int(np.isin(res.outcomes, _CORRUPT).sum()))
            load = self._load_req.get(res.job_id)
            if load is None:
                # Reads are only sent for this worker's loads, which end once: a bug.
                self._log.error("read_for_unknown_load", tier=tier, job_id=res.job_id)
                continue
            self._read_outcomes[(tier, res.job_id)] = per_chunk
            if n_bad:
                outcomes = sorted({Outcome(int(o)).name for o in res.outcomes[bad]})
                log = self._log.debug if self._disk_load_failure_logged else self._log.warning
                self._disk_load_failure_logged = True
                log(
                    f"{tier}_load_failed",
                    job_id=res.job_id,
                    chunks_failed=n_bad,
                    outcomes=outcomes,
                    note=f"logged once; later ones are counted ({tier}_reads_failed)",
                )
                failed.append(
                    JobFailed(
                        job_id=res.job_id,
                        direction="load",
                        error=f"{n_bad} of {len(per_chunk)} chunks not read from {tier}: "
                        + ", ".join(outcomes),
                        block_ids=tuple(load[1]),
                        num_blocks=len(load[1]),
                        reason=tier,
                    )
                )
        return failed

    def _disk_read_report(self, res: DiskJobResult, bad: Any, per_chunk: list[int]) -> list[int]:
        """A disk read's per-chunk report: a chunk that failed counts 1 when this rank no
        longer holds it (its store forgot it: corrupt, absent, another fingerprint's,
        deleted for an error that says the file is bad; no disk tier here), else
        :data:`~._metadata.KEPT` (a transient error: EMFILE, ENOMEM, EINTR...; a job
        aborted). Asked of the store, not read from the outcome: ``IO_ERROR`` is either.
        Nothing else changes the key meanwhile: the scheduler neither deletes nor writes
        a chunk a load still reads (it is pinned)."""
        keys = self._disk_read_keys.pop(res.job_id, None)
        store = self.disk
        if keys is None or store is None or len(keys) != len(per_chunk):
            return per_chunk
        for i in np.flatnonzero(bad).tolist():
            if bytes(keys[i]) in store:
                per_chunk[i] = KEPT
        return per_chunk

    def take_failed_recving(self) -> set[str]:
        """Requests whose load failed, reported whole (several KV-cache groups); each is
        also in ``finished_recving`` of the same or an earlier ``get_finished``."""
        failed, self._failed_recving = self._failed_recving, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_worker_meta(self) -> KVFerryWorkerMetadata | None:
        if not (self._acks or self._stats or self._disk_failed or self._redis_failed):
            return None
        meta = KVFerryWorkerMetadata(
            acks=self._acks,
            stats=self._stats,
            disk_failed=self._disk_failed,
            redis_failed=self._redis_failed,
        )
        self._acks, self._stats, self._disk_failed, self._redis_failed = {}, {}, {}, {}
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
        if self.disk is not None:
            self.disk.close()  # after the actors: no I/O runs; the next engine may take it


def _add(stats: dict[str, float], key: str, value: float) -> None:
    stats[key] = stats.get(key, 0.0) + value


def _not_run(job_id: int, kind: Literal["read", "write"], n: int) -> DiskJobResult:
    """A disk job this worker cannot run (it has no disk tier): every chunk aborted."""
    return DiskJobResult(
        job_id=job_id,
        kind=kind,
        outcomes=np.full(n, Outcome.ABORTED, dtype=np.int8),
        nbytes=0,
        seconds=0.0,
    )


async def _tell_all(ref: ActorRef[DiskIOMsg], msgs: list[DiskIOMsg]) -> None:
    for msg in msgs:
        await ref.tell(msg)
