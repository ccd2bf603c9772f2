"""What the scheduler half counts, and what it reports of it once per engine step.

:data:`COUNTS` names its counters (each a field of :class:`SchedulerStatistics`, which
:meth:`KVFerryConnector.statistics` returns); :class:`Report` turns them, the directory's
statistics and the lower tiers' into vLLM's stats channel (``get_kv_connector_stats``,
:class:`~._stats.KVFerryStats`): the counters' increments since the last report, and the
gauges, every name from the one table in ``kvferry/_metrics.py``.

Who owns what: :class:`~kvferry.connector._scheduler.SchedulerSide` owns one
:class:`Report` and its counters, on vLLM's engine thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs

from .._metrics import counter_values, gauge_values
from ..cache import DirectoryStatistics
from ._disk_tier import DiskTier
from ._redis_tier import RedisTier, RedisTierStatistics


@attrs.frozen(kw_only=True)
class SchedulerStatistics:
    """kvferry's scheduler-side counters (tokens, jobs) and its directory's."""

    tokens_looked_up: int
    tokens_hit: int
    tokens_missed: int
    tokens_loaded: int
    tokens_stored: int
    loads_done: int
    loads_failed: int
    stores_done: int
    stores_failed: int
    stores_fenced: int
    lookups_deferred: int
    load_bytes: int
    store_bytes: int
    load_seconds: float
    store_seconds: float
    jobs_in_flight: int
    directory: DirectoryStatistics
    loads_failed_copy: int = 0
    """Of ``loads_failed``, those whose copy failed on a worker: an error, a rejected
    submit, or the worker's own deadline (``job_timeout_s``) cancelling it."""
    disk_loads_failed: int = 0
    """Of ``loads_failed``, those a chunk of whose disk reads failed (before any copy)."""
    redis_loads_failed: int = 0
    """Of ``loads_failed``, those a chunk of whose Redis reads failed (no disk chunk did)."""
    loads_failed_deadline: int = 0
    """Of ``loads_failed``, those no worker reported within ``job_timeout_s``: the
    scheduler ended them."""
    loads_failed_unplanned: int = 0
    """Of ``loads_failed``, those the scheduler could not plan (``load_not_planned`` or a
    broken invariant in the log): planned failed, nothing copied."""
    disk_tokens_hit: int = 0
    disk_read_bytes: int = 0
    disk_read_seconds: float = 0.0
    disk_write_bytes: int = 0
    disk_write_seconds: float = 0.0
    disk_chunks_written: int = 0
    disk_chunks_corrupt: int = 0
    disk_reads_failed: int = 0
    disk_writes_failed: int = 0
    disk_hits_cut: int = 0
    """Lookups whose disk hit was cut short: no host slot to read a chunk into."""
    redis_tokens_hit: int = 0
    redis_read_bytes: int = 0
    redis_read_seconds: float = 0.0
    redis_write_bytes: int = 0
    redis_write_seconds: float = 0.0
    redis_chunks_written: int = 0
    redis_chunks_corrupt: int = 0
    redis_reads_failed: int = 0
    redis_writes_failed: int = 0
    redis_hits_cut: int = 0
    """Lookups whose Redis hit was cut short: no host slot to read a chunk into."""
    redis_chunks_kept_on_disk: int = 0
    """Chunks read from Redis then written to the disk tier too (written through), of
    every group; ``disk_chunks_written`` counts them when their write ended."""
    host_blocks_demoted: int = 0
    """``write: "on_evict"``: blocks host memory evicted, each then written down or
    (already on disk, not admitted, no room) dropped."""
    disk: DirectoryStatistics | None = None
    """The disk tier's directory (None without a disk tier)."""
    redis: RedisTierStatistics | None = None
    """The Redis tier's existence checks (None without a Redis tier)."""


COUNTS: tuple[str, ...] = tuple(
    f.name
    for f in attrs.fields(SchedulerStatistics)
    if f.name not in ("jobs_in_flight", "directory", "disk", "redis")
)
"""The scheduler side's counters (``SchedulerSide._c``, all from 0): every field of
:class:`SchedulerStatistics` but the gauges and the tiers' own statistics."""


class Report:
    """The per-step report of one scheduler side (see the module docstring).

    ``counts``: the scheduler side's counters (read, never written);
    ``directory_statistics``: asks the host tier's directory for its statistics (an
    actor call: made at most every 0.5 s while requests run).
    """

    def __init__(
        self,
        counts: dict[str, Any],
        disk: DiskTier | None,
        redis: RedisTier | None,
        directory_statistics: Callable[[], DirectoryStatistics],
    ) -> None:
        self._counts = counts
        self._disk = disk
        self._redis = redis
        self._directory_statistics = directory_statistics
        self.dirty = True
        """The directory changed since its statistics were read (set by the scheduler
        side)."""
        self._statistics: DirectoryStatistics | None = None
        self._statistics_at = 0.0
        self.reported: dict[str, float] = {}
        """The counters' values at the last report."""
        self._gauges: dict[str, float] = {}
        # What the last report was built from (host tier only): the same again is no news.
        self._built_from: tuple[dict[str, Any], DirectoryStatistics | None] = ({}, None)
        # (metric, counter) pairs, each name checked against the table once, here.
        self._from_counts = _names(_HOST_COUNTS)
        if disk is not None:
            self._from_counts += _names(_DISK_COUNTS)
        if redis is not None:
            self._from_counts += _names(_REDIS_COUNTS)
        self._skipped, self._evictions = counter_values(stores_skipped=0, evictions=0)
        self._disk_evictions, *_ = counter_values(disk_evictions=0)
        self._host_gauges = tuple(
            gauge_values(host_blocks_used=0, host_blocks_capacity=0, host_usage_ratio=0)
        )
        self._disk_gauges = tuple(
            gauge_values(disk_blocks_used=0, disk_blocks_capacity=0, disk_usage_ratio=0)
        )
        self._redis_names = tuple(
            counter_values(
                redis_blocks_offered_again=0, redis_lookups_waited=0, redis_lookups_unanswered=0
            )
        )

    def take(self, *, busy: bool) -> dict[str, Any] | None:
        """Counter increments since the last call, and current gauges (vLLM's stats
        channel); None when nothing changed. ``busy``: requests or jobs are in flight."""
        now_s = time.monotonic()
        # The directory's gauges are for monitoring: refreshed at most every 0.5 s while
        # requests run, not at the price of an ask on every engine step, and once more when
        # the last request and job ended (so an idle engine reports its final state).
        if self._statistics is None or (
            self.dirty and (now_s - self._statistics_at >= 0.5 or not busy)
        ):
            self._statistics = self._directory_statistics()
            self._statistics_at = now_s
            self.dirty = False
        d = self._statistics
        c = self._counts
        disk, redis = self._disk, self._redis
        if disk is None and redis is None:
            seen_c, seen_d = self._built_from
            if d is seen_d and c == seen_c:
                return None  # no counter moved and the gauges are those reported
            self._built_from = (dict(c), d)
        now = {name: c[key] for name, key in self._from_counts}
        now[self._skipped] = d.stores_skipped_present + d.stores_skipped_full
        now[self._evictions] = d.evictions
        if disk is not None:
            now[self._disk_evictions] = disk.dir.evictions
        if redis is not None:
            rs = redis.statistics()
            offered, waited, unanswered = self._redis_names
            now[offered] = rs.chunks_offered_again
            now[waited] = rs.lookups_waited
            now[unanswered] = rs.lookups_unanswered
        reported = self.reported
        counters = {k: v - reported.get(k, 0) for k, v in now.items() if v != reported.get(k, 0)}
        self.reported = now
        used, capacity, ratio = self._host_gauges
        gauges = {used: d.used, capacity: d.capacity, ratio: d.used / d.capacity}
        if disk is not None:
            # Resident: on disk on every worker (READY), as a lookup sees the tier.
            ready = disk.dir.used - disk.writes_in_flight
            used, capacity, ratio = self._disk_gauges
            gauges |= {used: ready, capacity: disk.capacity, ratio: ready / disk.capacity}
        if not counters and gauges == self._gauges:
            return None
        self._gauges = gauges
        return {"counters": counters, "gauges": gauges}


# The counters reported as the scheduler side counts them: (metric's short name, counter).
_HOST_COUNTS = (
    ("tokens_looked_up", "tokens_looked_up"),
    ("tokens_hit", "tokens_hit"),
    ("tokens_missed", "tokens_missed"),
    ("tokens_loaded", "tokens_loaded"),
    ("tokens_stored", "tokens_stored"),
    ("load_bytes", "load_bytes"),
    ("store_bytes", "store_bytes"),
    ("load_seconds", "load_seconds"),
    ("store_seconds", "store_seconds"),
    ("loads_failed", "loads_failed"),
    ("loads_failed_copy", "loads_failed_copy"),
    ("loads_failed_deadline", "loads_failed_deadline"),
    ("loads_failed_unplanned", "loads_failed_unplanned"),
    ("stores_failed", "stores_failed"),
    ("stores_fenced", "stores_fenced"),
    ("lookups_deferred", "lookups_deferred"),
)
_DISK_COUNTS = (
    ("disk_loads_failed", "disk_loads_failed"),
    ("disk_tokens_hit", "disk_tokens_hit"),
    ("disk_read_bytes", "disk_read_bytes"),
    ("disk_read_seconds", "disk_read_seconds"),
    ("disk_write_bytes", "disk_write_bytes"),
    ("disk_write_seconds", "disk_write_seconds"),
    ("disk_blocks_written", "disk_chunks_written"),
    ("disk_blocks_corrupt", "disk_chunks_corrupt"),
    ("disk_reads_failed", "disk_reads_failed"),
    ("disk_writes_failed", "disk_writes_failed"),
)
_REDIS_COUNTS = (
    ("redis_loads_failed", "redis_loads_failed"),
    ("redis_tokens_hit", "redis_tokens_hit"),
    ("redis_read_bytes", "redis_read_bytes"),
    ("redis_read_seconds", "redis_read_seconds"),
    ("redis_write_bytes", "redis_write_bytes"),
    ("redis_write_seconds", "redis_write_seconds"),
    ("redis_blocks_written", "redis_chunks_written"),
    ("redis_blocks_corrupt", "redis_chunks_corrupt"),
    ("redis_reads_failed", "redis_reads_failed"),
    ("redis_writes_failed", "redis_writes_failed"),
)


def _names(pairs: tuple[tuple[str, str], ...]) -> list[tuple[str, str]]:
    """(full metric name, counter) of each pair: raises for a name not in the table, or
    for a counter the scheduler side does not count."""
    unknown = [key for _, key in pairs if key not in COUNTS]
    if unknown:
        raise KeyError(f"not counters of the scheduler side: {unknown}")
    return list(
        zip(
            counter_values(**dict.fromkeys((n for n, _ in pairs), 0)),
            (k for _, k in pairs),
            strict=True,
        )
    )
