"""Recency lists that yield their oldest evictable slots in O(evicted): lazy logs in numpy.

A policy keeps its resident slots in one or more lists (LRU: one; ARC: T1 and T2), each
in recency order. A list is an append-only *log* of slots (int32): making a slot the
newest of a list appends it, and its earlier entries go *stale*. A slot knows its list
(``member``, int8) and the index of its live entry in that list's log (``_pos``, int32),
so an entry is live iff ``member[slot] == list and _pos[slot] == index``; nothing is
ever searched for or unlinked.

- Making slots newest only records them (a Python list append, no numpy): the record is
  replayed in one vectorized pass (:meth:`RecencyLists.flush`) before any decision, or
  when it grows long. Amortized O(1) per slot.
- :meth:`~RecencyLists.pop` reads a list from its old end in chunks, drops the stale
  entries for good, hands back the oldest live entries the caller's ``evictable`` accepts,
  and puts the live ones it refused (pinned, protected) back at the old end, in their
  order: they are met again by the next eviction, and nothing about their age is lost.
  O(evicted + stale + refused) per call, never O(capacity).
- A log whose end reaches its buffer is compacted (its live entries rewritten from the
  start and renumbered), growing to twice its live entries when those fill more than half
  of it: amortized O(1) per append, and memory follows the list's size (at most about
  ``2 * capacity`` entries, 8 bytes a slot, plus 5 bytes a slot for ``member`` and
  ``_pos``).

Who owns what: an instance belongs to one policy (so to one directory) and is called
from its owner's task only.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from itertools import compress, islice, repeat

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]
Mask = npt.NDArray[np.bool_]
Evictable = Callable[[I64], Mask]
"""Given candidate slots, whether each may be evicted now (READY, unpinned, unprotected)."""

NONE = 0
"""``member`` of a slot in no list."""

_STAY = 0
"""A recorded batch that only makes its member slots the newest of their own lists."""


class _Log:
    """One list's entries, oldest at ``head``, newest at ``tail - 1``."""

    __slots__ = ("buf", "head", "tail")

    def __init__(self, size: int) -> None:
        self.buf: I32 = np.zeros(size, np.int32)
        self.head = 0
        self.tail = 0


class RecencyLists:
    """``lists`` recency lists (numbered 1..lists) over the slots ``range(capacity)``.

    :meth:`enter` puts slots not in any list at the young end of one; :meth:`promote`
    moves slots that are in a list to the young end of another; :meth:`refresh` moves
    them to the young end of their own. Each takes a batch in prefix order: its head
    becomes the newest, so a prefix loses its tail first. A slot given twice in one batch
    keeps its first (newest) place. All three only record; the record is replayed in
    order, so a decision always sees every call made before it.
    """

    max_pending = 1 << 16
    """Recorded slots replayed at the latest after this many."""

    def __init__(self, capacity: int, lists: int = 1, *, initial: int = 4096) -> None:
        if capacity <= 0 or lists <= 0:
            raise ValueError(f"need capacity > 0 and lists > 0, got {capacity}, {lists}")
        self.capacity = capacity
        self.member = np.zeros(capacity, np.int8)
        self._pos = np.full(capacity, -1, np.int32)
        self._initial = max(8, min(capacity, initial))
        self._logs = [_Log(self._initial) for _ in range(lists + 1)]  # [0] unused
        self._sizes = [0] * (lists + 1)
        self._pending: list[I64] = []
        self._codes: list[int] = []
        self._pending_len = 0
        self.promoted = 0
        """Slots that moved from list 1 to another list (ARC's promotions)."""

    # -- recording ---------------------------------------------------------------------

    def enter(self, slots: I64, lst: int) -> None:
        """``slots`` (in no list) become the newest of list ``lst``."""
        self._record(slots, lst)

    def promote(self, slots: I64, lst: int) -> None:
        """``slots`` that are in some list become the newest of ``lst``; others are ignored."""
        self._record(slots, -lst)

    def refresh(self, slots: I64) -> None:
        """``slots`` that are in some list become the newest of their own list."""
        self._record(slots, _STAY)

    def _record(self, slots: I64, code: int) -> None:
        if not len(slots):
            return
        self._pending.append(slots)
        self._codes.append(code)
        self._pending_len += len(slots)
        if self._pending_len > self.max_pending:
            self.flush()

    def flush(self) -> None:
        """Replay the record: one vectorized pass, whatever its length."""
        if not self._pending:
            return
        pending, codes = self._pending, self._codes
        self._pending, self._codes, self._pending_len = [], [], 0
        # Time order: batches in order, each reversed (its head is its newest entry): the
        # batches joined last first, read backwards (one view, not one a batch).
        cat = np.concatenate(pending[::-1])[::-1].astype(np.int64, copy=False)
        code = np.repeat(np.asarray(codes, np.int64), [len(s) for s in pending])
        member = self.member
        # Each slot's last entry decides its place; the lists it went through on the way
        # only matter for the final list: admissions come before a key's reuses (a slot
        # changes hands only after leaving every list, and that replays the record first).
        # ``_pos`` as scratch (every slot here gets a new position or none below): the
        # index of each slot's last entry, so its last entries in time order, without a sort.
        pos, idx = self._pos, np.arange(len(cat), dtype=np.int32)
        pos[cat] = -1
        np.maximum.at(pos, cat, idx)
        slots = cat[pos[cat] == idx]
        pos[slots] = -1
        old = member[slots]
        entering = code > 0
        if entering.any():
            member[cat[entering]] = code[entering]
        promoting = code < 0
        if promoting.any():
            mid = member[slots]
            tgt, dest = cat[promoting], -code[promoting]
            keep = member[tgt] != NONE
            member[tgt[keep]] = dest[keep]
            new = member[slots]
            self.promoted += int(np.count_nonzero((mid == 1) & (new != 1) & (new != NONE)))
        else:
            new = member[slots]
        sizes = self._sizes
        for lst in range(1, len(sizes)):
            in_new = new == lst
            sizes[lst] += int(np.count_nonzero(in_new)) - int(np.count_nonzero(old == lst))
            if in_new.any():
                self._append(lst, slots[in_new])

    def _append(self, lst: int, slots: I64) -> None:
        log = self._logs[lst]
        k = len(slots)
        if log.tail + k > len(log.buf):
            self._compact(lst, k)
        log.buf[log.tail : log.tail + k] = slots
        self._pos[slots] = np.arange(log.tail, log.tail + k, dtype=np.int32)
        log.tail += k

    def _live(self, lst: int, start: int, entries: I32) -> Mask:
        idx = np.arange(start, start + len(entries), dtype=np.int32)
        live: Mask = (self.member[entries] == lst) & (self._pos[entries] == idx)
        return live

    def _compact(self, lst: int, room: int) -> None:
        """Rewrite list ``lst``'s live entries from index 0, with ``room`` free after them."""
        log = self._logs[lst]
        entries = log.buf[log.head : log.tail]
        keep = entries[self._live(lst, log.head, entries)]
        m = len(keep)
        size = len(log.buf)
        if 2 * (m + room) > size:
            size = max(self._initial, 2 * (m + room))
            buf: I32 = np.zeros(size, np.int32)
            buf[:m] = keep
            log.buf = buf
        else:
            log.buf[:m] = keep
        self._pos[keep] = np.arange(m, dtype=np.int32)
        log.head, log.tail = 0, m

    # -- decisions ---------------------------------------------------------------------

    def size(self, lst: int) -> int:
        """Slots in list ``lst``."""
        self.flush()
        return self._sizes[lst]

    def pop(self, lst: int, n: int, evictable: Evictable) -> I64:
        """Take up to ``n`` of list ``lst``'s oldest slots that ``evictable`` accepts, oldest
        first; they leave every list. Fewer only when fewer are evictable.

        A dozen numpy calls a chunk, whatever its length (at a few µs each on a loaded CPU,
        they are what a store's eviction of a few dozen blocks costs): the live entries
        found by their position alone where there is one list, and the refused ones
        gathered only when there are some."""
        self.flush()
        log = self._logs[lst]
        pos, buf = self._pos, log.buf
        one_list = len(self._sizes) == 2
        out: list[I64] = []
        held: list[I32] = []
        need = n
        while need > 0 and log.head < log.tail:
            start = log.head
            span = min(log.tail - start, max(2 * need, 256))
            entries = buf[start : start + span]
            live = pos[entries] == np.arange(start, start + span, dtype=np.int32)
            if not one_list:
                live &= self.member[entries] == lst
            at = live.nonzero()[0]
            cand = entries[at].astype(np.int64)
            ok = np.asarray(evictable(cand), np.bool_)
            took = ok.nonzero()[0]
            found = len(took)
            if found >= need:  # stop right after the need-th: the rest stays for next time
                last = int(took[need - 1])
                span = int(at[last]) + 1
                cand, ok, took = cand[: last + 1], ok[: last + 1], took[:need]
                found = need
            out.append(cand[took] if found < len(cand) else cand)
            if found < len(cand):
                held.append(cand[~ok].astype(np.int32))
            need -= found
            log.head = start + span
        if held:  # back at the old end, in their order
            refused = np.concatenate(held) if len(held) > 1 else held[0]
            log.head -= len(refused)
            buf[log.head : log.head + len(refused)] = refused
            pos[refused] = np.arange(log.head, log.head + len(refused), dtype=np.int32)
        if not out:
            return np.zeros(0, np.int64)
        victims = np.concatenate(out) if len(out) > 1 else out[0]
        self.member[victims] = NONE
        pos[victims] = -1
        self._sizes[lst] -= len(victims)
        return victims

    def remove(self, slots: I64) -> None:
        """``slots`` leave every list (a slot in none is ignored, a slot given twice
        leaves once)."""
        self.flush()
        if len(slots) > 1:
            slots = np.unique(slots)
        old = self.member[slots]
        for lst in range(1, len(self._sizes)):
            self._sizes[lst] -= int(np.count_nonzero(old == lst))
        self.member[slots] = NONE
        self._pos[slots] = -1

    def order(self, lst: int) -> I64:
        """List ``lst``'s slots, oldest first (O(its log); for tests and statistics)."""
        self.flush()
        log = self._logs[lst]
        entries = log.buf[log.head : log.tail]
        out: I64 = entries[self._live(lst, log.head, entries)].astype(np.int64)
        return out

    def clear(self) -> None:
        self.member.fill(NONE)
        self._pos.fill(-1)
        self._logs = [_Log(self._initial) for _ in self._logs]
        self._sizes = [0] * len(self._sizes)
        self._pending, self._codes, self._pending_len = [], [], 0

    @property
    def nbytes(self) -> int:
        return self.member.nbytes + self._pos.nbytes + sum(log.buf.nbytes for log in self._logs)


class OrderedRecency:
    """One recency list in an ``OrderedDict`` of slots, oldest first: LRU's order where
    the directory is tuned for CPU (``index="dict"``, the host tier).

    The same answers as a one-list :class:`RecencyLists` (tests hold both to one order),
    at a fraction of its cost for the batches a step brings (a request's few dozen
    blocks): no numpy call to record, one ``move_to_end`` per slot in C, and
    :meth:`pop` reads candidates off the old end, so a store's inline eviction of a dozen
    blocks costs a few µs where the log's replay and pop cost a few dozen numpy calls.
    O(1) per slot recorded, O(evicted + refused) per pop, whatever the capacity. About
    120 bytes a slot (a node and a dict entry; 123 measured at 1M slots), where the log's
    13 suit a directory of millions of slots, and its vectorized replay the evictor's
    large batches (:class:`LogRecency`).

    Who owns what: like :class:`RecencyLists`, one policy's, called from its task only.
    """

    def __init__(self) -> None:
        self._od: OrderedDict[int, None] = OrderedDict()

    def enter(self, slots: I64) -> None:
        """``slots`` become the newest, the batch's head newest (a slot given twice keeps
        its first place)."""
        order = slots.tolist()[::-1]
        od = self._od
        deque(map(od.__setitem__, order, repeat(None)), 0)
        deque(map(od.move_to_end, order), 0)

    def refresh(self, slots: I64) -> None:
        """``slots`` that are in the list become its newest, the batch's head newest."""
        od = self._od
        deque(map(od.move_to_end, filter(od.__contains__, slots.tolist()[::-1])), 0)

    def refresh_found(self, found: list[int]) -> None:
        """:meth:`refresh` of slots as a key index found them (-1 for an absent key, a slot
        in any state): those in the list are READY ones, and only they move."""
        od = self._od
        deque(map(od.move_to_end, filter(od.__contains__, reversed(found))), 0)

    def pop(self, n: int, evictable: Evictable) -> I64:
        """Up to ``n`` of the oldest slots ``evictable`` accepts, oldest first; they leave
        the list. The refused ones keep their place (the next pop meets them again)."""
        od = self._od
        out: list[int] = []
        skip = 0
        while len(out) < n and skip < len(od):
            need = n - len(out)
            cand = list(islice(od, skip, skip + max(2 * need, 32)))
            ok = np.asarray(evictable(np.array(cand, np.int64)), np.bool_).tolist()
            took = list(compress(cand, ok))[:need]  # the rest stays in place
            skip += len(cand) - len(took)  # refused ones stay ahead of the next chunk
            out.extend(took)
            deque(map(od.__delitem__, took), 0)
        return np.array(out, np.int64)

    def remove(self, slots: I64) -> None:
        """``slots`` leave the list (a slot not in it is ignored)."""
        od = self._od
        deque(map(od.pop, slots.tolist(), repeat(None)), 0)

    def order(self) -> I64:
        """The slots, oldest first."""
        return np.array(list(self._od), np.int64)

    def __len__(self) -> int:
        return len(self._od)

    def clear(self) -> None:
        self._od.clear()


class LogRecency:
    """One list of a :class:`RecencyLists` behind :class:`OrderedRecency`'s interface, so
    that LRU holds either without asking which."""

    def __init__(self, capacity: int) -> None:
        self._lists = RecencyLists(capacity)

    def enter(self, slots: I64) -> None:
        self._lists.enter(slots, 1)

    def refresh(self, slots: I64) -> None:
        self._lists.refresh(slots)

    def pop(self, n: int, evictable: Evictable) -> I64:
        return self._lists.pop(1, n, evictable)

    def remove(self, slots: I64) -> None:
        self._lists.remove(slots)

    def order(self) -> I64:
        return self._lists.order(1)

    def __len__(self) -> int:
        return self._lists.size(1)

    def clear(self) -> None:
        self._lists.clear()
