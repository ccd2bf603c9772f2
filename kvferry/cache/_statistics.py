"""The directory's counters, as one frozen snapshot."""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class DirectoryStatistics:
    """Counters of one directory, in blocks (offloaded blocks, not engine blocks)."""

    capacity: int
    used: int
    """Slots not FREE (STORING, READY, or dropped and still in flight)."""
    ready: int
    pinned: int
    storing: int
    demoting: int = 0
    """Evicted slots kept until their write to a lower tier ended (``write_back``)."""
    lookups: int
    hits: int
    misses: int
    stores_prepared: int
    stores_skipped_present: int
    stores_skipped_threshold: int
    """Offers refused by admission (seen fewer than ``store_threshold`` times)."""
    stores_skipped_full: int
    stores_completed: int
    stores_failed: int
    loads_prepared: int
    loads_completed: int
    evictions: int
    evictions_inline: int
    """Evictions a PrepareStore had to make itself (the evictor was behind)."""
    resets: int
    policy: str
    policy_stats: dict[str, float] = attrs.field(factory=dict)

    @property
    def occupancy(self) -> float:
        return self.used / self.capacity
