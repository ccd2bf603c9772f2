"""ARC (Megiddo & Modha, FAST '03) over slot arrays, with vLLM's request semantics.

T1 holds blocks stored and not reused since; T2 blocks reused at least once. B1 and B2
are ghosts — tags of blocks recently evicted from T1 and T2 — and a store of a key found
in a ghost moves the target size of T1 (``p``): up after a B1 hit (recency was cut too
short), down after a B2 hit. As in vLLM's ``ARCCachePolicy``: a store enters T1; a reuse
(a load, or a store offer of a present block) promotes T1 → T2; eviction takes T1's LRU
end while ``|T1| >= p``, else T2's; each ghost list is bounded by the capacity.

Differences from vLLM's, by design: store misses are learnt from in a batch at the next
eviction (same order, same adaptation, just later — ``p`` only matters when evicting), and
a block still being stored is not counted in T1 (vLLM's T1 holds pending stores too).

Who owns what: owned by one directory; see :mod:`kvferry.cache._policy`.
"""

from __future__ import annotations

import numpy as np

from ._policy import I64, Mask, Recency
from ._table import FingerprintQueue

_NONE, _T1, _T2 = 0, 1, 2


class ARCPolicy:
    """Adaptive replacement between recency (T1) and frequency (T2)."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._list = np.zeros(capacity, np.int8)
        self._recency = Recency(capacity)
        self._n1 = 0
        self._n2 = 0
        self.p = 0.0
        """Target size of T1."""
        self._b1 = FingerprintQueue(capacity)
        self._b2 = FingerprintQueue(capacity)
        # The hot path logs; _apply() replays the log in bulk before a decision.
        self._admitted: list[I64] = []
        self._reused: list[I64] = []
        self._misses: list[I64] = []
        self._logged = 0
        self._c = {"ghost_hits_b1": 0, "ghost_hits_b2": 0, "promotions": 0}

    def admit(self, slots: I64, tags: I64) -> None:
        self._admitted.append(slots)
        self._recency.stamp(slots)
        self._log(len(slots))

    def reuse(self, slots: I64) -> None:
        self._reused.append(slots)
        self._recency.stamp(slots)
        self._log(len(slots))

    def touch(self, slots: I64) -> None:
        self._recency.stamp(slots)

    def _log(self, n: int) -> None:
        self._logged += n
        if self._logged > Recency.max_log:  # bound the log while nothing is evicted
            self._apply()

    def _apply(self) -> None:
        """Replay the log: admissions first, then reuses — for one key, its admission
        always came before its reuses, and a reused slot is never reassigned before the
        next eviction (or clear, which applies the log first)."""
        if self._admitted:
            self._list[np.concatenate(self._admitted)] = _T1
        if self._admitted or self._reused:
            self._n1 = int(np.count_nonzero(self._list == _T1))
        if self._reused:
            slots = np.concatenate(self._reused)
            self._list[slots[self._list[slots] != _NONE]] = _T2
            n1 = int(np.count_nonzero(self._list == _T1))
            self._c["promotions"] += self._n1 - n1
            self._n1 = n1
        if self._admitted or self._reused:
            self._n2 = int(np.count_nonzero(self._list == _T2))
        self._admitted, self._reused, self._logged = [], [], 0
        self._learn()

    def store_miss(self, tags: I64) -> None:
        self._misses.append(tags)
        self._log(len(tags))

    def _learn(self) -> None:
        """Adapt ``p`` to the store misses found in a ghost, in the order they came."""
        if not self._misses:
            return
        tags = np.concatenate(self._misses)
        self._misses = []
        in1 = self._b1.find(tags) >= 0
        in2 = self._b2.find(tags) >= 0
        hits = np.flatnonzero(in1 | in2)
        if not len(hits):
            return
        b1, b2, p = len(self._b1), len(self._b2), self.p
        for is_b1 in in1[hits].tolist():
            # A hit leaves its ghost list (the key is being stored again): sizes shrink.
            if is_b1 and b1:
                p = min(p + max(1.0, b2 / b1), float(self.capacity))
                b1 -= 1
            elif b2:
                p = max(p - max(1.0, b1 / b2), 0.0)
                b2 -= 1
        self.p = p
        self._c["ghost_hits_b1"] += int(in1.sum())
        self._c["ghost_hits_b2"] += int((in2 & ~in1).sum())
        self._b1.discard(tags[in1])
        self._b2.discard(tags[in2])

    def victims(self, n: int, evictable: Mask, tags: I64) -> I64:
        self._apply()
        cand = np.flatnonzero(evictable)
        lists = self._list[cand]
        c1, c2 = cand[lists == _T1], cand[lists == _T2]
        target = int(self.p)
        # vLLM's rule, batched: take from T1 while its (virtual) size is >= p, then from
        # T2, and fall back to T1 when T2 runs out.
        want1 = min(n, self._n1 - target + 1) if self._n1 >= target else 0
        take1 = min(want1, len(c1))
        take2 = min(n - take1, len(c2))
        take1 += min(n - take1 - take2, len(c1) - take1)
        v1 = self._recency.oldest(take1, c1)
        v2 = self._recency.oldest(take2, c2)
        self._b1.push(tags[v1])
        self._b2.push(tags[v2])
        self._list[v1] = _NONE
        self._list[v2] = _NONE
        self._n1 -= len(v1)
        self._n2 -= len(v2)
        return np.concatenate([v1, v2])

    def forget(self, slots: I64) -> None:
        self._apply()
        lists = self._list[slots]
        self._n1 -= int(np.count_nonzero(lists == _T1))
        self._n2 -= int(np.count_nonzero(lists == _T2))
        self._list[slots] = _NONE

    def clear(self) -> None:
        self._list.fill(_NONE)
        self._n1 = self._n2 = 0
        self.p = 0.0
        self._b1.clear()
        self._b2.clear()
        self._admitted, self._reused, self._misses, self._logged = [], [], [], 0
        self._recency = Recency(self.capacity)

    def statistics(self) -> dict[str, float]:
        self._apply()
        return {
            "target_t1": self.p,
            "t1": self._n1,
            "t2": self._n2,
            "b1": len(self._b1),
            "b2": len(self._b2),
            **self._c,
        }
