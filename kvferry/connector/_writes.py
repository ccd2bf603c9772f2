"""The writes from host memory to the tiers below it (a disk, a Redis), for the scheduler
half: which chunks each write takes, the write jobs the next step hands the workers, and
what their ends change in the directory and the tiers' books.

When a chunk goes down: a store that ended well is written through to each tier that takes
it (the disk unless it is written on eviction; Redis); with ``write: "on_evict"`` the
blocks host memory evicted are written to the disk (:meth:`TierWrites.demote`); a chunk
read from Redis is kept on a disk written through; a chunk whose Redis write failed is
written again from a later load (:meth:`TierWrites.write_again`). Every write pins its
host slots (or keeps them DEMOTING) until the job ended on every worker.

Who owns what: :class:`~kvferry.connector._scheduler.SchedulerSide` makes one
:class:`TierWrites` and calls it on vLLM's engine thread; it shares the scheduler side's
job table, counters and block book, and reaches the directory through the scheduler
side's ``tell`` and ``ask``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from ..cache import CompleteStore, EndDemotions, Fact, TakeDemotions, Unpin
from ._blockinfo import BlockBook
from ._disk_tier import DiskTier
from ._metadata import DiskChunks, DiskWriteSpec
from ._redis_tier import RedisTier
from ._requests import JobState


@attrs.define(eq=False, kw_only=True)
class TierWrites:
    """The lower tiers' writes of one scheduler side (see the module docstring)."""

    disk: DiskTier | None
    redis: RedisTier | None
    book: BlockBook
    counts: dict[str, Any]
    """The scheduler side's counters (``*_chunks_written``, ``host_blocks_demoted``...)."""
    jobs: dict[int, JobState]
    """The scheduler side's jobs in flight: a write is one until every worker reported."""
    new_job_id: Callable[[], int]
    tell: Callable[[Fact], None]
    """A fact for the directory, sent with the next message to it."""
    ask: Callable[[Callable[[Any], Any]], Any]
    """A request to the directory, answered now."""
    world_size: int
    events_enabled: bool
    disk_writes: list[DiskWriteSpec] = attrs.Factory(list)
    """The disk writes for the next step's metadata (taken by the scheduler side)."""
    redis_writes: list[DiskWriteSpec] = attrs.Factory(list)
    """The Redis writes for the next step's metadata."""

    def store_ended(self, job: JobState) -> None:
        """A store of chunks for the tiers below (``job.keys``) ended well on every
        worker: its blocks become host hits, and are written down now
        (:meth:`_write_through`) or, to a disk written on eviction alone, when host memory
        evicts them (:meth:`demote`: their block facts are kept until then)."""
        if self.disk is not None and self.disk.write_back and self.redis is None:
            self.tell(CompleteStore(slots=job.slots, ok=True))
            kept = set(job.keys)
            self.book.retire(k for k in job.event_keys if k not in kept)
            return
        self._write_through(job)

    def _write_through(self, job: JobState) -> None:
        """A store ended well on every worker: its blocks become host hits, and those a
        tier below takes are written down (to disk unless it is written on eviction; to
        Redis), their host slots pinned, once per write (in the same message: no eviction
        in between), until the write ends."""
        writes = []
        if self.disk is not None and not self.disk.write_back:
            writes.append(("disk", self.disk.prepare_writes(job.keys)))
        if self.redis is not None:
            writes.append(("redis", self.redis.prepare_writes(job.keys)))
        pins = [job.slots[places >= 0] for _, places in writes]
        pin = np.concatenate(pins) if pins else np.zeros(0, np.int64)
        self.tell(CompleteStore(slots=job.slots, ok=True, pin=pin))
        # The facts of the keys written down are kept for their tier's own event (the
        # first write that takes a key keeps them; the other's event may be a placeholder).
        kept: set[bytes] = set()
        if self.disk is not None and self.disk.write_back:
            kept.update(job.keys)  # for the disk's write on eviction (demote)
        for tier, places in writes:
            chosen = places >= 0
            if not chosen.any():
                continue
            keys = [k for k, c in zip(job.keys, chosen.tolist(), strict=True) if c]
            taken = set(keys)
            event_keys = tuple(k for k in job.event_keys if k in taken and k not in kept)
            kept.update(event_keys)
            self._write_down(
                keys, job.slots[chosen], places[chosen], event_keys, demotion=False, tier=tier
            )
        self.book.retire([k for k in job.event_keys if k not in kept])

    def demote(self) -> None:
        """``write: "on_evict"``: the blocks host memory evicted since the last step are
        written down if the disk tier takes them (not there yet, admitted, room made),
        their host slots kept (DEMOTING) until the write ended; the others are freed now.
        Their block facts (the DISK event's) are retired when that is decided."""
        disk = self.disk
        if disk is None:  # only called with a disk tier written on eviction
            return
        demoted = self.ask(lambda r: TakeDemotions(reply=r))
        if not len(demoted.slots):
            return
        keys = list(demoted.keys)
        places = disk.prepare_writes(keys)
        chosen = places >= 0
        self.counts["host_blocks_demoted"] += len(keys)
        if not chosen.all():
            self.tell(EndDemotions(slots=demoted.slots[~chosen]))
            if self.events_enabled:
                self.book.retire(k for k, c in zip(keys, chosen.tolist(), strict=True) if not c)
        if chosen.any():
            written = [k for k, c in zip(keys, chosen.tolist(), strict=True) if c]
            self._write_down(
                written,
                demoted.slots[chosen],
                places[chosen],
                tuple(written) if self.events_enabled else (),
                demotion=True,
            )

    def _keep_on_disk(
        self, keys: list[bytes], slots: npt.NDArray[np.int64], facts: set[bytes]
    ) -> set[bytes]:
        """Chunks read from Redis are in host memory now (READY); with a disk tier
        written through they are written to the disk too, as a store's are (their host
        slots pinned in the same message, until the write ended), so that they outlive
        host memory and Redis's TTL. A disk written on eviction gets them when host
        memory evicts them (:meth:`demote`). Returns the keys of ``facts`` (the load's
        block facts) the disk write now holds, retired when it ends."""
        disk = self.disk
        if disk is None or disk.write_back:
            self.tell(CompleteStore(slots=slots, ok=True))
            return set()
        places = disk.prepare_writes(keys)
        chosen = places >= 0
        self.tell(CompleteStore(slots=slots, ok=True, pin=slots[chosen]))
        if not chosen.any():
            return set()
        self.counts["redis_chunks_kept_on_disk"] += int(chosen.sum())
        written = [k for k, c in zip(keys, chosen.tolist(), strict=True) if c]
        event_keys = tuple(k for k in written if k in facts)
        self._write_down(written, slots[chosen], places[chosen], event_keys, demotion=False)
        return set(event_keys)

    def write_again(self, job: JobState) -> npt.NDArray[np.bool_]:
        """A load from host memory ended well: its chunks whose Redis write had failed a
        while ago (:meth:`RedisTier.prepare_rewrites`) are written to Redis now, their
        host slots keeping the load's pins until the write ends. Which of ``job.slots``
        (the load's host chunks) went to such a write."""
        redis = self.redis
        taken = np.zeros(len(job.slots), np.bool_)
        if redis is None or not redis.has_unwritten:
            return taken
        below = set(job.disk_keys) | set(job.redis_keys)
        host_keys = [k for k in job.keys if k not in below] if below else list(job.keys)
        if len(host_keys) != len(job.slots):  # not a load's own layout: nothing to take
            return taken
        usable = job.slots >= 0
        idx = np.flatnonzero(usable)
        places = redis.prepare_rewrites([host_keys[i] for i in idx.tolist()])
        chosen = idx[places >= 0]
        if not len(chosen):
            return taken
        taken[chosen] = True
        keys = [host_keys[i] for i in chosen.tolist()]
        self._write_down(
            keys, job.slots[chosen], places[places >= 0], (), demotion=False, tier="redis"
        )
        return taken

    def reads_ended(self, job: JobState) -> None:
        """A load's chunks from below host memory, once every worker reported: read
        everywhere, their host slots become READY (the blocks are in host memory now);
        else dropped, and a chunk that failed is dropped from its tier too (a disk chunk
        gone on some worker: its files deleted, but not one whose files every worker
        kept, :meth:`DiskTier.reads_ended`; a Redis key known absent, its damaged value
        deleted by the reader)."""
        if self.disk is not None and len(job.disk_slots):
            self.disk.unpin(job.disk_slots)
        kept: set[bytes] = set()  # facts handed on to a disk write (_keep_on_disk)
        for tier, keys, reported, slots in (
            (self.disk, job.disk_keys, job.disk_failed, job.disk_host_slots),
            (self.redis, job.redis_keys, job.redis_failed, job.redis_host_slots),
        ):
            if not keys or tier is None:
                continue
            n = len(keys)
            failed = reported
            if failed is None or len(failed) != n:  # unreported: nothing known to be good
                failed = np.full(n, self.world_size, np.int64)
            ok = failed == 0
            if ok.any() and tier is self.redis:
                good = [k for k, g in zip(keys, ok.tolist(), strict=True) if g]
                kept = self._keep_on_disk(good, slots[ok], set(job.event_keys))
            elif ok.any():
                self.tell(CompleteStore(slots=slots[ok], ok=True))
            if not ok.all():
                self.tell(CompleteStore(slots=slots[~ok], ok=False))
            if reported is not None:
                tier.reads_ended(keys, failed)
        self.book.retire(k for k in job.event_keys if k not in kept)

    def _write_down(
        self,
        keys: list[bytes],
        host: npt.NDArray[np.int64],
        places: npt.NDArray[np.int64],
        event_keys: tuple[bytes, ...],
        *,
        demotion: bool,
        tier: str = "disk",
    ) -> None:
        """A write job of ``tier`` for the next step: ``keys`` from host slots ``host``
        (pinned, or DEMOTING) into the tier's ``places``."""
        write_id = self.new_job_id()
        self.jobs[write_id] = JobState(
            job_id=write_id,
            req_id="",
            is_store=True,
            slots=host,
            tokens=0,
            disk_keys=tuple(keys),
            disk_slots=places,
            disk_write=True,
            demotion=demotion,
            event_keys=event_keys,
            tier=tier,
        )
        pending = self.redis_writes if tier == "redis" else self.disk_writes
        pending.append(DiskWriteSpec(job_id=write_id, chunks=DiskChunks(keys=keys, slots=host)))

    def write_ended(self, job: JobState) -> None:
        tier = self.redis if job.tier == "redis" else self.disk
        if tier is None:
            return
        n = len(job.disk_keys)
        failed = job.redis_failed if job.tier == "redis" else job.disk_failed
        if failed is None or len(failed) != n:
            failed = np.full(n, self.world_size, np.int64)
        self.counts[f"{job.tier}_chunks_written"] += tier.writes_ended(
            job.disk_slots, job.disk_keys, failed
        )
        self.book.retire(job.event_keys)
        if job.demotion:
            self.tell(EndDemotions(slots=job.slots))
        elif len(job.slots):
            self.tell(Unpin(slots=job.slots))
