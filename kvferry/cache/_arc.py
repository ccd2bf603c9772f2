"""ARC (Megiddo & Modha, FAST '03) over slot arrays, with vLLM's request semantics.

T1 holds blocks stored and not reused since; T2 blocks reused at least once. B1 and B2
are ghosts — tags of blocks recently evicted from T1 and T2 — and a store of a key found
in a ghost moves the target size of T1 (``p``): up after a B1 hit (recency was cut too
short), down after a B2 hit. As in vLLM's ``ARCCachePolicy``: a store enters T1; a reuse
(a load, or a store offer of a present block) promotes T1 → T2; eviction takes T1's LRU
end while ``|T1| >= p``, else T2's; each ghost list is bounded by the capacity.

Differences from vLLM's, by design: store misses are learnt from in a batch at the next
eviction (same order, same adaptation, just later — ``p`` only matters when evicting; the
directory hashes their keys then too, ``tags_in_batches``), and a block still being stored
is not counted in T1 (vLLM's T1 holds pending stores too).
Admissions, reuses and touches are recorded and replayed in one pass before a decision
(:mod:`~kvferry.cache._recency`).

Who owns what: owned by one directory; see :mod:`kvferry.cache._policy`.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ._policy import I64
from ._recency import Evictable, RecencyLists
from ._table import GhostQueue

_T1, _T2 = 1, 2
_EMPTY = np.zeros(0, np.int64)


def _sum_from(start: float, steps: npt.NDArray[np.float64]) -> float:
    """``start + steps[0] + steps[1] + ...``, added in that order (as a loop would)."""
    return float(np.add.accumulate(np.concatenate(([start], steps)))[-1])


class ARCPolicy:
    """Adaptive replacement between recency (T1) and frequency (T2).

    T1 and T2 are two lists of one :class:`~kvferry.cache._recency.RecencyLists`: a
    victim is read from a list's old end, so an eviction costs O(evicted) (plus pinned
    blocks met there), and a ghost list costs O(1) per key pushed or found.
    """

    name = "arc"
    tags_in_batches = True
    """Tags are read only at an eviction (ghosts): the directory hashes keys then."""

    def __init__(self, capacity: int, *, compiled: bool | None = None) -> None:
        self.capacity = capacity
        self._lists = RecencyLists(capacity, 2)
        self.p = 0.0
        """Target size of T1."""
        # ``compiled``: the ghost lists' tag tables (:class:`~kvferry.cache._table.TagTable`).
        self._b1 = GhostQueue(capacity, compiled=compiled)
        self._b2 = GhostQueue(capacity, compiled=compiled)
        self._misses: list[I64] = []
        self._missed = 0
        self._c = {"ghost_hits_b1": 0, "ghost_hits_b2": 0}

    def admit(self, slots: I64, tags: I64) -> None:
        self._lists.enter(slots, _T1)

    def reuse(self, slots: I64) -> None:
        self._lists.promote(slots, _T2)

    def touch(self, slots: I64) -> None:
        self._lists.refresh(slots)

    def store_miss(self, tags: I64) -> None:
        self._misses.append(tags)
        self._missed += len(tags)
        if self._missed > RecencyLists.max_pending:  # bound the log while nothing is evicted
            self._learn()

    def _learn(self) -> None:
        """Adapt ``p`` to the store misses found in a ghost, in the order they came."""
        if not self._misses:
            return
        tags = np.concatenate(self._misses)
        self._misses, self._missed = [], 0
        b1, b2, p = len(self._b1), len(self._b2), self.p
        if not (b1 or b2):
            return
        # A hit leaves its ghost list (the key is being stored again).
        in1 = self._b1.discard(tags)
        in2 = self._b2.discard(tags) & ~in1
        k1, k2 = int(np.count_nonzero(in1)), int(np.count_nonzero(in2))
        if not (k1 or k2):
            return
        # The ghost lists shrink hit by hit, in the order the misses came. Hits of one list
        # alone (the rule: every step moves ``p`` the same way, then clamps it) are summed
        # in one pass, in that order (a cumulative sum adds in sequence: the same floats).
        if not k2 and k1 <= b1:
            steps = np.maximum(1.0, b2 / (b1 - np.arange(k1)))
            p = min(_sum_from(p, steps), float(self.capacity))
        elif not k1 and k2 <= b2:
            steps = np.maximum(1.0, b1 / (b2 - np.arange(k2)))
            p = max(_sum_from(p, -steps), 0.0)
        else:
            for is_b1 in in1[np.flatnonzero(in1 | in2)].tolist():
                if is_b1 and b1:
                    p = min(p + max(1.0, b2 / b1), float(self.capacity))
                    b1 -= 1
                elif b2:
                    p = max(p - max(1.0, b1 / b2), 0.0)
                    b2 -= 1
        self.p = p
        self._c["ghost_hits_b1"] += k1
        self._c["ghost_hits_b2"] += k2

    def victims(self, n: int, evictable: Evictable, tags: I64) -> I64:
        self._learn()
        lists = self._lists
        n1 = lists.size(_T1)
        target = int(self.p)
        # vLLM's rule, batched: take from T1 while its (virtual) size is >= p, then from
        # T2, and fall back to T1 when T2 runs out.
        want1 = min(n, n1 - target + 1) if n1 >= target else 0
        v1 = lists.pop(_T1, want1, evictable) if want1 > 0 else _EMPTY
        v2 = lists.pop(_T2, n - len(v1), evictable) if n > len(v1) else _EMPTY
        if len(v1) + len(v2) < n:
            v1 = np.concatenate([v1, lists.pop(_T1, n - len(v1) - len(v2), evictable)])
        if len(v1):
            self._b1.push(tags[v1])
        if not len(v2):
            return v1
        self._b2.push(tags[v2])
        return np.concatenate([v1, v2]) if len(v1) else v2

    def forget(self, slots: I64) -> None:
        self._lists.remove(slots)

    def clear(self) -> None:
        self._lists.clear()
        self.p = 0.0
        self._b1.clear()
        self._b2.clear()
        self._misses, self._missed = [], 0

    def statistics(self) -> dict[str, float]:
        return {
            "target_t1": self.p,
            "t1": self._lists.size(_T1),
            "t2": self._lists.size(_T2),
            "b1": len(self._b1),
            "b2": len(self._b2),
            "promotions": self._lists.promoted,
            **self._c,
        }
