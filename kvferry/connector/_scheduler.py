"""The scheduler half of the connector: the orchestration of vLLM's scheduler calls.

Who owns what: everything here runs on vLLM's engine thread, in the engine-core process.
:class:`SchedulerSide` owns the per-request and per-job state (``_requests.py``: offload
keys, engine block ids, jobs in flight); the host tier's directory is owned by the
:class:`~kvferry.cache.DirectoryActor`, reached through the sync runtime with one call per
vLLM call. The sizes come from ``_geometry.py`` (shared with the worker half); which
engine block pairs with which host row is the pure planner's (``_planner.py``); the
writes from host memory to the tiers below it are :class:`~._writes.TierWrites`'s; its
counters and the report built from them once per step are ``_report.py``'s (every name
from the one table of metric names, ``kvferry/_metrics.py``).

A key is the chained block hash vLLM computed at the last token of an offloaded block,
followed by the KV-cache group index (4 bytes, big-endian): the bytes vLLM's own
offloading uses, deterministic across processes of one engine.

Hybrid models (several KV-cache groups): a full-attention group needs every block of a
hit; a sliding-window group only the blocks of its trailing window, so its lookup scans
for the last run of ``window`` ready blocks below the full-attention hit, and its load
fills only the blocks vLLM allocated (the others are vLLM's null block). vLLM frees a
sliding-window block while its request still runs; a store still reading one is fenced
(``flush_job_ids``) in the step that hands the block to another request.
"""

from __future__ import annotations

import operator
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from itertools import chain, repeat
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .. import traces
from .._config import DiskTierConfig, FerryConfig, RedisTierConfig
from .._errors import ActorCrashed, ActorStopped, InvariantError
from .._logging import get_logger
from ..actors import ActorRef, ActorSystem, start_runtime
from ..cache import (
    CompleteLoad,
    CompleteStore,
    DirectoryMsg,
    Fact,
    Facts,
    GetStatistics,
    Lease,
    LoadLeased,
    LookupAndPin,
    PrepareLoad,
    PrepareStore,
    ResetCache,
    TakeEvents,
    Touch,
    Unpin,
    spawn_host_tier,
    to_vllm_events,
)
from ..transfer import CopyJob
from ._blockinfo import BlockBook, group_specs
from ._disk_tier import DiskTier, engine_owner
from ._geometry import largest_stage, plan_geometry, windowed_hit
from ._metadata import DiskChunks, JobSpec, KVFerryMetadata, KVFerryWorkerMetadata
from ._planner import (
    NULL_BLOCK,
    failed_load_parts,
    load_parts,
    plan_load,
    plan_store,
    storable_chunks,
)
from ._redis_tier import RedisTier
from ._report import COUNTS, Report, SchedulerStatistics
from ._requests import DiskLease, JobState, ReqState, parse_request_params
from ._tiers import check_hash_algo, disk_fingerprint
from ._writes import TierWrites

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


_NONE = np.zeros(0, np.bool_)


class SchedulerSide:
    """``clock``: seconds, monotonic; load deadlines are measured on it (tests inject one)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        cfg: FerryConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self._clock = clock
        self.world_size = vllm_config.parallel_config.world_size
        self.geometry = plan_geometry(
            cfg,
            kv_cache_config,
            vllm_config.cache_config.block_size,
            self.world_size,
            stage_layers=largest_stage(vllm_config),
        )
        self._log = get_logger("kvferry.connector", role="scheduler")
        self._store_decoded = cfg.store_decoded and not self.geometry.frees_decoded
        """``store_decoded``, unless vLLM frees this model's decoded blocks mid-request."""
        if cfg.store_decoded and self.geometry.frees_decoded:
            self._log.warning(
                "store_decoded_off",
                reason="vLLM frees this model's decoded blocks between the prompt and its "
                "window (R-SWA) while a store could still read them: prompt blocks only",
            )
        self._reqs: dict[str, ReqState] = {}
        self._storing: dict[str, ReqState] = {}
        """The requests that may have chunks to store when next scheduled: all of them
        with ``store_decoded``; else those whose prompt is not all stored yet (a decode step
        passes over the others without a look)."""
        self._jobs: dict[int, JobState] = {}
        self._next_job_id = 1
        self._pending_loads: list[JobSpec] = []
        self._pending_stores: list[JobSpec] = []
        self._pending_releases: list[str] = []
        self._c: dict[str, Any] = dict.fromkeys(COUNTS, 0)

        self._stale_jobs: set[int] = set()
        self._fences: dict[int, set[int]] = {}
        """Engine block id -> store jobs still reading it (sliding-window groups)."""
        self._load_reused: set[int] = set()
        """Fenced blocks vLLM allocated for loads in this schedule pass."""
        self._group_suffixes = [g.to_bytes(4, "big") for g in range(self.geometry.num_groups)]
        self._loading: Counter[bytes] = Counter()
        """Key -> loads in flight filling it."""
        self._expired: dict[int, JobState] = {}
        """Loads ended at their deadline whose workers have not all reported yet."""
        self._pending_failed_loads: list[int] = []
        self._leases: dict[str, npt.NDArray[np.int64]] = {}
        """Request -> the slots its last lookup pinned, until its blocks are allocated (or
        this schedule pass ends without it)."""
        self._facts: list[Fact] = []
        """Tells to the directory held back until the next message to it (one Facts)."""
        num_slots = self.geometry.num_slots

        kv_events = getattr(vllm_config, "kv_events_config", None)
        self.events_enabled = bool(kv_events is not None and kv_events.enable_kv_cache_events)
        write_back = bool(cfg.tiers) and cfg.tiers[0].write == "on_evict"
        self._book = BlockBook(
            chunk_tokens=self.geometry.chunk_tokens,
            hashes_per_chunk=self.geometry.hashes_per_chunk,
            groups=group_specs(kv_cache_config),
            # on_evict: a stored block's facts are kept until it is written down (its
            # DISK event), so the book holds up to the whole host tier.
            max_entries=max(1 << 16, 2 * num_slots) if write_back else 1 << 16,
        )

        self.disk: DiskTier | None = None
        self.redis: RedisTier | None = None
        """The tiers below host memory: a disk, a Redis, or both (disk first). Their hits
        are read into host slots reserved at the lookup, then loaded with the rest."""
        self._disk_leases: dict[str, DiskLease] = {}
        """Request -> the disk part of its last lookup's hit: keys leased (pinned) in the
        disk tier, and the host slots reserved to read them into."""
        if cfg.tiers:
            check_hash_algo(vllm_config)
            geo = self.geometry
            fingerprints = [
                disk_fingerprint(vllm_config, kv_cache_config, geo.chunk_tokens, rank)
                for rank in range(self.world_size)
            ]
            for tier in cfg.tiers:
                if isinstance(tier, DiskTierConfig):
                    self.disk = DiskTier(
                        tier,
                        fingerprints,
                        max(geo.row_bytes, geo.slot_row_bytes) * geo.blocks_per_chunk,
                        events=self.events_enabled,
                        owner=engine_owner(vllm_config),
                    )
                    self.disk.scan()
                elif isinstance(tier, RedisTierConfig):
                    self.redis = RedisTier(
                        tier, fingerprints, events=self.events_enabled, clock=clock
                    )
        self._report = Report(
            self._c, self.disk, self.redis, lambda: self._ask(lambda r: GetStatistics(reply=r))
        )
        self._writes = TierWrites(
            disk=self.disk,
            redis=self.redis,
            book=self._book,
            counts=self._c,
            jobs=self._jobs,
            new_job_id=self._new_job_id,
            tell=self.directory_tell,
            ask=self._ask,
            world_size=self.world_size,
            events_enabled=self.events_enabled,
        )

        async def setup(system: ActorSystem) -> ActorRef[DirectoryMsg]:
            tier = await spawn_host_tier(
                system,
                num_slots,
                policy=cfg.eviction_policy,
                watermarks=cfg.eviction_watermarks,
                store_threshold=cfg.store_threshold,
                tracker_size=cfg.store_threshold_tracker_size,
                events=self.events_enabled,
                write_back=write_back,
            )
            return tier.directory

        self.runtime, self.directory = start_runtime(cfg.runtime, setup)
        self._provider = traces.setup(cfg.traces, role="scheduler")
        self.trace = traces.SchedulerTracer(self._provider)
        self._log.info(
            "scheduler_started",
            num_slots=num_slots,
            block_tokens=self.geometry.chunk_tokens,
            runtime=type(self.runtime).__name__,
        )

    # -- keys --------------------------------------------------------------------------

    def _keys(self, request: Request, first: int, end: int) -> list[bytes]:
        """Keys of chunks [first, end), all groups of a chunk together (built once per
        request: its block hashes only grow)."""
        st = self._reqs.get(request.request_id)
        keys = st.keys if st is not None else []
        G = self.geometry.num_groups
        built = len(keys) // G
        if end > built:
            hpc = self.geometry.hashes_per_chunk
            # A chunk's hash is its last block's.
            hashes = map(bytes, request.block_hashes[(built + 1) * hpc - 1 : end * hpc : hpc])
            suffixes = self._group_suffixes
            if len(suffixes) == 1:
                keys.extend(map(operator.add, hashes, repeat(suffixes[0])))
            else:
                keys.extend([h + suffix for h in hashes for suffix in suffixes])
        return keys[first * G : end * G]

    def _num_keyed_chunks(self, request: Request) -> int:
        return len(request.block_hashes) // self.geometry.hashes_per_chunk

    def _ask(self, make: Any) -> Any:
        if self._facts:
            self._send_facts()
        return self.runtime.ask(self.directory, make)

    def _ask_after_facts(
        self, make: Callable[[Any], LookupAndPin | PrepareLoad | PrepareStore]
    ) -> Any:
        """:meth:`_ask`, the facts held back going in the same message (one crossing)."""
        if not self._facts:
            return self.runtime.ask(self.directory, make)
        facts, self._facts = tuple(self._facts), []
        return self.runtime.ask(self.directory, lambda r: Facts(facts=facts, then=make(r)))

    def _send_facts(self) -> None:
        """The tells held back, in order, as one message (before any ask, and at the end
        of each schedule pass): the directory sees them before it answers anything."""
        facts, self._facts = self._facts, []
        msg: DirectoryMsg = facts[0] if len(facts) == 1 else Facts(facts=tuple(facts))
        self.runtime.tell(self.directory, msg)

    # -- vLLM calls --------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        self._reqs[request.request_id] = self._new_req(request)

    def _new_req(self, request: Request) -> ReqState:
        self.trace.request_started(request.request_id, trace_headers=request.trace_headers)
        load, store, error = parse_request_params(request.kv_transfer_params)
        if error is not None:
            self._log.error("bad_request_params", req_id=request.request_id, error=error)
        st = ReqState(request=request, block_ids=[], load=load, store=store, error=error)
        self._store_from(st, 0)
        return st

    def _store_from(self, st: ReqState, chunk: int) -> None:
        """Chunks from ``chunk`` on are to be offered for store (again): a new request, one
        resumed after preemption, a failed load's, a reset's."""
        st.stored_upto = min(st.stored_upto, chunk)
        if st.store and not st.finished:
            self._storing[st.request.request_id] = st

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        st = self._reqs.get(request.request_id)
        if st is None:  # a request vLLM added before the connector saw it
            st = self._reqs[request.request_id] = self._new_req(request)
        if not st.load or st.load_failed:
            st.lookup = st.counts = None
            return 0, False
        geo = self.geometry
        n_chunks = self._num_keyed_chunks(request)
        ct = geo.chunk_tokens
        if geo.hybrid:
            # vLLM recomputes the last prompt token of a sliding-window model.
            n_chunks = min(n_chunks, (request.num_tokens - 1) // ct)
        if n_chunks * ct <= num_computed_tokens:
            st.lookup = st.counts = None  # an earlier pass's counts are not this one's
            return 0, False
        # Chunks the engine already holds need no lookup: the hit starts after them.
        first = num_computed_tokens // ct
        keys = self._keys(request, first, n_chunks)
        t0 = time.time_ns()
        # The hit is pinned (leased) in the same message that finds it: nothing may evict
        # it before update_state_after_alloc turns the lease into the load's pins, and the
        # lease ends with this schedule() pass (build_connector_meta) if it does not.
        self._release_lease(request.request_id)
        below_host = self.disk is not None or self.redis is not None
        each = geo.hybrid or below_host
        lease: Lease = self._ask_after_facts(
            lambda r: LookupAndPin(keys=tuple(keys), each=each, reply=r)
        )
        below: npt.NDArray[np.bool_] | None = None  # held below host memory (disk, Redis)
        on_redis = _NONE  # read only with a tier below host memory
        if below_host:
            on_redis = np.zeros(len(keys), np.bool_)
            # The longest prefix held by host memory or a tier below, chunk by chunk.
            host = lease.ready if lease.ready is not None else np.zeros(len(keys), np.bool_)
            below = np.zeros(len(keys), np.bool_)
            if self.disk is not None:
                below = self.disk.ready(keys) & ~host
            if self.redis is not None:
                in_redis = self._redis_known(st, keys, host | below)
                if in_redis is None:  # its existence check is out: vLLM asks again next step
                    st.lookup = st.counts = None
                    self._unpin(lease.slots)
                    return None, False
                on_redis = in_redis & ~host & ~below
                below |= on_redis
            ready = host | below
            if geo.hybrid:
                hit_chunks = first + windowed_hit(ready.reshape(-1, geo.num_groups), geo.windows)
            else:
                leading = len(ready) if ready.all() else int(np.argmin(ready))
                hit_chunks = first + leading // geo.num_groups
        elif geo.hybrid:
            ready = lease.ready if lease.ready is not None else np.zeros(0, np.bool_)
            hit_chunks = first + windowed_hit(ready.reshape(-1, geo.num_groups), geo.windows)
        else:
            hit_chunks = first + lease.leading // geo.num_groups
        asked = n_chunks * ct - num_computed_tokens
        if (
            self._loading
            and hit_chunks > first
            and any(k in self._loading for k in keys[: (hit_chunks - first) * geo.num_groups])
        ):
            # Another request is loading some of these blocks: once its load ended they
            # are in the engine's own prefix cache, so wait for that instead of loading
            # them twice (vLLM asks again next step).
            st.lookup = st.counts = None
            self._c["lookups_deferred"] += 1
            self._unpin(lease.slots)
            return None, False
        disk_lease = None
        if below is not None and hit_chunks > first:
            hit_chunks, disk_lease = self._reserve_disk_hit(
                keys, first, hit_chunks, ready, below, on_redis
            )
        new_tokens = hit_chunks * ct - num_computed_tokens
        self.trace.lookup(
            request.request_id,
            tokens_asked=asked,
            tokens_hit=max(new_tokens, 0),
            tokens_local=num_computed_tokens,
            start_ns=t0,
        )
        # vLLM asks again while a request cannot be scheduled: the counters are taken
        # once, when the request is admitted (update_state_after_alloc).
        st.counts = (asked, max(new_tokens, 0))
        if new_tokens <= 0:
            st.lookup = None
            self._unpin(lease.slots)
            self._unpin_disk(disk_lease)
            return 0, False
        st.lookup = (num_computed_tokens, hit_chunks)
        if len(lease.slots):
            self._leases[request.request_id] = lease.slots
        st.disk_tokens = st.redis_tokens = 0
        if disk_lease is not None and below is not None:
            self._disk_leases[request.request_id] = disk_lease
            n = (hit_chunks - first) * geo.num_groups
            from_redis = on_redis[:n].reshape(-1, geo.num_groups).any(axis=1)
            from_disk = (below[:n] & ~on_redis[:n]).reshape(-1, geo.num_groups).any(axis=1)
            st.redis_tokens = int(from_redis.sum()) * ct
            st.disk_tokens = int((from_disk & ~from_redis).sum()) * ct
        return new_tokens, True

    def _redis_known(
        self, st: ReqState, keys: list[bytes], host: npt.NDArray[np.bool_]
    ) -> npt.NDArray[np.bool_] | None:
        """Which keys Redis holds, as far as its answers say; None while an existence
        check of keys that could extend the hit is out and ``lookup_wait_ms`` has not
        passed since this request first waited (then unanswered keys are misses)."""
        redis = self.redis
        if redis is None:
            return np.zeros(len(keys), np.bool_)
        present, unknown = redis.known(keys)
        unknown &= ~host
        if self.geometry.hybrid:
            open_ = unknown
        else:
            # Only keys before the first one known to be nowhere can extend the hit.
            nowhere = ~(host | present | unknown)
            end = int(np.argmax(nowhere)) if nowhere.any() else len(keys)
            open_ = unknown.copy()
            open_[end:] = False
        if not open_.any():
            st.redis_wait_since = None
            return present
        asked = [k for k, o in zip(keys, open_.tolist(), strict=True) if o]
        if st.redis_wait_since is not None and redis.answered_since(asked, st.redis_wait_since):
            # Answered since it began to wait, and the answers expired before vLLM came
            # back (a full batch): a new question, with a wait of its own, not a miss.
            st.redis_wait_since = None
        if st.redis_wait_since is None:
            st.redis_wait_since = self._clock()
        # Asked even when giving up: the answer serves the next lookup of these keys.
        redis.ask(asked)
        if redis.waited(st.redis_wait_since):
            redis.count_wait(gave_up=False)
            return None
        redis.count_wait(gave_up=True)
        st.redis_wait_since = None
        return present

    def _reserve_disk_hit(
        self,
        keys: list[bytes],
        first: int,
        hit_chunks: int,
        ready: npt.NDArray[np.bool_],
        below: npt.NDArray[np.bool_],
        on_redis: npt.NDArray[np.bool_],
    ) -> tuple[int, DiskLease | None]:
        """The part of a hit below host memory (``below``: on disk or, ``on_redis``, in
        Redis): its disk chunks leased in the disk tier (not evicted before their load),
        and host slots reserved for all of it now (STORING: the load reads into them,
        neither a hit nor evictable meanwhile). The hit is cut before the first chunk no
        host slot is left for: the hit announced can always be loaded. Returns the hit
        (chunks) and the lease."""
        geo = self.geometry
        G = geo.num_groups
        idx = np.flatnonzero(below[: (hit_chunks - first) * G])
        if not len(idx):
            return hit_chunks, None
        dkeys = [keys[i] for i in idx.tolist()]
        reserved = self._ask(lambda r: PrepareStore(keys=tuple(dkeys), admit=False, reply=r))
        self._report.dirty = True
        short = reserved < 0
        if short.any():
            cut = int(idx[int(np.argmax(short))]) // G  # chunks before the first one short
            if geo.hybrid:
                cut_ready = ready.copy()
                cut_ready[cut * G :] = False
                hit_chunks = first + windowed_hit(cut_ready.reshape(-1, G), geo.windows)
            else:
                hit_chunks = first + cut
            short_key = int(idx[int(np.argmax(short))])
            self._c["redis_hits_cut" if on_redis[short_key] else "disk_hits_cut"] += 1
            keep = idx < (hit_chunks - first) * G
            drop = reserved[~keep]
            drop = drop[drop >= 0]
            if len(drop):
                self.directory_tell(CompleteStore(slots=drop, ok=False))
            dkeys = [k for k, kept in zip(dkeys, keep.tolist(), strict=True) if kept]
            reserved = reserved[keep]
            if not dkeys:
                return hit_chunks, None
        n = (hit_chunks - first) * G
        from_redis = frozenset(keys[i] for i in np.flatnonzero(on_redis[:n]).tolist())
        pins = np.zeros(0, np.int64)
        if self.disk is not None:
            pins = self.disk.lease([k for k in dkeys if k not in from_redis])
        return hit_chunks, (dkeys, pins, reserved, from_redis)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        if st.counts is not None:
            asked, hit = st.counts
            st.counts = None
            hit = min(hit, num_external_tokens)
            self._c["tokens_looked_up"] += asked
            self._c["tokens_hit"] += hit
            self._c["tokens_missed"] += asked - hit
            if num_external_tokens:
                self._c["disk_tokens_hit"] += min(st.disk_tokens, hit)
                self._c["redis_tokens_hit"] += min(st.redis_tokens, hit - min(st.disk_tokens, hit))
        lease = self._leases.pop(request.request_id, None)
        disk_lease = self._disk_leases.pop(request.request_id, None)
        if num_external_tokens == 0:
            st.lookup = None
            if lease is not None:
                self._unpin(lease)
            self._unpin_disk(disk_lease)
            return
        if self._fences:
            # The blocks vLLM allocated for this load: a sliding-window block it freed
            # mid-request, which a store still reads, may be among them, and this
            # request is in none of the step's scheduled lists (build_connector_meta).
            fences = self._fences
            self._load_reused.update(
                b for ids in blocks.get_block_ids() for b in ids if b in fences
            )
        if disk_lease is not None and (st.lookup is None or st.load_job is not None):
            self._unpin_disk(disk_lease)  # the load fails below: nothing reads the disk
            disk_lease = None
        # Invariants of this bookkeeping (docs/architecture.md, "Invariants"): a load
        # follows the positive lookup that announced it, for the tokens announced, and a
        # request has one load at a time. Broken, the load fails and vLLM recomputes.
        if st.lookup is None:
            error = InvariantError("load_without_lookup", "external tokens never announced")
            self._fail_load(st, blocks, lease, error, num_external_tokens=num_external_tokens)
            return
        if st.load_job is not None:
            error = InvariantError("second_load", f"load {st.load_job} still in flight")
            self._fail_load(st, blocks, lease, error, num_external_tokens=num_external_tokens)
            return
        num_local, hit_chunks = st.lookup
        st.lookup = None
        geo = self.geometry
        ct = geo.chunk_tokens
        end_tok = num_local + num_external_tokens
        if end_tok != hit_chunks * ct:
            error = InvariantError(
                "load_of_other_tokens", f"{num_external_tokens} tokens after {num_local}"
            )
            self._unpin_disk(disk_lease)
            self._fail_load(st, blocks, lease, error, announced=hit_chunks * ct - num_local)
            return
        plan = plan_load(geo, blocks.get_block_ids(), num_local, hit_chunks)
        first_chunk = plan.first_chunk
        keys = plan.wanted_keys(self._keys(request, first_chunk, hit_chunks))
        release = lease if lease is not None else np.zeros(0, np.int64)
        # Chunks only below host memory (on disk, or in Redis): read into host slots
        # reserved at the lookup, then loaded with the rest.
        dmask = _NONE
        if disk_lease is None:  # all in host memory (always, without lower tiers)
            host_keys, disk_keys = keys, []
        else:
            from_disk = set(disk_lease[0])
            dmask = np.fromiter((k in from_disk for k in keys), np.bool_, len(keys))
            host_keys = [k for k, d in zip(keys, dmask.tolist(), strict=True) if not d]
            disk_keys = [k for k, d in zip(keys, dmask.tolist(), strict=True) if d]
        if disk_lease is None and not geo.hybrid and len(release) >= len(host_keys):
            # The lease pins the hit's leading keys in order, and the load takes its whole
            # chunks: the first of the leased slots are the load's, already pinned.
            found = release[: len(host_keys)]
            self.directory_tell(LoadLeased(slots=found))
            self._unpin(release[len(host_keys) :])
        else:
            found = self._ask_after_facts(
                lambda r: PrepareLoad(keys=tuple(host_keys), release=release, reply=r)
            )
        if found is None:
            # The lookup's lease kept these keys READY since; only a reset in between
            # (which vLLM does not do inside one schedule pass) gets here.
            self._unpin_disk(disk_lease)
            error = InvariantError("load_keys_vanished", "a leased hit is no longer ready")
            self._fail_load(st, blocks, None, error, keys=len(keys))
            return
        reserved = np.zeros(0, np.int64)
        if disk_lease is not None:
            # The host slots reserved at the lookup; those of chunks vLLM did not allocate
            # (a sliding window's) are given back.
            reserved_of = dict(zip(disk_lease[0], disk_lease[2].tolist(), strict=True))
            reserved = np.array([reserved_of.pop(k) for k in disk_keys], np.int64)
            if reserved_of:
                self.directory_tell(CompleteStore(slots=list(reserved_of.values()), ok=False))
        job_id = self._new_job_id()
        if disk_lease is None:
            both = found
        else:
            both = np.empty(len(keys), np.int64)
            both[~dmask] = found
            both[dmask] = reserved
        parts = load_parts(geo, plan, both)
        redis_keys: list[bytes] = []
        redis_slots = np.zeros(0, np.int64)
        if disk_keys:
            from_redis = disk_lease[3] if disk_lease is not None else frozenset()
            rmask = np.fromiter((k in from_redis for k in disk_keys), np.bool_, len(disk_keys))
            redis_keys = [k for k, r in zip(disk_keys, rmask.tolist(), strict=True) if r]
            disk_keys = [k for k, r in zip(disk_keys, rmask.tolist(), strict=True) if not r]
            redis_slots, reserved = reserved[rmask], reserved[~rmask]
        facts: tuple[bytes, ...] = ()
        if self.events_enabled and len(reserved) + len(redis_slots):
            # Chunks read from below enter host memory (and, from Redis, maybe the disk):
            # their KV events need the request's facts, kept until the reads ended.
            self._book.record_chunks(request, first_chunk, hit_chunks)
            facts = tuple(self._keys(request, first_chunk, hit_chunks))
        self._jobs[job_id] = JobState(
            job_id=job_id,
            req_id=request.request_id,
            is_store=False,
            slots=found,
            tokens=num_external_tokens,
            keys=tuple(keys),
            deadline=self._clock() + self.cfg.job_timeout_s,
            disk_keys=tuple(disk_keys),
            disk_host_slots=reserved,
            disk_slots=disk_lease[1] if disk_lease is not None else np.zeros(0, np.int64),
            redis_keys=tuple(redis_keys),
            redis_host_slots=redis_slots,
            first_chunk=first_chunk,
            event_keys=facts,
        )
        self._loading.update(keys)  # counted in C
        st.load_job = job_id
        st.stored_upto = max(st.stored_upto, hit_chunks)
        tp = self.trace.job_planned(
            request.request_id,
            job_id,
            direction="load",
            blocks=sum(len(p.device_blocks) for p in parts),
            tokens=num_external_tokens,
        )
        self._pending_loads.append(
            JobSpec(
                req_id=request.request_id,
                copy=CopyJob(job_id=job_id, direction="load", parts=parts),
                traceparent=tp,
                disk_reads=DiskChunks(keys=disk_keys, slots=reserved) if disk_keys else None,
                redis_reads=(
                    DiskChunks(keys=redis_keys, slots=redis_slots) if redis_keys else None
                ),
            )
        )

    def _unpin_disk(self, disk_lease: DiskLease | None) -> None:
        """Release a disk lease: its pins in the disk tier, its reserved host slots."""
        if disk_lease is None:
            return
        if self.disk is not None:
            self.disk.unpin(disk_lease[1])
        if len(disk_lease[2]):
            self.directory_tell(CompleteStore(slots=disk_lease[2], ok=False))

    def _fail_load(
        self,
        st: ReqState,
        blocks: KVCacheBlocks,
        lease: npt.NDArray[np.int64] | None,
        error: InvariantError | str,
        **context: Any,
    ) -> None:
        """vLLM allocated blocks for a load this bookkeeping cannot plan (a broken
        invariant: a bug). Logged once; a load job that copies nothing is planned failed
        (``failed_load_job_ids``): the workers report every block vLLM allocated for the
        request invalid with its ``finished_recving``, so vLLM frees them and schedules the
        request again from its local prefix cache (or fails it, with ``on_load_failure:
        fail``). The engine keeps running."""
        req_id = st.request.request_id
        st.lookup = None
        st.load_failed = True
        if lease is not None:
            self._unpin(lease)
        if isinstance(error, InvariantError):
            self._log.error(
                "invariant_broken",
                invariant=error.invariant,
                error=str(error),
                req_id=req_id,
                **context,
            )
        else:
            self._log.warning("load_not_planned", reason=error, req_id=req_id, **context)
        job_id = self._new_job_id()
        parts = failed_load_parts(blocks.get_block_ids())
        self._jobs[job_id] = JobState(
            job_id=job_id,
            req_id=req_id,
            is_store=False,
            slots=np.zeros(0, np.int64),
            tokens=0,
            failed=True,
            unplanned=True,
            deadline=self._clock() + self.cfg.job_timeout_s,
        )
        if st.load_job is None:
            st.load_job = job_id
        tp = self.trace.job_planned(req_id, job_id, direction="load", blocks=0, tokens=0)
        self.trace.failed(reason=str(error), req_id=req_id, job_id=job_id)
        self._pending_loads.append(
            JobSpec(
                req_id=req_id,
                copy=CopyJob(job_id=job_id, direction="load", parts=parts),
                traceparent=tp,
            )
        )
        self._pending_failed_loads.append(job_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVFerryMetadata:
        # Leases of lookups whose requests vLLM did not allocate in this schedule pass
        # (no free blocks, a budget, an abort): it asks again in a later step.
        if self._leases:
            leases, self._leases = self._leases, {}
            self._unpin(np.concatenate(list(leases.values())))
        if self._disk_leases:
            disk_leases, self._disk_leases = self._disk_leases, {}
            for disk_lease in disk_leases.values():
                self._unpin_disk(disk_lease)
        self._expire_loads()

        fences, reqs = self._fences, self._reqs
        # Blocks vLLM handed to loads in this pass (update_state_after_alloc): those
        # requests are in none of the step's scheduled lists.
        reused, self._load_reused = self._load_reused, set()
        flush: set[int] = set()
        # A preempted request's blocks went back to vLLM (and may be handed out in this
        # very step): its stores in flight are flushed, and its table starts again when
        # it is scheduled again, whole (Model Runner V1 names it resumed; V2 sends it
        # among the new requests).
        for req_id in scheduler_output.preempted_req_ids or ():
            st = reqs.get(req_id)
            if st is not None:
                flush.update(st.store_jobs)
                st.block_ids = []
                self._store_from(st, 0)  # stored chunks are skipped as present
        cached = scheduler_output.scheduled_cached_reqs
        resumed_ids = cached.resumed_req_ids
        # vLLM's order (yield_req_data's): new requests, then the cached ones; a cached
        # request with no new block (most of a decode step's) has None and is passed over.
        for req_id, new_block_ids, resumed in chain(
            ((r.req_id, r.block_ids, False) for r in scheduler_output.scheduled_new_reqs),
            (
                (req_id, ids, req_id in resumed_ids)
                for req_id, ids in zip(cached.req_ids, cached.new_block_ids, strict=True)
                if ids is not None or req_id in resumed_ids
            ),
        ):
            if fences and new_block_ids:
                reused.update(b for ids in new_block_ids for b in ids if b in fences)
            st = reqs.get(req_id)
            if st is None:
                continue
            if resumed or not st.block_ids:
                st.block_ids = [list(g) for g in new_block_ids] if new_block_ids else []
                if resumed:
                    self._store_from(st, 0)  # stored chunks are skipped as present
            elif new_block_ids is not None:
                for g, ids in enumerate(new_block_ids):
                    st.block_ids[g].extend(ids)

        # Sliding-window blocks vLLM freed mid-request and hands out again this step.
        for block in reused:
            flush.update(fences.get(block, ()))
        self._c["stores_fenced"] += len(flush)

        plans = []
        storing, ct, decoded = self._storing, self.geometry.chunk_tokens, self._store_decoded
        stored: list[str] = []
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            st = storing.get(req_id)
            if st is None:
                continue
            request = st.request
            computed_after = request.num_computed_tokens + n
            # Most requests decode with every chunk they can store stored: no call for them.
            tokens = computed_after if decoded else min(computed_after, request.num_prompt_tokens)
            if tokens // ct > st.stored_upto:
                plan = self._plan_store(st, computed_after, st.block_ids)
                if plan is not None:
                    plans.append(plan)
            if not decoded and st.stored_upto >= request.num_prompt_tokens // ct:
                stored.append(req_id)  # its whole prompt: nothing more to store
        for req_id in stored:
            del storing[req_id]
        self._prepare_stores(plans)
        if self.disk is not None and self.disk.write_back:
            self._writes.demote()
        if self.redis is not None:
            self.redis.flush()  # this step's existence checks, one batch

        meta = KVFerryMetadata(
            loads=self._pending_loads,
            stores=self._pending_stores,
            flush_job_ids=sorted(flush),
            release_req_ids=self._pending_releases,
            failed_load_job_ids=self._pending_failed_loads,
        )
        self._pending_loads, self._pending_stores, self._pending_releases = [], [], []
        self._pending_failed_loads = []
        if self.disk is not None:
            meta.disk_deletes = self.disk.take_deletes()
            meta.disk_writes, self._writes.disk_writes = self._writes.disk_writes, []
        meta.redis_writes, self._writes.redis_writes = self._writes.redis_writes, []
        if self._facts:
            self._send_facts()
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVFerryWorkerMetadata):
            self._ack(meta)
        for req_id in output.finished_sending or ():
            st = self._reqs.get(req_id)
            if st is not None and st.finished and not st.store_jobs:
                del self._reqs[req_id]
        for req_id in output.finished_recving or ():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            if st.load_job is not None:
                expired = self._expired.get(st.load_job)
                if expired is None:
                    continue  # (acknowledged above, in the same output, when it ended)
                # Ended at its deadline, and given up by every worker while its chunks
                # were still read (WorkerSide._give_up): vLLM recomputes the blocks now,
                # while the acknowledgement, which frees the host slots those reads
                # write into, waits for them to end (_ack_expired).
                st.load_job = None
                self._store_again(st, expired)
            if st.finished:
                del self._reqs[req_id]

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.get(request.request_id)
        if st is None:
            return False, None
        st.finished = True
        self._storing.pop(request.request_id, None)
        self._release_lease(request.request_id)
        info: dict[str, Any] = {"tokens_loaded": st.tokens_loaded}
        if st.error is not None:
            info["error"] = st.error
        params = {"kvferry": info}
        if st.keys:
            # Recency for the policy, as vLLM's own offloading applies it when a request
            # finishes: its blocks (loaded, stored, or present) were just used.
            self.directory_tell(Touch(keys=tuple(st.keys)))
            if self.disk is not None:
                self.disk.dir.touch(st.keys)
        if st.load_job is not None:
            # Aborted while its load runs: vLLM frees the blocks at finished_recving.
            self.trace.request_finished(request.request_id)
            return True, params
        # The last full blocks, computed in the final step.
        plan = self._plan_store(st, request.num_computed_tokens, block_ids)
        if plan is not None:
            self._prepare_stores([plan])
        # After that store's job is in the journey: it ends with the last job.
        self.trace.request_finished(request.request_id)
        if st.store_jobs:
            self._pending_releases.append(request.request_id)
            return True, params
        del self._reqs[request.request_id]
        return False, params

    def kv_connector_stats(self) -> dict[str, Any] | None:
        """Counter increments since the last call, and current gauges (vLLM's stats channel)."""
        return self._report.take(busy=bool(self._jobs or self._reqs))

    def reset(self) -> bool:
        """Clear the host tier. Jobs in flight end normally; stores that were in flight are
        then discarded instead of becoming visible."""
        dropped = self._ask(lambda r: ResetCache(reply=r))
        if self.disk is not None:
            # Its files are deleted with the next step (take_deletes); writes in flight
            # end unseen.
            dropped += self.disk.reset()
        if self.redis is not None:
            self.redis.reset()  # its answers only: the chunks are shared with other engines
        self._report.dirty = True
        self._stale_jobs.update(j for j, job in self._jobs.items() if job.is_store)
        for st in self._reqs.values():
            if self.geometry.hybrid:
                self._drop_passed_sliding_blocks(st)
            self._store_from(st, 0)
        self._log.info("cache_reset", dropped=dropped, stores_in_flight=len(self._stale_jobs))
        return True

    def _drop_passed_sliding_blocks(self, st: ReqState) -> None:
        """Before a running request's chunks are offered for store again from its first
        (a reset): the blocks its sliding-window groups held for the chunks it passed may
        have left the window since, and vLLM frees those and hands them to other
        requests (it nulls them in its own table; the connector sees only new ids). They
        become null blocks here: those chunks are not stored again for these groups (a
        hit on the prefix needs them again only once another request stored them)."""
        geo = self.geometry
        passed = st.stored_upto * geo.blocks_per_chunk
        for g, window in enumerate(geo.windows):
            if window is not None and g < len(st.block_ids):
                ids = st.block_ids[g]
                n = min(passed, len(ids))
                ids[:n] = [NULL_BLOCK] * n

    def take_events(self) -> list[Any]:
        """This step's KV events (BlockStored / BlockRemoved; medium CPU, DISK, REDIS)."""
        if not self.events_enabled:
            return []
        events = self._ask(lambda r: TakeEvents(reply=r))
        for tier in (self.disk, self.redis):
            if tier is not None:
                events = list(events) + tier.take_events()
        out = to_vllm_events(events, describe=self._book.describe)
        self._book.drop_retired()  # every store retired so far had its event in these
        return out

    def has_pending_work(self) -> bool:
        return bool(
            self._jobs
            or self._pending_loads
            or self._pending_stores
            or self._pending_releases
            or self._pending_failed_loads
            or self._writes.disk_writes
            or self._writes.redis_writes
        )

    def statistics(self) -> SchedulerStatistics:
        directory = self._ask(lambda r: GetStatistics(reply=r))
        disk = self.disk.statistics() if self.disk is not None else None
        redis = self.redis.statistics() if self.redis is not None else None
        return SchedulerStatistics(
            jobs_in_flight=len(self._jobs), directory=directory, disk=disk, redis=redis, **self._c
        )

    def shutdown(self) -> None:
        self.trace.close_all()
        if self._provider is not None:
            self._provider.shutdown()
        if self._facts:
            try:
                self._send_facts()
            except (ActorCrashed, ActorStopped) as exc:  # the directory goes with the runtime
                self._log.warning("facts_not_delivered_at_shutdown", error=repr(exc))
        self.runtime.close()
        if self.redis is not None:
            self.redis.close()

    # -- internals ---------------------------------------------------------------------

    def _new_job_id(self) -> int:
        job_id = self._next_job_id
        self._next_job_id += 1
        return job_id

    def _plan_store(
        self, st: ReqState, computed_tokens: int, block_ids: Sequence[Sequence[int]]
    ) -> tuple[ReqState, int, int, Sequence[Sequence[int]]] | None:
        if not st.store:
            return None
        geo = self.geometry
        if not self._store_decoded:
            computed_tokens = min(computed_tokens, st.request.num_prompt_tokens)
        upto = storable_chunks(geo, computed_tokens, self._num_keyed_chunks(st.request), block_ids)
        if upto <= st.stored_upto:
            return None
        first, st.stored_upto = st.stored_upto, upto
        return st, first, upto, block_ids

    def _prepare_stores(
        self, plans: Iterable[tuple[ReqState, int, int, Sequence[Sequence[int]]]]
    ) -> None:
        """One PrepareStore for all planned chunks; a job per request for the admitted ones."""
        plans = list(plans)
        all_keys: list[bytes] = []
        for st, first, upto, _ in plans:
            all_keys.extend(self._keys(st.request, first, upto))
            if self.events_enabled:
                self._book.record_chunks(st.request, first, upto)
        if not all_keys:
            return
        slots_all = self._ask_after_facts(lambda r: PrepareStore(keys=tuple(all_keys), reply=r))
        self._report.dirty = True
        geo = self.geometry
        G = geo.num_groups
        pos = 0
        for st, first, upto, block_ids in plans:
            n = (upto - first) * G
            keys_of = all_keys[pos : pos + n]
            plan = plan_store(
                geo, first, block_ids, slots_all[pos : pos + n].reshape(upto - first, G), keys_of
            )
            plan_keys = tuple(keys_of) if self.events_enabled else ()
            pos += n
            if plan.dead:
                self.directory_tell(CompleteStore(slots=plan.dead, ok=False))
            if not plan.parts:
                self._book.retire(plan_keys)
                continue
            job_id = self._new_job_id()
            self._jobs[job_id] = JobState(
                job_id=job_id,
                req_id=st.request.request_id,
                is_store=True,
                slots=plan.slots,
                tokens=plan.tokens,
                fenced=plan.fenced,
                keys=plan.keys if self.disk is not None or self.redis is not None else (),
                event_keys=plan_keys,
            )
            for block in plan.fenced:
                self._fences.setdefault(block, set()).add(job_id)
            st.store_jobs.add(job_id)
            tp = self.trace.job_planned(
                st.request.request_id,
                job_id,
                direction="store",
                blocks=sum(len(p.device_blocks) for p in plan.parts),
                tokens=plan.tokens,
            )
            self._pending_stores.append(
                JobSpec(
                    req_id=st.request.request_id,
                    copy=CopyJob(job_id=job_id, direction="store", parts=plan.parts),
                    traceparent=tp,
                )
            )

    def directory_tell(self, msg: Fact) -> None:
        """Tell the directory ``msg``, with the next message to it (:meth:`_send_facts`)."""
        self._facts.append(msg)

    def _unpin(self, slots: npt.NDArray[np.int64]) -> None:
        if len(slots):
            self.directory_tell(Unpin(slots=slots))

    def _release_lease(self, req_id: str) -> None:
        lease = self._leases.pop(req_id, None)
        if lease is not None:
            self._unpin(lease)
        self._unpin_disk(self._disk_leases.pop(req_id, None))

    def _expire_loads(self) -> None:
        """End, as failed, every load still unacknowledged at its deadline (invariant 7).

        Its keys stop holding back other requests' lookups (they load the blocks
        themselves), its host slots are unpinned, and the workers are told
        (``failed_load_job_ids``) to report its engine blocks invalid however the copy
        ends — a slot unpinned now may be overwritten while a late copy still reads it.
        The request keeps waiting for the workers' ``finished_recving``, which only a copy
        that ended sends: nothing writes to blocks vLLM recomputes.
        """
        now = self._clock()
        late = [j for j in self._jobs.values() if not j.is_store and j.deadline <= now]
        for job in late:
            del self._jobs[job.job_id]
            self._expired[job.job_id] = job
            st = self._reqs.get(job.req_id)
            if st is not None:
                st.load_failed = True
            self._pending_failed_loads.append(job.job_id)
            self._release_keys(job)
            valid = job.slots[job.slots >= 0]
            if len(valid):
                self.directory_tell(CompleteLoad(slots=valid))
            # Its disk chunks' host slots stay reserved until every worker reported: a late
            # read still writes into them (_ack_expired ends them).
            self._report.dirty = True
            self._count_failed_load(job, expired=True)
            reason = f"no worker reported it within job_timeout_s={self.cfg.job_timeout_s}"
            self._log.error(
                "load_deadline_exceeded",
                job_id=job.job_id,
                req_id=job.req_id,
                acks=job.acks,
                world_size=self.world_size,
            )
            self.trace.job_ended(job.job_id, ok=False, error=reason)

    def _release_keys(self, job: JobState) -> None:
        if job.is_store:  # a store's keys (write-through) hold back no lookup
            return
        for k in job.keys:
            n = self._loading.pop(k) - 1
            if n:
                self._loading[k] = n

    def _ack_expired(self, job: JobState, done: int) -> None:
        """A worker reported a load that already ended at its deadline: all counted then."""
        job.acks += done
        if job.acks < self.world_size:
            return
        del self._expired[job.job_id]
        self._writes.reads_ended(job)
        st = self._reqs.get(job.req_id)
        if st is not None and st.load_job == job.job_id:  # (else vLLM had it given up)
            self._store_again(st, job)
            st.load_job = None

    def _count_failed_load(self, job: JobState, *, expired: bool = False) -> None:
        """Count a load that failed, and its cause: the first that applies of the
        scheduler not planning it, its deadline passing unreported (``expired``), a chunk
        of its disk reads failing, one of its Redis reads, and its copy. A worker whose
        read of a tier failed starts no copy, so a load's copy fails only where every
        read succeeded."""
        if job.unplanned:
            cause = "loads_failed_unplanned"
        elif expired:
            cause = "loads_failed_deadline"
        elif job.disk_failed is not None and job.disk_failed.any():
            cause = "disk_loads_failed"
        elif job.redis_failed is not None and job.redis_failed.any():
            cause = "redis_loads_failed"
        else:
            cause = "loads_failed_copy"
        self._c["loads_failed"] += 1
        self._c[cause] += 1

    def _store_again(self, st: ReqState | None, job: JobState) -> None:
        """A load failed: vLLM recomputes its blocks, and they are offered to the store
        again (those still held are skipped as present)."""
        if st is not None and job.first_chunk is not None:
            self._store_from(st, job.first_chunk)

    def _ack(self, meta: KVFerryWorkerMetadata) -> None:
        for key, value in meta.stats.items():
            if key in self._c:
                self._c[key] += value
        for name, per_job in (
            ("disk_failed", meta.disk_failed),
            ("redis_failed", meta.redis_failed),
        ):
            for job_id, counts in per_job.items():
                reported = self._jobs.get(job_id) or self._expired.get(job_id)
                if reported is None:
                    continue
                arr = np.asarray(counts, np.int64)
                have = getattr(reported, name)
                if have is None:
                    setattr(reported, name, arr)
                elif len(have) == len(arr):
                    setattr(reported, name, have + arr)
        for job_id, (done, failed) in meta.acks.items():
            job = self._jobs.get(job_id)
            if job is None:
                expired = self._expired.get(job_id)
                if expired is not None:
                    self._ack_expired(expired, done)
                else:
                    self._log.warning("ack_for_unknown_job", job_id=job_id)
                continue
            job.acks += done
            job.failed |= failed > 0
            if job.acks < self.world_size:
                continue
            del self._jobs[job_id]
            if job.disk_write:
                self._stale_jobs.discard(job_id)
                self._writes.write_ended(job)
                continue
            for block in job.fenced:
                jobs = self._fences[block]
                jobs.discard(job_id)
                if not jobs:
                    del self._fences[block]
            self._release_keys(job)
            self.trace.job_ended(
                job_id,
                ok=not job.failed,
                error=None if not job.failed else f"{failed} worker(s) failed",
                workers_failed=failed,
            )
            st = self._reqs.get(job.req_id)
            self._report.dirty = True
            if job.is_store:
                stale = job_id in self._stale_jobs
                self._stale_jobs.discard(job_id)
                if job.keys and not job.failed and not stale:
                    self._writes.store_ended(job)
                else:
                    self.directory_tell(
                        CompleteStore(slots=job.slots, ok=not job.failed and not stale)
                    )
                    self._book.retire(job.event_keys)
                self._c["stores_failed" if job.failed else "stores_done"] += 1
                if not job.failed and not stale:  # a reset discarded a stale one's tokens
                    self._c["tokens_stored"] += job.tokens
                if st is not None:
                    st.store_jobs.discard(job_id)
            else:
                held = job.slots >= 0
                handed = np.zeros(0, np.int64)
                if not job.failed and self.redis is not None:
                    taken = self._writes.write_again(job)
                    handed = job.slots[taken]
                    held &= ~taken
                valid = job.slots[held]
                if len(valid) or len(handed):
                    self.directory_tell(CompleteLoad(slots=valid, handed=handed))
                self._writes.reads_ended(job)
                if job.failed:
                    self._count_failed_load(job)
                    self._store_again(st, job)
                    if st is not None:
                        st.load_failed = True
                else:
                    self._c["loads_done"] += 1
                    self._c["tokens_loaded"] += job.tokens
                if st is not None and st.load_job == job_id:
                    st.load_job = None
                    if not job.failed:
                        st.tokens_loaded += job.tokens
