"""Eviction policies: the protocol, LRU, and loading one by name or import path.

A policy decides *which* READY, unpinned blocks leave the host tier; the
:class:`~kvferry.cache.Directory` decides *when* and *how many*, and guarantees the rest
(DESIGN §4: only READY, unpinned slots are ever offered as candidates, capacity is the
directory's). Policies see slots (ints in ``range(capacity)``) and per-key tags, always as
int64 arrays, one call per batch — never one call per block.

The hot path (:meth:`EvictionPolicy.admit`, :meth:`~EvictionPolicy.reuse`,
:meth:`~EvictionPolicy.touch`, :meth:`~EvictionPolicy.store_miss`) only records, in O(1)
numpy calls per batch; the work of choosing happens in :meth:`~EvictionPolicy.victims`,
which the Evictor calls off the critical path for a whole watermark's worth of blocks.

Who owns what: a policy instance belongs to one directory and is called from its owner's
task only.
"""

from __future__ import annotations

import importlib
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from .._errors import ConfigError

I64 = npt.NDArray[np.int64]
Mask = npt.NDArray[np.bool_]


@runtime_checkable
class EvictionPolicy(Protocol):
    """What the directory calls. Built with ``Policy(capacity)``.

    Slot arrays come in prefix order (a request's first block first): a policy that keeps
    recency should rank the head as the most recent, so a prefix loses its tail first.
    Tags are 64-bit fingerprints of the keys (stable within the process), for history of
    keys no longer resident (ghosts); a policy that sets ``uses_tags = False`` gets empty
    tag arrays and saves the directory the hashing.
    """

    name: str

    def admit(self, slots: I64, tags: I64) -> None:
        """A store completed: ``slots`` (holding keys with ``tags``) entered the cache."""

    def reuse(self, slots: I64) -> None:
        """READY blocks a request used again (loaded, or offered for store while present)."""

    def touch(self, slots: I64) -> None:
        """Recency only: a finished request's blocks (no frequency is counted)."""

    def store_miss(self, tags: I64) -> None:
        """Keys about to be stored that were not resident (ghost learning)."""

    def victims(self, n: int, evictable: Mask, tags: I64) -> I64:
        """Choose up to ``n`` distinct slots with ``evictable[slot]``, best victims first.

        ``evictable`` and ``tags`` (read-only; empty without ``uses_tags``) have one entry
        per slot. The returned slots leave the cache: the policy forgets them. Fewer than
        ``n`` only when fewer are evictable.
        """
        ...

    def forget(self, slots: I64) -> None:
        """``slots`` left the cache other than through :meth:`victims` (a clear)."""

    def clear(self) -> None:
        """Forget everything, history (ghosts) included."""

    def statistics(self) -> dict[str, float]:
        """Policy-specific gauges and counters, for :class:`DirectoryStatistics`."""
        ...


class Recency:
    """A logical clock per slot: stamping a batch gives its head the newest time.

    :meth:`stamp` only logs (O(1), no numpy); the log is applied in one vectorized pass
    when an order is needed (:meth:`oldest`) or the log grows long. Stamps only grow, so
    applying them with a per-slot maximum is exact even when a slot was freed and
    reused in between: its new key's stamps are newer than any of the old key's.
    """

    max_log = 1 << 16
    max_clock = (1 << 31) - (1 << 24)
    """Stamps are int32 (4 bytes a slot); near the top they are renumbered by rank."""

    def __init__(self, capacity: int) -> None:
        self.stamp_of = np.zeros(capacity, np.int32)
        self.clock = 0
        self._log: list[I64] = []
        self._bases: list[int] = []
        self._logged = 0

    def stamp(self, slots: I64) -> None:
        k = len(slots)
        if not k:
            return
        if self.clock + k > self.max_clock + (1 << 23):  # would not fit int32: apply now
            self.apply()
        self._log.append(slots)
        self._bases.append(self.clock + k)
        self.clock += k
        self._logged += k
        if self._logged > self.max_log:
            self.apply()

    def apply(self) -> None:
        if not self._log:
            return
        slots = np.concatenate(self._log)
        lens = np.fromiter(map(len, self._log), np.int64, len(self._log))
        firsts = np.cumsum(lens) - lens
        # Within one stamp, position i (0 = head) gets base - i.
        values = np.repeat(np.asarray(self._bases, np.int64) + firsts, lens) - np.arange(len(slots))
        np.maximum.at(self.stamp_of, slots, values.astype(np.int32))
        self._log, self._bases, self._logged = [], [], 0
        if self.clock > self.max_clock:
            self._renumber()

    def _renumber(self) -> None:
        """The same order in small numbers: each slot's rank among all stamps."""
        order = np.argsort(self.stamp_of, kind="stable")
        self.stamp_of[order] = np.arange(1, len(order) + 1, dtype=np.int32)
        self.clock = len(order) + 1

    def oldest(self, n: int, candidates: I64) -> I64:
        """The ``n`` candidates with the oldest stamps, oldest first (exact, O(len))."""
        self.apply()
        if n <= 0:
            return candidates[:0]
        if len(candidates) > n:
            candidates = candidates[np.argpartition(self.stamp_of[candidates], n - 1)[:n]]
        out: I64 = candidates[np.argsort(self.stamp_of[candidates], kind="stable")]
        return out


class LRUPolicy:
    """Least recently used: exact LRU order over a per-slot logical clock.

    A store, a reuse and a touch make a block the most recent (a batch's head newest).
    :meth:`victims` is one O(capacity) partition for the whole batch, which the
    watermarks amortize over thousands of evictions.
    """

    name = "lru"
    uses_tags = False

    def __init__(self, capacity: int) -> None:
        self._recency = Recency(capacity)
        self._victims = 0

    def admit(self, slots: I64, tags: I64) -> None:
        self._recency.stamp(slots)

    def reuse(self, slots: I64) -> None:
        self._recency.stamp(slots)

    def touch(self, slots: I64) -> None:
        self._recency.stamp(slots)

    def store_miss(self, tags: I64) -> None:
        pass

    def victims(self, n: int, evictable: Mask, tags: I64) -> I64:
        out = self._recency.oldest(n, np.flatnonzero(evictable))
        self._victims += len(out)
        return out

    def forget(self, slots: I64) -> None:
        pass

    def clear(self) -> None:
        self._recency = Recency(len(self._recency.stamp_of))

    def statistics(self) -> dict[str, float]:
        return {"victims": self._victims}


def builtin_policies() -> dict[str, type[EvictionPolicy]]:
    from ._arc import ARCPolicy
    from ._s3fifo import S3FIFOPolicy

    return {"lru": LRUPolicy, "arc": ARCPolicy, "s3fifo": S3FIFOPolicy}


def make_policy(spec: str | EvictionPolicy, capacity: int) -> EvictionPolicy:
    """A policy from ``spec``: a built-in name (``"lru"``, ``"arc"``, ``"s3fifo"``), an
    import path ``"package.module:Class"`` (built with ``Class(capacity)``), or an instance.

    Raises :class:`~kvferry.ConfigError` (key ``eviction_policy``) naming what is wrong.
    """
    if not isinstance(spec, str):
        if not isinstance(spec, EvictionPolicy):
            raise ConfigError("eviction_policy", f"{spec!r} does not implement EvictionPolicy")
        return spec
    builtins = builtin_policies()
    cls = builtins.get(spec.lower())
    if cls is None:
        if ":" not in spec:
            raise ConfigError(
                "eviction_policy",
                f"unknown policy {spec!r}: use one of {sorted(builtins)} or 'package.module:Class'",
            )
        module_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError("eviction_policy", f"cannot import {module_name!r}: {exc}") from exc
        found = getattr(module, attr, None)
        if not isinstance(found, type):
            raise ConfigError("eviction_policy", f"{spec!r} is not a class")
        cls = found
    try:
        policy = cls(capacity)  # type: ignore[call-arg]
    except Exception as exc:
        raise ConfigError("eviction_policy", f"{spec!r}({capacity}) failed: {exc!r}") from exc
    if not isinstance(policy, EvictionPolicy):
        missing = [
            m
            for m in (
                "admit",
                "reuse",
                "touch",
                "store_miss",
                "victims",
                "forget",
                "clear",
                "statistics",
                "name",
            )
            if not hasattr(policy, m)
        ]
        raise ConfigError("eviction_policy", f"{spec!r} lacks {missing}")
    return policy
