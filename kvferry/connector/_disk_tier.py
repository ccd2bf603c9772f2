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

At start (warm restart) the files are found by scanning each rank's directory
(:meth:`~kvferry.tiers.DiskStore.scan`: names and sizes, no reads, a progress line in the
log); a key held by every rank is READY, one held by some ranks only is deleted. Every
read verifies the chunk anyway: a file that went bad since is a miss, never a load.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from .._config import DiskTierConfig
from .._errors import ConfigError
from .._logging import get_logger
from ..cache import BlocksRemoved, Directory, DirectoryStatistics, KVEvent
from ..tiers import DiskStore, Fingerprint, ScanReport
from ..tiers._format import file_size

I64 = npt.NDArray[np.int64]

MEDIUM = "DISK"
"""The medium of the disk tier's KV events, as vLLM spells it."""


class DiskTier:
    """``fingerprints``: one per worker rank; ``payload_bytes``: one chunk on one rank."""

    def __init__(
        self,
        tier: DiskTierConfig,
        fingerprints: Sequence[Fingerprint],
        payload_bytes: int,
        *,
        events: bool,
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
            DiskStore(tier.path, self.rank_bytes, fp, tier_index=tier.index, fsync=tier.fsync)
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
        self._stores = []  # the workers' stores do the I/O; these only found the files
        everywhere = [k for k, n in held.items() if n == self.world_size]
        self.restored = self.dir.restore(everywhere)
        # Held by some ranks only (a write that failed somewhere), or beyond capacity.
        kept = set(everywhere[: self.restored])
        self._deletes.extend(k for k in held if k not in kept)
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
        if len(np.asarray(slots)):
            self.dir.unpin(slots)

    def prepare_writes(self, keys: Sequence[bytes]) -> I64:
        """Places for the keys to write down; -1 where skipped (present, not admitted by
        ``store_threshold``, or no room: nothing evictable)."""
        places = self.dir.prepare_store(keys)
        self._writing += int(np.count_nonzero(places >= 0))
        return places

    def writes_ended(self, slots: I64, keys: Sequence[bytes], failed: npt.NDArray[np.int64]) -> int:
        """A write job ended on every worker; ``failed[i]``: on how many chunk i failed.
        Returns how many chunks are now on disk."""
        ok = failed == 0
        self._writing -= len(slots)
        self.dir.complete_store(slots[ok], True)
        self.dir.complete_store(slots[~ok], False)
        # Written by some workers only: those files are of no use.
        self._deletes.extend(
            k for k, f in zip(keys, failed.tolist(), strict=True) if 0 < f < self.world_size
        )
        return int(ok.sum())

    def reads_ended(self, keys: Sequence[bytes], failed: npt.NDArray[np.int64]) -> None:
        """A load's reads ended (its pins released first): a key that failed on some
        worker (corrupt, gone, an I/O error) is dropped, and deleted everywhere."""
        bad = [k for k, f in zip(keys, failed.tolist(), strict=True) if f > 0]
        if bad:
            self.dir.discard(bad)

    def reset(self) -> int:
        return self.dir.reset()

    def _drain(self) -> None:
        for ev in self.dir.take_events():
            if isinstance(ev, BlocksRemoved):
                self._deletes.extend(ev.keys)
            if self._forward_events:
                self._events.append(ev)

    def take_deletes(self) -> list[bytes]:
        """Keys whose files the workers delete this step (evicted, dropped, or partial)."""
        self._drain()
        out, self._deletes = self._deletes, []
        return out

    def take_events(self) -> list[KVEvent]:
        """KV events since the last call (medium DISK)."""
        self._drain()
        out, self._events = self._events, []
        return out

    def statistics(self) -> DirectoryStatistics:
        return self.dir.statistics()
