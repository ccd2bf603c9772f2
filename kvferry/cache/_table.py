"""Compact hash tables in numpy, for fingerprints of millions of keys without a Python
object per entry.

:class:`TagTable` maps nonzero 64-bit tags to int32 values. It is open addressing over
buckets of :data:`WIDTH` entries (one 64-byte cache line of tags): a tag lives in its home
bucket, or — when that bucket is full — in the next bucket with room. Every bucket an insert
passes over counts it in ``_over``, so a search stops at the first bucket that never
overflowed, and a removal gives the counts back; no tombstones, no rehash. All operations
take and return arrays, one numpy pass per probe round (almost always one round).

:class:`FingerprintQueue` is a bounded FIFO set of tags with an optional int32 payload,
on a ring plus a :class:`TagTable` (and each entry's position in the table, so that the
old end leaves without a search), its memory following its size: the admission counter
uses it, and :class:`GhostQueue` — the ghost lists of ARC and S3-FIFO — keeps its youngest
pushes in a dict and enters them into one in batches (an eviction at watermarks (1, 1)
pushes a few dozen tags, which would cost a dozen numpy calls each time). (The
directory's key index is :class:`~kvferry.cache._index.KeyIndex`: it verifies full keys,
which these tables need not.)

Tags are Python's ``hash()`` of the key bytes, ``| 1`` so that 0 means empty. ``hash()``
of bytes is salted per process: fine here, these tables live in one process and nothing in
them is persisted or compared across processes (DESIGN §4.8 is about the keys themselves).
Equal tags of different keys are possible (2^-63 per pair): the ghost lists and the
admission counter accept such a false match, which only misleads a policy hint.

Who owns what: an instance belongs to one owner (a policy, or the directory) and is
single-threaded, like its owner.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import compress, repeat

import numpy as np
import numpy.typing as npt

from . import _kernels

I64 = npt.NDArray[np.int64]

WIDTH = _kernels.WIDTH
"""Entries per bucket."""

_BYTES = 0x0101010101010101


def _first_set(rows: npt.NDArray[np.bool_]) -> tuple[npt.NDArray[np.bool_], I64]:
    """For (n, 8) bool rows: whether any is set, and the column of the first set one.

    A row of 8 bools is one little-endian uint64 (column i is byte i): a few ops on n
    integers instead of a reduction along a short axis, which numpy does slowly.
    """
    v = rows.view("<u8").ravel().astype(np.uint64)
    lowest = v & (~v + np.uint64(1))
    col = (np.bitwise_count(lowest - np.uint64(1)) >> 3).astype(np.int64)
    return v != 0, col


def _nth_set(rows: npt.NDArray[np.bool_], n: I64) -> tuple[npt.NDArray[np.bool_], I64]:
    """For (k, 8) bool rows: whether row i has more than ``n[i]`` set, and the column of
    its ``n[i]``-th (from 0) set one. Byte-wise prefix sums by one multiplication."""
    v = rows.view("<u8").ravel().astype(np.uint64)
    prefix = (v * np.uint64(_BYTES)).astype("<u8")  # byte i: set ones in columns 0..i
    fits = n < (prefix >> np.uint64(56)).astype(np.int64)
    before = prefix.view(np.uint8).reshape(-1, WIDTH) <= n[:, None].astype(np.uint8)
    col = ((before.view("<u8").ravel() * np.uint64(_BYTES)) >> np.uint64(56)).astype(np.int64)
    return fits, col


def tags_of(keys: Sequence[bytes]) -> I64:
    """The table tag of each key: its ``hash()`` (cached on the bytes object), made nonzero."""
    tags = np.fromiter(map(hash, keys), np.int64, len(keys))
    tags |= 1
    return tags


class TagTable:
    """Nonzero int64 tag → int32 value, for up to ``capacity`` live entries.

    The table never grows: inserting beyond ``capacity`` is a caller bug (``OverflowError``).
    Duplicate tags are allowed; :meth:`find` returns one of them.
    """

    def __init__(
        self, capacity: int, *, max_load: float = 0.5, compiled: bool | None = None
    ) -> None:
        if capacity <= 0 or not 0 < max_load <= 1:
            raise ValueError(f"need capacity > 0 and 0 < max_load <= 1: {capacity}, {max_load}")
        # Any bucket count (a modulo, not a mask): no power-of-two rounding of the memory.
        nb = max(1, -(-int(capacity / max_load) // WIDTH))
        self.capacity = capacity
        self._nb = nb
        self._tags = np.zeros((nb, WIDTH), np.int64)
        self._vals = np.full((nb, WIDTH), -1, np.int32)
        self._over = np.zeros(nb, np.int32)
        self.size = 0
        # Insert, find, contains and remove compiled (numba) where the owner's
        # ``compiled`` says so: one pass per tag instead of numpy's passes per round.
        self._k = _kernels.choose(compiled)
        self._ft, self._fv = self._tags.reshape(-1), self._vals.reshape(-1)

    @property
    def num_buckets(self) -> int:
        return self._nb

    def home(self, tags: I64) -> I64:
        """The bucket each tag belongs in."""
        out: I64 = (tags >> 1) % self._nb
        return out

    def values_at(self, pos: I64) -> I64:
        """Values at flat positions from :meth:`find` (-1 where ``pos`` is -1)."""
        vals: I64 = self._vals.reshape(-1)[pos].astype(np.int64)
        vals[pos < 0] = -1
        return vals

    def set_values_at(self, pos: I64, values: npt.ArrayLike) -> None:
        self._vals.reshape(-1)[pos] = values

    def contains(self, tags: I64) -> npt.NDArray[np.bool_]:
        """Whether each tag is present: :meth:`find` without positions, in fewer numpy
        calls (one probe round almost always; the column only of tags found)."""
        if not self.size:
            return np.zeros(len(tags), np.bool_)
        if self._k is not None:
            out: npt.NDArray[np.bool_] = self.find(tags) >= 0
            return out
        home = self.home(tags)
        tags2 = tags[:, None]
        hit: npt.NDArray[np.bool_] = (self._rows(home) == tags2).view("<u8").ravel() != 0
        todo = (~hit & (self._over[home] > 0)).nonzero()[0]
        bucket = home[todo]
        # At most every bucket once, as the kernel: where every bucket has overflowed
        # (reachable at a high ``max_load``), an absent tag's chain is a cycle.
        for _ in range(self._nb - 1):
            if not len(todo):
                break
            bucket = (bucket + 1) % self._nb
            found = (self._rows(bucket) == tags2[todo]).view("<u8").ravel() != 0
            hit[todo[found]] = True
            keep = ~found & (self._over[bucket] > 0)
            todo, bucket = todo[keep], bucket[keep]
        return hit

    def find(self, tags: I64) -> I64:
        """Flat position of each tag, -1 where absent."""
        if not self.size:
            return np.full(len(tags), -1, np.int64)
        if self._k is not None:
            found = np.empty(len(tags), np.int64)
            self._k.table_find(self._ft, self._over, self._nb, tags, found)
            return found
        home = self.home(tags)
        hit, col = _first_set(self._rows(home) == tags[:, None])
        pos: I64 = home * WIDTH + col
        if hit.all():
            return pos
        pos[~hit] = -1
        # Search on only where the home bucket once overflowed (rare at max_load 0.5).
        todo = np.flatnonzero(~hit)
        todo = todo[self._over[home[todo]] > 0]
        bucket = home
        for _ in range(self._nb - 1):  # at most every bucket once (see contains)
            if not len(todo):
                break
            bucket[todo] = (bucket[todo] + 1) % self._nb
            b = bucket[todo]
            hit, col = _first_set(self._rows(b) == tags[todo, None])
            pos[todo[hit]] = b[hit] * WIDTH + col[hit]
            todo = todo[~hit]
            todo = todo[self._over[bucket[todo]] > 0]
        return pos

    def _rows(self, buckets: I64) -> npt.NDArray[np.int64]:
        """The tag rows of ``buckets``, (n, WIDTH): ``take`` along the first axis, 4x
        faster than fancy indexing of a 2-D array (measured: 34 against 150 µs for 4,096)."""
        rows: npt.NDArray[np.int64] = np.take(self._tags, buckets, axis=0)
        return rows

    def insert(self, tags: I64, values: npt.ArrayLike) -> I64:
        """Insert each (tag, value); returns their flat positions. Tags must be nonzero."""
        vals = np.asarray(values, np.int32)
        n = len(tags)
        if self.size + n > self.capacity:
            raise OverflowError(f"TagTable of {self.capacity} entries: {self.size} + {n}")
        if vals.ndim == 0:  # one value for every tag
            vals = np.full(n, vals, np.int32)
        if self._k is not None:
            placed = np.empty(n, np.int64)
            self._k.table_insert(self._ft, self._fv, self._over, self._nb, tags, vals, placed)
            self.size += n
            return placed
        bucket = self.home(tags)
        pos = np.empty(n, np.int64)
        todo = np.arange(n)
        flat_tags, flat_vals = self._tags.reshape(-1), self._vals.reshape(-1)
        # Each tag finds its cell within ``nb`` rounds where there is room: a bucket it
        # could not enter is full after that round. Bounded all the same, so that a table
        # whose cells disagree with its size raises instead of probing forever.
        for _ in range(self._nb):
            if not len(todo):
                break
            b = bucket[todo]
            m = len(b)
            # The round's tags by bucket, ties in their order: one sort of bucket * m + i
            # (a stable argsort costs 6x as much).
            distinct = m < 2
            if not distinct:
                ordered = np.sort(b * m + np.arange(m))
                runs = ordered // m
                distinct = not (runs[1:] == runs[:-1]).any()
            if distinct:
                # Distinct buckets (the common case of a small batch): each its first free cell.
                fits, col = _first_set(self._rows(b) == 0)
            else:
                # The i-th tag (in this round) of a bucket takes the bucket's i-th free cell;
                # those that find none spill to the next bucket, counted in its ``_over``.
                todo, b = todo[ordered % m], runs
                new_run = np.empty(m, bool)
                new_run[0] = True
                np.not_equal(b[1:], b[:-1], out=new_run[1:])
                run_start = np.maximum.accumulate(np.where(new_run, np.arange(m), 0))
                rank = np.minimum(np.arange(m) - run_start, WIDTH)
                fits, col = _nth_set(self._rows(b) == 0, rank)
            s = todo[fits]
            at = b[fits] * WIDTH + col[fits]
            flat_tags[at] = tags[s]
            flat_vals[at] = vals[s]
            pos[s] = at
            todo = todo[~fits]
            if len(todo):
                np.add.at(self._over, bucket[todo], 1)
                bucket[todo] = (bucket[todo] + 1) % self._nb
        if len(todo):
            raise OverflowError(f"TagTable.insert: no free cell for {len(todo)} of {n} tags")
        self.size += n
        return pos

    def remove_at(self, pos: I64) -> None:
        """Empty the entries at flat positions ``pos`` (each live, each once)."""
        if not len(pos):
            return
        if self._k is not None:
            if not self._k.table_remove(self._ft, self._fv, self._over, self._nb, pos):
                raise KeyError("TagTable.remove_at of an empty entry")
            self.size -= len(pos)
            return
        flat_tags = self._tags.reshape(-1)
        tags = flat_tags[pos]
        if not (tags != 0).all():
            raise KeyError("TagTable.remove_at of an empty entry")
        home = self.home(tags)
        bucket = pos // WIDTH
        # An entry stored past its home bucket counted itself in every bucket it skipped.
        moved = (home != bucket).nonzero()[0]
        if len(moved):  # every bucket from its home up to (not) its own, in one pass
            steps = (bucket[moved] - home[moved]) % self._nb
            ends = np.cumsum(steps)
            within = np.arange(int(ends[-1])) - np.repeat(ends - steps, steps)
            np.subtract.at(self._over, (np.repeat(home[moved], steps) + within) % self._nb, 1)
        flat_tags[pos] = 0
        self._vals.reshape(-1)[pos] = -1
        self.size -= len(pos)

    def clear(self) -> None:
        self._tags.fill(0)
        self._vals.fill(-1)
        self._over.fill(0)
        self.size = 0

    @property
    def nbytes(self) -> int:
        return self._tags.nbytes + self._vals.nbytes + self._over.nbytes


class FingerprintQueue:
    """A FIFO set of at most ``capacity`` tags, each with an optional int32 payload.

    :meth:`push` appends at the young end; :meth:`trim` drops from the old end. Removing a
    member (:meth:`discard`) leaves a hole in the ring that the old end skips; when holes
    fill the ring, its members are rewritten from its start (:meth:`_squeeze`, the table
    kept), so every operation is amortized O(1) per tag. Memory follows the members: it
    starts small and doubles up to ``capacity`` (a new table, every tag entered again).
    Both passes are over every member in one call: for a ghost list of 4M on the 2-core
    machine, 160-370 ms for a squeeze (once per ~500k discards) and 580 ms for the last
    doubling (once).
    """

    def __init__(
        self,
        capacity: int,
        *,
        payload: bool = False,
        initial: int = 1024,
        max_load: float = 0.6,
        compiled: bool | None = None,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self._compiled = compiled  # its tables' (TagTable)
        self._max_load = max_load
        self._has_payload = payload
        self.size = 0  # live members
        self._allocate(min(capacity, initial))

    def _allocate(self, room: int) -> None:
        self._room = room
        self._ring_size = room + max(room // 8, 16)
        self._ring = np.zeros(self._ring_size, np.int64)  # tag, 0 for a hole
        self._where = np.zeros(self._ring_size, np.int64)  # its position in the table
        self._payload = np.zeros(self._ring_size if self._has_payload else 0, np.int32)
        self._table = TagTable(room + 1, max_load=self._max_load, compiled=self._compiled)
        self._head = 0  # ring index of the oldest entry
        self._len = 0  # ring entries from head, holes included

    def __len__(self) -> int:
        return self.size

    def find(self, tags: I64) -> I64:
        """Ring index of each tag, -1 where it is not a member."""
        return self._table.values_at(self._table.find(tags))

    def members(self, tags: I64) -> npt.NDArray[np.bool_]:
        """Which of ``tags`` are members."""
        return self._table.contains(tags)

    def payload(self, ring_idx: I64) -> npt.NDArray[np.int32]:
        if not self._has_payload:
            raise TypeError("this FingerprintQueue keeps no payload")
        return self._payload[ring_idx]

    def discard(self, tags: I64) -> npt.NDArray[np.bool_]:
        """Remove the members among ``tags``; returns which were members."""
        # Membership first (fewer calls than a search for positions), then the members'
        # positions only: most tags looked up are not members.
        hit = self._table.contains(tags)
        at = hit.nonzero()[0]
        if len(at):
            pos = self._table.find(tags[at])
            if len(at) > 1:  # a tag given twice is one member: its entry is removed once
                pos = np.unique(pos)
            idx = self._table.values_at(pos)
            self._table.remove_at(pos)
            self._ring[idx] = 0
            self.size -= len(pos)
        return hit

    def push(self, tags: I64, payload: npt.ArrayLike = 0) -> None:
        """Append ``tags`` (not members, distinct) as the youngest, then trim to capacity."""
        n = len(tags)
        if n == 0:
            return
        if self._has_payload:
            payload = np.broadcast_to(np.asarray(payload, np.int32), (n,))
        if n > self.capacity:  # only the youngest can stay
            tags, n = tags[-self.capacity :], self.capacity
            if self._has_payload:
                payload = np.asarray(payload)[-self.capacity :]
        self.trim(self.capacity - n)
        if self.size + n > self._room:
            self._compact(min(self.capacity, max(2 * self._room, self.size + n)))
        elif self._len + n > self._ring_size:
            self._squeeze()
        idx = (self._head + self._len + np.arange(n)) % self._ring_size
        self._ring[idx] = tags
        if self._has_payload:
            self._payload[idx] = payload
        self._where[idx] = self._table.insert(tags, idx)
        self._len += n
        self.size += n

    def trim(self, max_size: int) -> None:
        """Drop the oldest members until at most ``max_size`` remain."""
        while self.size > max_size:
            excess = self.size - max_size
            # Look at just enough of the old end: at least ``excess`` entries, holes skipped.
            span = min(self._len, excess + 64)
            idx = (self._head + np.arange(span)) % self._ring_size
            live = self._ring[idx] != 0
            cut = span
            if live.sum() > excess:
                cut = int(np.flatnonzero(live)[excess - 1]) + 1
            drop = idx[:cut][live[:cut]]
            if len(drop):
                self._table.remove_at(self._where[drop])  # no search: positions kept
                self._ring[drop] = 0
                self.size -= len(drop)
            self._head = (self._head + cut) % self._ring_size
            self._len -= cut

    def _compact(self, room: int) -> None:
        """Rewrite the members, oldest first, into fresh arrays with ``room``."""
        idx = (self._head + np.arange(self._len)) % self._ring_size
        idx = idx[self._ring[idx] != 0]
        tags = self._ring[idx]
        payload = self._payload[idx] if self._has_payload else None
        self._allocate(room)
        n = len(tags)
        if n:
            self._ring[:n] = tags
            if payload is not None:
                self._payload[:n] = payload
            self._where[:n] = self._table.insert(tags, np.arange(n))
        self._len = self.size = n

    def _squeeze(self) -> None:
        """Rewrite the members, oldest first, from the ring's start, in the arrays they are
        in (the holes discards left filled the ring): the table keeps its entries, only
        their values (ring indices) change. No new table: a rebuild re-inserts every tag
        (for a ghost list of 4M on the 2-core machine, 410 ms against 160-370 ms)."""
        idx = (self._head + np.arange(self._len)) % self._ring_size
        idx = idx[self._ring[idx] != 0]
        n = len(idx)
        tags, where = self._ring[idx], self._where[idx]
        self._ring[:n], self._where[:n] = tags, where
        if self._has_payload:
            self._payload[:n] = self._payload[idx]
        self._table.set_values_at(where, np.arange(n))
        self._head, self._len = 0, n

    def clear(self) -> None:
        self.size = 0
        self._allocate(min(self.capacity, 1024))

    @property
    def nbytes(self) -> int:
        return self._ring.nbytes + self._where.nbytes + self._payload.nbytes + self._table.nbytes


class GhostQueue:
    """:class:`FingerprintQueue`'s set semantics (a FIFO set of at most ``capacity`` tags:
    push at the young end, the oldest forgotten beyond ``capacity``, members discarded),
    for the policies' ghost lists, at a few numpy calls per eviction.

    The youngest pushes (at most ``fresh`` of them) wait in an insertion-ordered dict and
    enter the queue in one batch (a push of a few dozen tags would cost a dozen numpy
    calls of a few µs each); members the bound pushed out of the queue are only owed
    (``_owed``, its oldest) until that batch, or until a removal from the queue (a ghost
    hit, or a large batch looked up), which trims them first. Every answer is the
    :class:`FingerprintQueue`'s: all queued members are older than the fresh ones.
    """

    batch = 256
    """A push of more tags goes to the queue at once (a numpy call costs less than a
    dict update of that many)."""

    def __init__(
        self,
        capacity: int,
        *,
        fresh: int = 4096,
        max_load: float = 0.4,
        compiled: bool | None = None,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self._queue = FingerprintQueue(capacity, max_load=max_load, compiled=compiled)
        self._fresh: dict[int, None] = {}
        self._room = max(1, min(fresh, capacity // 4))
        self._owed = 0  # the queue's oldest members that are no longer members

    def __len__(self) -> int:
        return self._queue.size - self._owed + len(self._fresh)

    def push(self, tags: I64) -> None:
        """Append ``tags`` (not members, distinct) as the youngest, then bound the size."""
        n = len(tags)
        if not n:
            return
        at_once = n > self.batch or n > self._room
        if at_once or len(self._fresh) + n > self._room:
            self._settle()
            if at_once:  # a large batch goes to the queue at once, vectorized
                self._queue.push(tags)
                self._bound()
                return
        self._fresh.update(dict.fromkeys(tags.tolist()))
        self._bound()

    def _bound(self) -> None:
        over = len(self) - self.capacity
        if over > 0:  # never more than the queue holds: fresh ones are at most a quarter
            self._owed += over

    def _settle(self) -> None:
        """Trim what is owed, then move the fresh tags into the queue, in their order."""
        if self._owed:
            self._queue.trim(self._queue.size - self._owed)
            self._owed = 0
        if self._fresh:
            fresh = np.fromiter(self._fresh, np.int64, len(self._fresh))
            self._fresh = {}
            self._queue.push(fresh)

    def discard(self, tags: I64) -> npt.NDArray[np.bool_]:
        """Remove the members among ``tags``; returns which were members."""
        fresh = self._fresh
        hit = np.zeros(len(tags), np.bool_)
        if fresh:
            listed = tags.tolist()
            found = list(map(fresh.__contains__, listed))
            if True in found:
                hit = np.array(found, np.bool_)
                deque(map(fresh.pop, compress(listed, found), repeat(None)), 0)
        if self._queue.size > self._owed:
            # A small batch rarely holds a member: a membership test first (fewer calls
            # than a removal); a large one (an eviction's store misses) almost always does.
            if len(tags) <= self.batch and not self._queue.members(tags).any():
                return hit
            if self._owed:  # the owed ones first: they are not members
                self._queue.trim(self._queue.size - self._owed)
                self._owed = 0
            hit |= self._queue.discard(tags)
        return hit

    def clear(self) -> None:
        self._queue.clear()
        self._fresh = {}
        self._owed = 0

    @property
    def nbytes(self) -> int:
        return self._queue.nbytes
