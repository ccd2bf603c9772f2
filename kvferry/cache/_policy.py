"""Eviction policies: the protocol, LRU, and loading one by name or import path.

A policy decides *which* READY, unpinned blocks leave the host tier; the
:class:`~kvferry.cache.Directory` decides *when* and *how many*, and guarantees the rest
(DESIGN §4: only READY, unpinned slots are ever offered as candidates, capacity is the
directory's). Policies see slots (ints in ``range(capacity)``) and per-key tags, always as
int64 arrays, one call per batch — never one call per block.

The hot path (:meth:`EvictionPolicy.admit`, :meth:`~EvictionPolicy.reuse`,
:meth:`~EvictionPolicy.touch`, :meth:`~EvictionPolicy.store_miss`) records, in O(1)
numpy calls per batch (or, for LRU evicting inline, O(1) C calls per block); the work of
choosing happens in :meth:`~EvictionPolicy.victims`, in O(evicted) for every built-in
policy and any capacity: each keeps its order in structures that yield victims directly
(:mod:`~kvferry.cache._recency`'s lazy recency logs for ARC, and for LRU in large
batches; an ``OrderedDict`` for LRU evicting inline; FIFO rings for S3-FIFO), so that an
eviction never passes over all slots — with watermarks (1, 1) every store that finds no
free slot evicts, inline.

Who owns what: a policy instance belongs to one directory and is called from its owner's
task only.
"""

from __future__ import annotations

import importlib
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from .._errors import ConfigError
from ._recency import Evictable, LogRecency, OrderedRecency

LRUOrder = Literal["dict", "log"]

I64 = npt.NDArray[np.int64]
Mask = npt.NDArray[np.bool_]


@runtime_checkable
class EvictionPolicy(Protocol):
    """What the directory calls. Built with ``Policy(capacity)``.

    Slot arrays come in prefix order (a request's first block first): a policy that keeps
    recency should rank the head as the most recent, so a prefix loses its tail first.
    Tags are 64-bit fingerprints of the keys (stable within the process), for history of
    keys no longer resident (ghosts); a policy that sets ``uses_tags = False`` gets empty
    tag arrays and saves the directory the hashing. A policy that sets
    ``tags_in_batches = True`` reads tags only in :meth:`victims` and :meth:`store_miss`:
    it gets empty tags in :meth:`admit`, and its store misses in batches (several stores'
    in one call, in their order, always before the next :meth:`victims`, :meth:`forget`
    or :meth:`clear`), which saves the directory hashing each store's keys on its own
    (unless a ``store_threshold`` needs them at once). A policy may also offer
    ``touch_found(found)``: :meth:`touch` of the slots the key index found, unfiltered (a
    list, -1 for an absent key, slots in any state), for a policy that tells READY slots
    apart itself (the built-in LRU's OrderedDict holds nothing else).
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

    def victims(self, n: int, evictable: Evictable, tags: I64) -> I64:
        """Choose up to ``n`` distinct slots that ``evictable`` accepts, best victims first.

        ``evictable(slots)`` says, for candidate slots, which may go now (READY, not
        pinned by a load, not offered by the store that is making room); ask it about
        the candidates in order, a chunk at a time, and keep the refused ones (they become
        evictable later). ``tags`` (read-only; empty without ``uses_tags``) has one entry
        per slot. The returned slots leave the cache: the policy forgets them. Fewer than
        ``n`` only when fewer are evictable.

        The cost should follow ``n`` (and the refused candidates met on the way), not the
        capacity: with watermarks (1, 1) a store makes this call for a handful of blocks.
        ``evictable(np.arange(capacity))`` is a whole-cache mask, at O(capacity) a call.
        """
        ...

    def forget(self, slots: I64) -> None:
        """``slots`` left the cache other than through :meth:`victims` (a clear)."""

    def clear(self) -> None:
        """Forget everything, history (ghosts) included."""

    def statistics(self) -> dict[str, float]:
        """Policy-specific gauges and counters, for :class:`DirectoryStatistics`."""
        ...


class LRUPolicy:
    """Least recently used, exact.

    A store, a reuse and a touch make a block the most recent (a batch's head newest).
    :meth:`victims` reads the order from its old end: O(evicted), plus the pinned blocks
    it meets there (kept in place for the next eviction), whatever the capacity.

    ``order``: ``"dict"``, an :class:`~kvferry.cache._recency.OrderedRecency` (an
    ``OrderedDict``: the cheapest for a step's few dozen blocks, a store evicting inline),
    or ``"log"``, a :class:`~kvferry.cache._recency.LogRecency` (one list of numpy logs: the
    cheapest in large batches, an evictor's, and 13 bytes a slot, for a directory of
    millions of slots). Both give the same victims.
    """

    name = "lru"
    uses_tags = False

    def __init__(self, capacity: int, *, order: LRUOrder = "dict") -> None:
        if order not in ("dict", "log"):
            raise ValueError(f'order must be "dict" or "log", got {order!r}')
        self._order = OrderedRecency() if order == "dict" else LogRecency(capacity)
        self._victims = 0
        self.touch_found = (
            self._order.refresh_found if isinstance(self._order, OrderedRecency) else None
        )
        """:meth:`touch` of the slots a key index found, unfiltered (the OrderedDict holds
        the READY slots only, and moves only them); None with the log order."""

    def admit(self, slots: I64, tags: I64) -> None:
        self._order.enter(slots)

    def reuse(self, slots: I64) -> None:
        # Not stamped here: a request's blocks are offered (and loaded) tail after head,
        # which would make a document's tail newer than its head. The request's Touch when
        # it ends stamps them all, head last (as vLLM's own manager does), so tails shared
        # by fewer requests leave first (benchmarks/scheduler_overhead.py, "Hit tokens").
        pass

    def touch(self, slots: I64) -> None:
        self._order.refresh(slots)

    def store_miss(self, tags: I64) -> None:
        pass

    def victims(self, n: int, evictable: Evictable, tags: I64) -> I64:
        out = self._order.pop(n, evictable)
        self._victims += len(out)
        return out

    def forget(self, slots: I64) -> None:
        self._order.remove(slots)

    def order(self) -> I64:
        """Resident slots, the next victim first (for tests)."""
        return self._order.order()

    def clear(self) -> None:
        self._order.clear()

    def statistics(self) -> dict[str, float]:
        return {"victims": self._victims}


def builtin_policies() -> dict[str, type[EvictionPolicy]]:
    from ._arc import ARCPolicy
    from ._s3fifo import S3FIFOPolicy

    return {"lru": LRUPolicy, "arc": ARCPolicy, "s3fifo": S3FIFOPolicy}


def make_policy(
    spec: str | EvictionPolicy,
    capacity: int,
    *,
    lru_order: LRUOrder = "dict",
    compiled: bool | None = None,
) -> EvictionPolicy:
    """A policy from ``spec``: a built-in name (``"lru"``, ``"arc"``, ``"s3fifo"``), an
    import path ``"package.module:Class"`` (built with ``Class(capacity)``), or an instance.
    ``lru_order``: where the built-in LRU keeps its order (:class:`LRUPolicy`);
    ``compiled``: whether ARC's and S3-FIFO's ghost lists run compiled (numba; the
    directory's ``compiled``).

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
        if cls is LRUPolicy:
            policy: Any = LRUPolicy(capacity, order=lru_order)
        elif cls in builtins.values():
            policy = cls(capacity, compiled=compiled)  # type: ignore[call-arg]
        else:
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
