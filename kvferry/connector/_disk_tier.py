"""The scheduler side's directory of the disk tier: which keys every worker holds on disk.

Who owns what: :class:`~kvferry.connector._scheduler.SchedulerSide` owns one, on vLLM's
engine thread (plain and synchronous, like the request state: no actor hop on a lookup).
The files belong to the workers (each rank its own, under its own fingerprint); this
side decides what is written, read and deleted, and tells them through the metadata.

A key is on disk (READY here) once every worker reported its write OK. Keys are the
host tier's (chained block hash + group). A slot here is a place for one chunk on every
rank: ``bytes_to_use / world_size / file size`` of them. Eviction (the tier's own
``eviction_policy``) picks victims among READY, unpinned keys; a pin is a read in flight
(a lookup's lease, then the load). Victims become ``deletes`` for the workers.

A reset forgets every key at once, but the files of the jobs in flight outlive it: a
chunk still read (pinned) is deleted when its last pin is released, and a write in flight
ends unseen, its files deleted then, unless the key was written again meanwhile (that
write owns the file: kept if it ended well everywhere, else deleted).

At start (warm restart) the files are found by scanning each rank's directory
(:meth:`~kvferry.tiers.DiskStore.scan`: names and sizes, no reads, a progress line in the
log); a key held by every rank is READY, one held by some ranks only is deleted. Each
rank's worker took a namespace of its own (rank 0 the first free of ``<digest>``,
``<digest>.1``, ...: another engine of the same fingerprint may run on the same path;
every other rank the same index of its own family, so that all hold the chunks one
earlier engine left), its lock file naming the engine (:func:`engine_owner`); this side
scans that one without locking it (``DiskStore(attach=True)``). Every read verifies the
chunk anyway: a file that went bad since is a miss, never a load.

A read that failed fails its load (vLLM recomputes); the chunk leaves the tier (its files
deleted on every rank) only if it is gone on some rank, not for a failure that kept its
files (a transient error: :meth:`reads_ended`).

With KV events on, the keys found are announced (``BlockStored``, medium DISK, with
vLLM's placeholder payload: their tokens are not known after a restart), at most
:data:`RESTORED_EVENTS_PER_STEP` a step: a router that dropped the engine's blocks when
it restarted learns what the disk holds. Those that left the tier before their turn are
not announced; a key that was stored again meanwhile had its own event. So replaying the
events still gives exactly the keys that are hits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .._config import DiskTierConfig
from .._errors import ConfigError
from .._logging import get_logger
from ..cache import BlocksRemoved, BlocksStored, Directory, DirectoryStatistics, KVEvent
from ..tiers import DiskStore, Fingerprint, ScanReport
from ..tiers._format import file_size
from ._metadata import KEPT

if TYPE_CHECKING:
    from vllm.config import VllmConfig

I64 = npt.NDArray[np.int64]

MEDIUM = "DISK"
"""The medium of the disk tier's KV events, as vLLM spells it."""

RESTORED_EVENTS_PER_STEP = 1024
"""Keys found at start announced per :meth:`DiskTier.take_events` (one step). Each is a
``BlockStored`` of its own (a few microseconds to build on the engine thread, about 130
bytes to publish): millions of them at once would stall the first step for seconds."""


def engine_owner(vllm_config: VllmConfig) -> str:
    """Who holds a worker's disk namespace, as its lock file says: the engine (vLLM's
    ``instance_id``, one per engine, the same in its scheduler and its workers: they get
    one config) and its data-parallel rank (data-parallel engines share a config)."""
    parallel = vllm_config.parallel_config
    dp_rank = getattr(parallel, "data_parallel_rank", 0)
    return f"{getattr(vllm_config, 'instance_id', '')}/dp{dp_rank}"


class DiskTier:
    """``fingerprints``: one per worker rank; ``payload_bytes``: one chunk on one rank;
    ``owner``: the engine's :func:`engine_owner`, which finds the namespace each rank's
    worker took."""

    def __init__(
        self,
        tier: DiskTierConfig,
        fingerprints: Sequence[Fingerprint],
        payload_bytes: int,
        *,
        events: bool,
        owner: str = "",
    ) -> None:
        self.tier = tier
        self.world_size = len(fingerprints)
        self.fingerprints = tuple(fingerprints)
        self.rank_bytes = tier.bytes_to_use // self.world_size
        capacity = self.rank_bytes // file_size(payload_bytes)
        if capacity <= 0:
            raise ConfigError(
                f"tiers[{tier.index}].bytes_to_use",
                f"{tier.bytes_to_use} bytes hold no offloaded block "
                f"({file_size(payload_bytes)} bytes on each of {self.world_size} workers)",
            )
        # Validated now (path, size, O_DIRECT probe), scanned in scan(): an error names
        # tiers[i].path or tiers[i].bytes_to_use before anything else is built.
        self._stores = [
            DiskStore(
                tier.path,
                self.rank_bytes,
                fp,
                tier_index=tier.index,
                fsync=tier.fsync,
                owner=owner,
                attach=True,
            )
            for fp in self.fingerprints
        ]
        self.dir = Directory(
            capacity,
            policy=tier.eviction_policy,
            watermarks=(1.0, 1.0),  # evict what a write needs, when it needs it
            store_threshold=tier.store_threshold,
            events=True,  # its removals are the workers' deletes
            medium=MEDIUM,
            # Millions of chunks on a disk: no Python object per chunk (about 84 bytes
            # of index each instead of about 213, at twice the CPU per lookup).
            index="compact",
        )
        self._forward_events = events
        self._events: list[KVEvent] = []
        self._deletes: list[bytes] = []
        self.restored = 0
        self._writing = 0
        # Per slot: a write in flight; one a reset dropped (its files are nobody's).
        self._writes_out = np.zeros(capacity, np.bool_)
        self._writes_dropped = np.zeros(capacity, np.bool_)
        self._dropped_reads: dict[int, list[Any]] = {}
        """Slot -> [key, pins left]: a chunk still read when a reset forgot it."""
        self._unowned: set[bytes] = set()
        """Keys of files nobody holds, written again since: that write decides."""
        self._unannounced = b""
        """The keys found at start not announced yet, end to end (no object per key)."""
        self._unannounced_ends = np.zeros(0, np.int64)
        self._announced = 0
        self._gone: set[bytes] = set()
        """Keys removed since the start while some are unannounced: not announced."""
        self._log = get_logger("kvferry.connector", role="scheduler", tier=tier.index)

    @property
    def write_back(self) -> bool:
        """``write: "on_evict"``: blocks are written down when host memory evicts them
        (not when they are stored)."""
        return self.tier.write == "on_evict"

    @property
    def capacity(self) -> int:
        return self.dir.num_slots

    @property
    def writes_in_flight(self) -> int:
        """Chunks whose write down was prepared and has not ended."""
        return self._writing

    # -- start ---------------------------------------------------------------------------

    def scan(self) -> list[ScanReport]:
        """Find what the workers' directories hold (warm restart); call once, at start."""
        held: dict[bytes, int] = {}
        reports = []
        for store in self._stores:
            reports.append(store.scan(budget_s=self.tier.scan_budget_s))
            for key in store.keys():
                held[key] = held.get(key, 0) + 1
        for store in self._stores:
            store.close()
        self._stores = []  # the workers' stores do the I/O; these only found the files
        everywhere = [k for k, n in held.items() if n == self.world_size]
        self.restored = self.dir.restore(everywhere)
        # Held by some ranks only (a write that failed somewhere), or beyond capacity.
        kept = set(everywhere[: self.restored])
        self._deletes.extend(k for k in held if k not in kept)
        if self._forward_events and self.restored:
            restored = everywhere[: self.restored]
            self._unannounced = b"".join(restored)
            self._unannounced_ends = np.cumsum([len(k) for k in restored], dtype=np.int64)
        self._log.info(
            "disk_tier_restored",
            chunks=self.restored,
            deleted=len(self._deletes),
            capacity=self.capacity,
            complete=all(r.complete for r in reports),
        )
        return reports

    # -- per step ------------------------------------------------------------------------

    def ready(self, keys: Sequence[bytes]) -> npt.NDArray[np.bool_]:
        return self.dir.ready(keys)

    def lease(self, keys: Sequence[bytes]) -> I64:
        """Pin these READY keys (a lookup's hit on disk) until :meth:`unpin`."""
        return self.dir.lease(keys)

    def unpin(self, slots: npt.ArrayLike) -> None:
        arr = np.asarray(slots, np.int64)
        if len(arr):
            self.dir.unpin(arr)
            if self._dropped_reads:
                self._reads_unpinned(arr)

    def _reads_unpinned(self, slots: I64) -> None:
        """Pins released of chunks a reset forgot: a chunk's file goes with its last."""
        for s in slots.tolist():
            held = self._dropped_reads.get(s)
            if held is None:
                continue
            held[1] -= 1
            if held[1] <= 0:
                del self._dropped_reads[s]
                self._delete_unheld([held[0]])

    def _delete_unheld(self, keys: Sequence[bytes]) -> None:
        """Files the directory no longer holds: deleted with the next step, unless their
        key was entered again (written since: that write's file, or in flight)."""
        for k in keys:
            slot = self.dir.slot_of(k)
            if slot is None:
                self._deletes.append(k)
            elif self._writes_out[slot]:
                self._unowned.add(k)  # its write decides (writes_ended)

    def prepare_writes(self, keys: Sequence[bytes]) -> I64:
        """Places for the keys to write down; -1 where skipped (present, not admitted by
        ``store_threshold``, or no room: nothing evictable)."""
        places = self.dir.prepare_store(keys)
        chosen = places[places >= 0]
        self._writing += len(chosen)
        self._writes_out[chosen] = True
        return places

    def writes_ended(self, slots: I64, keys: Sequence[bytes], failed: npt.NDArray[np.int64]) -> int:
        """A write job ended on every worker; ``failed[i]``: on how many chunk i failed.
        Returns how many chunks are now on disk (a write a reset dropped is not kept)."""
        ok = failed == 0
        self._writing -= len(slots)
        dropped = self._writes_dropped[slots]
        self._writes_dropped[slots] = False
        self._writes_out[slots] = False
        self.dir.complete_store(slots[ok], True)  # a dropped slot is freed, never READY
        self.dir.complete_store(slots[~ok], False)
        counts = failed.tolist()
        # Written by some workers only: those files are of no use.
        self._deletes.extend(
            k for k, f in zip(keys, counts, strict=True) if 0 < f < self.world_size
        )
        if self._unowned:
            for k, f in zip(keys, counts, strict=True):
                if k in self._unowned:
                    self._unowned.discard(k)
                    if f == self.world_size:  # failed everywhere: the older file stayed
                        self._deletes.append(k)
        if dropped.any():
            # Written everywhere after a reset forgot them: nobody's files, unless the
            # key was written again since.
            self._delete_unheld(
                [k for k, d, f in zip(keys, dropped.tolist(), counts, strict=True) if d and f == 0]
            )
        return int(np.count_nonzero(ok & ~dropped))

    def reads_ended(self, keys: Sequence[bytes], failed: npt.NDArray[np.int64]) -> None:
        """A load's reads ended (its pins released first); ``failed[i]``: chunk i's
        reports summed over the workers (:data:`~._metadata.KEPT`). A key gone on some
        worker (corrupt, absent, deleted for an error that says the file is bad) is no
        hit anywhere: dropped, and its files deleted on every worker. One that failed
        with its files kept everywhere (a transient error: EMFILE, ENOMEM...) stays a
        hit: its load failed (recomputed), the next one may read it."""
        gone = (np.asarray(failed, np.int64) % KEPT).tolist()
        bad = [k for k, g in zip(keys, gone, strict=True) if g > 0]
        if bad:
            self.dir.discard(bad)

    def reset(self) -> int:
        """Forget every key (vLLM's ``reset_prefix_cache``); returns how many were READY.
        Their files are deleted with the next step, but those a read still reads (each
        once its last pin is released: :meth:`unpin`) and those of writes in flight
        (once they ended: :meth:`writes_ended`)."""
        self._drain()  # the events before it (their removals' files are deleted)
        self._end_announcements()  # nothing found at start is a hit any more
        slots, keys, pins = self.dir.pinned()
        self._writes_dropped |= self._writes_out
        dropped = self.dir.reset()
        read = set(keys)
        for ev in self.dir.take_events():
            if isinstance(ev, BlocksRemoved):
                self._deletes.extend(k for k in ev.keys if k not in read)
            if self._forward_events:
                self._events.append(ev)
        for s, k, p in zip(slots.tolist(), keys, pins.tolist(), strict=True):
            self._dropped_reads[s] = [k, p]
        return dropped

    def _drain(self) -> None:
        unannounced = self._announced < len(self._unannounced_ends)
        for ev in self.dir.take_events():
            if isinstance(ev, BlocksRemoved):
                self._deletes.extend(ev.keys)
                if unannounced:
                    # Announced after its removal went out, a key found at start would
                    # stay held in a router's view: it is not announced at all.
                    self._gone.update(ev.keys)
            if self._forward_events:
                self._events.append(ev)

    def _announce_restored(self) -> list[KVEvent]:
        """The next keys found at start, as one record, but those removed since (no
        longer hits, or stored again: their own events say so)."""
        ends = self._unannounced_ends
        lo = self._announced
        if lo >= len(ends):
            return []
        hi = min(len(ends), lo + RESTORED_EVENTS_PER_STEP)
        blob, start, gone = self._unannounced, int(ends[lo - 1]) if lo else 0, self._gone
        keys = []
        for end in ends[lo:hi].tolist():
            k = blob[start:end]
            start = end
            if k not in gone:
                keys.append(k)
        self._announced = hi
        if hi == len(ends):
            self._end_announcements()
        return [BlocksStored(keys=keys, medium=MEDIUM)] if keys else []

    def _end_announcements(self) -> None:
        self._unannounced, self._unannounced_ends = b"", np.zeros(0, np.int64)
        self._announced = 0
        self._gone = set()

    def take_deletes(self) -> list[bytes]:
        """Keys whose files the workers delete this step (evicted, dropped, or partial)."""
        self._drain()
        out, self._deletes = self._deletes, []
        return out

    def take_events(self) -> list[KVEvent]:
        """KV events since the last call (medium DISK), the next keys found at start
        first (none of them is removed by the events after it: see :meth:`_drain`)."""
        self._drain()
        out = self._announce_restored()
        out.extend(self._events)
        self._events = []
        return out

    def statistics(self) -> DirectoryStatistics:
        return self.dir.statistics()
