"""S3-FIFO (Yang et al., SOSP '23) over slot arrays: a small FIFO, a main FIFO, a ghost.

A stored block enters S (about 10% of the capacity), or M directly when its key is in the
ghost G (it was evicted from S recently and came back). Each block counts its reuses (up
to 3). Evicting from S: a block reused at least once moves to M, any other leaves and its
tag goes to G. Evicting from M: a block with reuses left loses one and goes round again
(CLOCK), one without leaves. One-off blocks — a scan, a unique suffix — pass through S
and never disturb M, which is what makes it scan-resistant.

Placement (S or M) is decided at the next eviction, not at store time: it only matters
then, and the ghost lookup is one batch instead of one per store. An eviction reads the
queues from their old ends: O(evicted), plus the pinned and second-chance blocks it meets
there (they go round again); a queue that showed only pinned blocks since it last gave
anything is passed over for the rest of the call, so S's pinned blocks never keep M's
evictable ones in.

Who owns what: owned by one directory; see :mod:`kvferry.cache._policy`.
"""

from __future__ import annotations

import numpy as np

from ._policy import I64
from ._recency import Evictable
from ._table import GhostQueue

_NONE, _S, _M = 0, 1, 2
_MAX_FREQ = 3


class _Ring:
    """A FIFO of slots on a fixed ring: push at the young end, pop at the old end (slice
    copies, two where the ring wraps: no index arithmetic per slot)."""

    def __init__(self, size: int) -> None:
        self._a = np.zeros(size, np.int64)
        self._head = 0
        self.len = 0

    def push(self, slots: I64) -> None:
        n = len(slots)
        size = len(self._a)
        if self.len + n > size:
            raise OverflowError(f"ring of {size}: {self.len} + {n}")
        if not n:
            return
        start = self._head + self.len
        if start >= size:
            start -= size
        first = min(n, size - start)
        self._a[start : start + first] = slots[:first]
        if first < n:
            self._a[: n - first] = slots[first:]
        self.len += n

    def peek(self, n: int) -> I64:
        """The ``n`` oldest (fewer if fewer): a copy."""
        n = min(n, self.len)
        head, size = self._head, len(self._a)
        if head + n <= size:
            return self._a[head : head + n].copy()
        return np.concatenate([self._a[head:], self._a[: head + n - size]])

    def pop(self, n: int) -> None:
        self._head = (self._head + n) % len(self._a)
        self.len -= n

    def all(self) -> I64:
        return self.peek(self.len)

    def reset(self, slots: I64) -> None:
        self._head, self.len = 0, 0
        self.push(slots)


class S3FIFOPolicy:
    """Small FIFO + main CLOCK + ghost: a one-hit block never reaches M."""

    name = "s3fifo"

    small_share = 0.1
    """Share of the capacity S may hold before eviction takes from M instead."""

    def __init__(self, capacity: int, *, compiled: bool | None = None) -> None:
        self.capacity = capacity
        self._queue = np.zeros(capacity, np.int8)
        self._freq = np.zeros(capacity, np.int8)
        self._s = _Ring(capacity)
        self._m = _Ring(capacity)
        self._ghost = GhostQueue(capacity, compiled=compiled)  # (its tag table's)
        # The hot path logs; _apply() replays the log in bulk before a decision.
        self._unplaced: list[tuple[I64, I64]] = []
        self._reused: list[I64] = []
        self._logged = 0
        self._c = {"promotions": 0, "ghost_hits": 0, "evicted_small": 0, "evicted_main": 0}

    def admit(self, slots: I64, tags: I64) -> None:
        self._unplaced.append((slots, tags))
        self._log(len(slots))

    def reuse(self, slots: I64) -> None:
        self._reused.append(slots)
        self._log(len(slots))

    def _log(self, n: int) -> None:
        self._logged += n
        if self._logged > 1 << 16:  # bound the log while nothing is evicted
            self._apply()

    def touch(self, slots: I64) -> None:
        pass  # FIFO order: recency without a reuse changes nothing

    def store_miss(self, tags: I64) -> None:
        pass  # the ghost is consulted when the stored blocks are placed

    def _apply(self) -> None:
        """Replay the log: place the admitted blocks, then count reuses — a key's
        admission always came before its reuses, and no slot changes hands between two
        decisions (a clear applies the log first)."""
        if self._unplaced:
            self._place(
                np.concatenate([s for s, _ in self._unplaced]),
                np.concatenate([t for _, t in self._unplaced]),
            )
        if self._reused:
            slots = np.concatenate(self._reused)
            slots, times = np.unique(slots[self._queue[slots] != _NONE], return_counts=True)
            freq = self._freq[slots] + np.minimum(times, _MAX_FREQ)
            self._freq[slots] = np.minimum(freq, _MAX_FREQ)
        self._unplaced, self._reused, self._logged = [], [], 0

    def _place(self, slots: I64, tags: I64) -> None:
        self._freq[slots] = 0
        back = self._ghost.discard(tags)
        self._c["ghost_hits"] += int(back.sum())
        self._queue[slots[back]] = _M
        self._m.push(slots[back])
        self._queue[slots[~back]] = _S
        self._s.push(slots[~back])

    def victims(self, n: int, evictable: Evictable, tags: I64) -> I64:
        self._apply()
        out: list[I64] = []
        need = n
        # Pinned blocks met at a queue's old end go round again; once a queue showed only
        # pinned blocks since it last gave anything (``stalled`` of them, its whole
        # length), it is passed over for the rest of the call: S's pinned blocks must not
        # keep M's evictable ones in, and nothing is read twice without progress.
        # Index arrays, not boolean masks, and counts, not sums: a chunk costs what its
        # numpy calls cost (a store's inline eviction takes a few dozen blocks).
        stalled = {True: 0, False: 0}
        small_target = self.small_share * self.capacity
        freq_of, queue = self._freq, self._queue
        while need > 0:
            small_ok = self._s.len > stalled[True]
            main_ok = self._m.len > stalled[False]
            if not (small_ok or main_ok):
                break
            from_small = small_ok and (self._s.len > small_target or not main_ok)
            ring = self._s if from_small else self._m
            chunk = ring.peek(max(need, 64))
            ok = np.asarray(evictable(chunk), np.bool_)
            freq = freq_of[chunk]
            # Leaves: never reused (in S), or out of second chances (in M).
            leave = (ok & (freq == 0)).nonzero()[0]
            cut = len(chunk)
            if len(leave) > need:
                cut = int(leave[need - 1]) + 1
                chunk, ok, freq, leave = chunk[:cut], ok[:cut], freq[:cut], leave[:need]
            ring.pop(cut)
            usable = int(np.count_nonzero(ok))
            stalled[from_small] = 0 if usable else stalled[from_small] + cut
            gone = chunk[leave]
            if from_small:
                # Reused at least once while in S: it earned a place in M.
                up = chunk[(ok & (freq > 0)).nonzero()[0]]
                if len(up):
                    freq_of[up] = 0
                    queue[up] = _M
                    self._m.push(up)
                if usable < cut:
                    self._s.push(chunk[(~ok).nonzero()[0]])
                self._ghost.push(tags[gone])
                self._c["promotions"] += len(up)
                self._c["evicted_small"] += len(gone)
            else:
                if len(gone) < cut:
                    again = chunk[(ok & (freq > 0)).nonzero()[0]]
                    freq_of[again] -= 1
                    # Pinned and second-chance blocks go round again, in their old order.
                    kept = np.ones(cut, np.bool_)
                    kept[leave] = False
                    self._m.push(chunk[kept.nonzero()[0]])
                self._c["evicted_main"] += len(gone)
            queue[gone] = _NONE
            out.append(gone)
            need -= len(gone)
        if not out:
            return np.zeros(0, np.int64)
        return np.concatenate(out) if len(out) > 1 else out[0]

    def forget(self, slots: I64) -> None:
        self._apply()
        self._queue[slots] = _NONE
        for ring, q in ((self._s, _S), (self._m, _M)):
            kept = ring.all()
            ring.reset(kept[self._queue[kept] == q])

    def clear(self) -> None:
        self._queue.fill(_NONE)
        self._s.reset(np.zeros(0, np.int64))
        self._m.reset(np.zeros(0, np.int64))
        self._ghost.clear()
        self._unplaced, self._reused, self._logged = [], [], 0

    def statistics(self) -> dict[str, float]:
        self._apply()
        return {
            "small": self._s.len,
            "main": self._m.len,
            "ghost": len(self._ghost),
            **self._c,
        }
