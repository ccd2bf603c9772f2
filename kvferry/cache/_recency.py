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
- A log of 2**18 entries or more whose end reaches its buffer goes on in a new buffer
  (about twice the list's live entries; a shorter one is compacted in one pass, a few ms
  at most), and the old one is moved over a little at a time by later appends: its live
  entries, newest first, into a space left free before the new buffer's first entry, a
  few times as many entries as each append brings, so that the move ends long before
  the new buffer fills. Pops read the old buffer first (it holds the oldest entries).
  Never a pass over the whole log in one call (at 4M slots such a pass took 55 ms on the
  2-core machine), amortized O(1) per append; memory follows the list's size (about
  ``2 * capacity`` entries, 8 bytes a slot, twice that while a move is under way, plus 5
  bytes a slot for ``member`` and ``_pos``). The buffers of successive generations are
  numbered from 0 and from ``2**30`` in turn (``_pos`` holds the number), so an entry of
  the old buffer is never taken for one of the new.

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


_HALF = 1 << 30
"""The second generation's numbering starts here (a buffer holds at most this many)."""


class _Log:
    """One list's entries, oldest at ``head``, newest at ``tail - 1`` (indices into
    ``buf``; entry ``i`` is numbered ``base + i`` in ``_pos``)."""

    __slots__ = ("base", "buf", "head", "tail")

    def __init__(self, size: int, base: int = 0, start: int = 0) -> None:
        if size > _HALF:
            raise OverflowError(f"a recency log of {size} entries (at most {_HALF})")
        self.buf: I32 = np.zeros(size, np.int32)
        self.base = base
        self.head = start
        self.tail = start

    def numbers(self, start: int, n: int) -> I32:
        """The numbers of entries ``start .. start + n - 1``."""
        return np.arange(self.base + start, self.base + start + n, dtype=np.int32)


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

    move_from = 1 << 18
    """A full log of this many entries or more goes on in a new buffer and is moved over
    a little at a time; a shorter one is compacted in one pass (a few ms at most)."""

    move_batch = 1 << 14
    """Entries moved over at a time (each move is a few numpy calls)."""

    def __init__(self, capacity: int, lists: int = 1, *, initial: int = 4096) -> None:
        if capacity <= 0 or lists <= 0:
            raise ValueError(f"need capacity > 0 and lists > 0, got {capacity}, {lists}")
        self.capacity = capacity
        self.member = np.zeros(capacity, np.int8)
        self._pos = np.full(capacity, -1, np.int32)
        self._initial = max(8, min(capacity, initial))
        self._logs = [_Log(self._initial) for _ in range(lists + 1)]  # [0] unused
        # The previous buffer of each list, while its entries are being moved over, and
        # how many of them each appended entry moves.
        self._old: list[_Log | None] = [None] * (lists + 1)
        self._rate = [0] * (lists + 1)
        self._owed = [0] * (lists + 1)  # entries to move, not yet moved
        self.rebuilds = 0
        """Lists rewritten in one pass because a move found no room (never, unless a bug)."""
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
        k = len(slots)
        if self._old[lst] is not None:
            self._owed[lst] += self._rate[lst] * k
            if self._owed[lst] >= self.move_batch:  # a few numpy calls: not at every append
                self._move(lst, self._owed[lst])
                self._owed[lst] = 0
        log = self._logs[lst]
        if log.tail + k > len(log.buf):
            if self._old[lst] is not None:  # (the rate makes this rare: what is left)
                self._move(lst, _HALF)
            if log.tail - log.head < self.move_from:
                self._compact(lst, k)
            else:
                log = self._renew(lst, k)
        log.buf[log.tail : log.tail + k] = slots
        self._pos[slots] = log.numbers(log.tail, k)
        log.tail += k

    def _live(self, lst: int, log: _Log, start: int, entries: I32) -> Mask:
        live: Mask = (self.member[entries] == lst) & (
            self._pos[entries] == log.numbers(start, len(entries))
        )
        return live

    def _compact(self, lst: int, room: int) -> None:
        """Rewrite list ``lst``'s live entries from index 0, with ``room`` free after them
        (a log shorter than :attr:`move_from`: one pass costs less than moving it over)."""
        log = self._logs[lst]
        entries = log.buf[log.head : log.tail]
        keep = entries[self._live(lst, log, log.head, entries)]
        m = len(keep)
        if 2 * (m + room) > len(log.buf):
            log.buf = _Log(max(self._initial, 2 * (m + room))).buf  # (its bound checked)
        log.buf[:m] = keep
        self._pos[keep] = log.numbers(0, m)
        log.head, log.tail = 0, m

    def _rebuild(self, lst: int, front: I32, room: int) -> None:
        """List ``lst`` rewritten in one pass into a new buffer: ``front`` (its oldest
        live entries, from elsewhere), then the live entries of its buffer. What the
        moves over never need (their room is always there); a bug's safe way out."""
        parts = [front]
        for log in (self._old[lst], self._logs[lst]):  # the old buffer's are the older
            if log is not None:
                entries = log.buf[log.head : log.tail]
                parts.append(entries[self._live(lst, log, log.head, entries)])
        self._old[lst] = None
        keep = np.concatenate(parts)
        m = len(keep)
        log = self._logs[lst]
        new = _Log(max(self._initial, 2 * (m + room)), _HALF if log.base == 0 else 0)
        new.buf[:m] = keep
        self._pos[keep] = new.numbers(0, m)
        new.tail = m
        self._logs[lst] = new
        self.rebuilds += 1

    def _renew(self, lst: int, room: int) -> _Log:
        """A new buffer for list ``lst``, with ``room`` for the append that asked for it;
        the full one becomes the old, moved over by the next appends."""
        old = self._logs[lst]
        # At most this many of the old entries are live: the space left before the new
        # buffer's first entry for them (so that the old ones stay the oldest).
        reserve = self._room_for_old(lst)
        n_old = old.tail - old.head
        size = max(self._initial, 2 * (reserve + room), reserve + n_old // 4 + room)
        new = _Log(size, _HALF if old.base == 0 else 0, reserve)
        self._logs[lst] = new
        self._owed[lst] = 0
        if n_old:
            self._old[lst] = old
            # Moved over by the time half the new buffer's space for appends is used.
            free = size - reserve - room
            self._rate[lst] = max(1, -(-2 * n_old // max(free, 1)))
        return new

    def _room_for_old(self, lst: int) -> int:
        """At most this many of a full log's entries are live: its list's size."""
        return self._sizes[lst]

    def _move(self, lst: int, count: int) -> None:
        """Move up to ``count`` entries of the old buffer's young end over to the new
        buffer, before its first entry (the live ones; the stale ones are dropped)."""
        old, log = self._old[lst], self._logs[lst]
        if old is None:
            return
        lo = max(old.head, old.tail - count)
        entries = old.buf[lo : old.tail]
        keep = entries[self._live(lst, old, lo, entries)]
        m = len(keep)
        if m > log.head:  # not expected (the room was left for every live entry): one pass
            entries = old.buf[old.head : old.tail]
            self._old[lst] = None
            self._rebuild(lst, entries[self._live(lst, old, old.head, entries)], 0)
            return
        log.head -= m
        log.buf[log.head : log.head + m] = keep
        self._pos[keep] = log.numbers(log.head, m)
        old.tail = lo
        if old.tail <= old.head:
            self._old[lst] = None

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
        pos = self._pos
        one_list = len(self._sizes) == 2
        out: list[I64] = []
        held: list[I32] = []
        need = n
        old = self._old[lst]
        logs = [self._logs[lst]] if old is None else [old, self._logs[lst]]
        log = logs[0]
        for log in logs:  # the old buffer's entries are the oldest
            buf = log.buf
            while need > 0 and log.head < log.tail:
                start = log.head
                span = min(log.tail - start, max(2 * need, 256))
                entries = buf[start : start + span]
                live = pos[entries] == log.numbers(start, span)
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
            if need <= 0:
                break
            if log is old:  # read to its end: the new buffer holds the rest
                self._old[lst] = None
        if held:  # back at the old end (of the buffer the pop ended in), in their order
            refused = np.concatenate(held) if len(held) > 1 else held[0]
            if len(refused) > log.head:  # not expected (see _renew's room): one pass
                self._rebuild(lst, refused, 0)
            else:
                log.head -= len(refused)
                log.buf[log.head : log.head + len(refused)] = refused
                pos[refused] = log.numbers(log.head, len(refused))
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
        parts = []
        for log in (self._old[lst], self._logs[lst]):
            if log is not None:
                entries = log.buf[log.head : log.tail]
                parts.append(entries[self._live(lst, log, log.head, entries)])
        out: I64 = np.concatenate(parts).astype(np.int64)
        return out

    def clear(self) -> None:
        self.member.fill(NONE)
        self._pos.fill(-1)
        self._logs = [_Log(self._initial) for _ in self._logs]
        self._old = [None] * len(self._logs)
        self._owed = [0] * len(self._logs)
        self._sizes = [0] * len(self._sizes)
        self._pending, self._codes, self._pending_len = [], [], 0

    @property
    def nbytes(self) -> int:
        logs = [*self._logs, *(log for log in self._old if log is not None)]
        return self.member.nbytes + self._pos.nbytes + sum(log.buf.nbytes for log in logs)


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
