"""The directory's key indexes: bytes key → slot, compact (:class:`KeyIndex`, in flat arrays,
with no Python object per key) or a dict (:class:`DictIndex`); the directory's default is
the compact one from 100k slots where numba is installed.

Keys are the connector's offload keys (a block hash and a 4-byte group: 36 bytes with
vLLM's sha256 hashes), all of one length in practice. The index learns that length from
the first key it stores and keeps every such key's bytes in one buffer, row = slot
(``length`` bytes a slot). A key of any other length is kept in a small dict beside it:
it still works, it is only not compact.

The table is open addressing over ``cells`` (int32 slot, ``EMPTY`` for none), about
``capacity / max_load`` of them (an odd number), with linear probing from a key's home
cell: its 63-bit digest modulo the number of cells. A candidate cell is verified against
the full key bytes, so equal digests of different keys only make a probe longer, never a
wrong answer. The digest is salted, which is fine for a table that lives in one process
and is never persisted (DESIGN §4.8 is about the keys themselves).

**Compiled** (numba, ``compiled``; the directory's way): find, insert and remove are
kernels (``_kernels.index_*``) over a batch's keys joined into one buffer and read as
32-bit words (keys whose length is a multiple of 4, as the connector's are; the index
takes the Python way below for good if its first key is not). The digest is the kernels'
own: the key's words multiplied into a state seeded at random per index, then murmur3's
finalizer, computed in the kernel, so a batch costs one join, one length check and one
call. A find reads every key's home cell first, then every candidate's key, so that their
cache misses overlap: at 200k keys a request's 35 keys cost 2.5 µs in the kernel, and
7.1 µs in all, against 11.4 µs for a dict (on the 2-core machine). A batch with a key of
another length, a removal of a slot holding none or one shifted too far takes the Python
way, with the same digest.

**In Python** (no numba): the digest is Python's ``hash()`` of the key bytes (SipHash,
cached on the bytes object: the connector builds a request's keys once and asks about
them several times; salted per process).

Every cell a key passes over on its way to a free cell counts it in ``over``: a search
stops at the first cell that does not match and that no key passed (almost always the
home cell), and a removal gives the counts back. No tombstones, no rehash, and nothing
ever moves: a slot knows its cell (``_cell``) and how far past its home that is
(``_shift``, saturating at 255: beyond, the home is recomputed from the key), so removing
a key is O(1 + its shift), never a search and never a pass over the table.

There, a lookup first asks a dict of recent answers (slot, or -1 for absent; exact: set on
insert, dropped on removal, emptied beyond ``recent_keys``, 16,384 by default, so never
an entry per block): a request's keys are asked about several times and popular prefixes
again and again, and one dict get a key is what the directory's dict used to cost. The
others run as a chain of ``map`` over builtins (digest, modulo, a memoryview read of the
cell, ``bytearray.startswith`` of the key at its slot's offset): no numpy call and no
Python bytecode per key when every key is at its home cell or verifiably absent there;
only the others (a key that was shifted, a home some key passed) take a Python loop. At a
request's ~35 keys a vectorized numpy probe (a dozen calls of a few µs each on the 2-core
machine) costs more. Inserts are the same chains; removals of large batches (the
evictor's) are vectorized.

Memory per slot at the default ``max_load`` 0.3: the key (``length``), 20 bytes of cells
(int32) and counts (uint16, saturating: a cell passed by 65,535 keys stays passed for good,
which only makes searches longer), 5 of cell and shift. A lower load costs bytes; a
higher one, probes past the home cell (at 0.5, a quarter of the keys).

Who owns what: one instance per :class:`~kvferry.cache.Directory`, single-threaded
like its owner.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Sequence
from itertools import compress, repeat
from operator import is_, is_not, not_
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from . import _kernels

I64 = npt.NDArray[np.int64]
Digest = Callable[[bytes], int]
"""A key's digest (any int; taken modulo the number of cells)."""

NO_SLOT = -1
"""What :meth:`KeyIndex.find` answers for an absent key, and ``_cell`` of a slot without."""
EMPTY = _kernels.INDEX_EMPTY
"""An empty cell: as a slot, its key's offset is past the end of the key bytes, so that
the verification of an empty cell fails without a test of its own."""
_OTHER = -2
"""``_cell`` of a slot whose key is kept in the dict of keys of another length."""
MIN_KEY_LEN = 8
"""The first key stored sets the compact length if it has at least this many bytes."""
_SATURATED = _kernels.INDEX_SATURATED
"""``over`` stays here once there (uint16)."""
_FAR = _kernels.INDEX_FAR
"""``_shift`` saturates here: the home of such a key is recomputed from its bytes."""


class KeyIndex:
    """Key → slot for the slots ``range(capacity)``, each slot holding at most one key.

    ``digest``: a key's digest (tests inject colliding ones; a compiled index takes it
    as an int64); by default Python's ``hash``, or where compiled the kernels' own (a
    mix of the key's bytes under a random seed of the index's, computed in the kernel).
    ``max_load``: live keys per cell at most (a full index is this full).
    ``compiled``: find, insert and remove as numba kernels (``_kernels``; None: where
    numba is installed, unless ``KVFERRY_JIT=0``), for every batch of keys of the
    compact length; else, and for any other batch, the chains of ``map`` below.
    """

    vectorize_removals = 256
    """Removals of more keys than this at once run as numpy passes."""

    recent_keys = 1 << 14
    """Keys answered from a dict of recent answers, at most (0: none; the dict is emptied
    when it would hold more)."""

    def __init__(
        self,
        capacity: int,
        *,
        digest: Digest | None = None,
        max_load: float = 0.3,
        compiled: bool | None = None,
    ) -> None:
        if capacity <= 0 or not 0 < max_load < 1:
            raise ValueError(f"need capacity > 0 and 0 < max_load < 1: {capacity}, {max_load}")
        self.capacity = capacity
        self._k: Any = _kernels.choose(compiled)
        self._seed = int.from_bytes(os.urandom(8), "little") >> 1
        self._given_digest = digest
        self._own_digest = digest is None and self._k is not None  # the kernels hash
        self._digest: Digest = digest or (self._kernel_digest if self._own_digest else hash)
        self._no_digests = np.empty(0, np.int64)  # what the kernels take for "hash them"
        # More cells than keys, so that a probe always ends; odd, so that digests that
        # vary in their high bits only still spread.
        self._ncells = max(capacity + 1, int(capacity / max_load)) | 1
        self._cells = np.full(self._ncells, EMPTY, np.int32)
        self._over = np.zeros(self._ncells, np.uint16)
        self._cell = np.full(capacity, NO_SLOT, np.int32)
        self._shift = np.zeros(capacity, np.uint8)
        self._cm, self._om = self._cells.data, self._over.data
        self._sm, self._hm = self._cell.data, self._shift.data
        self.key_len: int | None = None
        """The length of compact keys: set by the first key stored of 8 bytes or more."""
        self._kb = bytearray()  # capacity * key_len bytes: slot s at s * key_len
        self._kbw = np.frombuffer(self._kb, np.uint32)  # the same as words, for the kernels
        self._other: dict[bytes, int] = {}  # keys of another length, and back
        self._other_key: dict[int, bytes] = {}
        self.size = 0
        # Recent answers (slot, or -1 for absent), exact: set on insert, dropped on removal.
        # A request's keys are asked about several times (lookup, store, touch at its end)
        # and popular prefixes again and again: one dict get each, as the directory's dict
        # used to be, but for at most ``recent_keys`` keys, never one entry per block.
        self._recent: dict[bytes, int] = {}
        # The key of each slot answered there (and junk at -1, the absent answers' slot):
        # a removal drops its keys' answers by slot, without reading their bytes.
        self._recent_key: dict[int, bytes] = {}

    @property
    def num_cells(self) -> int:
        return self._ncells

    @property
    def nbytes(self) -> int:
        arrays = (self._cells, self._over, self._cell, self._shift)
        return len(self._kb) + sum(a.nbytes for a in arrays)

    # -- queries -----------------------------------------------------------------------

    def find(self, keys: Sequence[bytes]) -> list[int]:
        """The slot of each key, -1 where it is absent."""
        if self._k is not None:
            compiled = self._find_compiled(keys)
            return compiled.tolist() if compiled is not None else self._find(keys)
        recent = self._recent
        got = list(map(recent.get, keys))
        if None not in got:
            return got  # type: ignore[return-value]
        ask = list(compress(keys, map(is_, got, repeat(None))))
        found = self._find(ask)
        if len(recent) + len(ask) > self.recent_keys:
            recent.clear()
            self._recent_key.clear()
        if len(ask) <= self.recent_keys:
            recent.update(zip(ask, found, strict=True))
            self._recent_key.update(zip(found, ask, strict=True))
        if len(ask) == len(keys):
            return found
        it = iter(found)
        return [next(it) if s is None else s for s in got]

    def _find(self, keys: Sequence[bytes]) -> list[int]:
        length = self.key_len
        if not keys or length is None or not min(map(len, keys)) == length == max(map(len, keys)):
            return self._find_each(keys)
        ncells, cells = self._ncells, self._cm
        homes = list(map(ncells.__rmod__, map(self._digest, keys)))
        slots = list(map(cells.__getitem__, homes))
        ok = list(map(self._kb.startswith, keys, map(length.__mul__, slots)))
        if all(ok):
            return slots
        over = self._om
        for i in compress(range(len(keys)), map(not_, ok)):
            p = homes[i]
            slots[i] = self._probe(keys[i], p) if over[p] else NO_SLOT
        return slots

    def _probe(self, key: bytes, p: int) -> int:
        """Search on for ``key`` (of the compact length) past cell ``p`` (not it)."""
        ncells, cells, over, starts = self._ncells, self._cm, self._om, self._kb.startswith
        length = self.key_len or 0
        # Once round at most (as the kernel): where every cell was passed (counts that
        # saturated stay), an absent key's chain is a cycle.
        for _ in range(ncells - 1):
            if not over[p]:
                break
            p = p + 1 if p + 1 < ncells else 0
            s = cells[p]
            if starts(key, s * length):
                return int(s)
        return NO_SLOT

    def _find_each(self, keys: Sequence[bytes]) -> list[int]:
        """:meth:`find` one key at a time (a batch with keys of another length)."""
        length, other = self.key_len, self._other
        return [self._find((k,))[0] if len(k) == length else other.get(k, NO_SLOT) for k in keys]

    def find_array(self, keys: Sequence[bytes]) -> I64:
        """:meth:`find` as an int64 array."""
        if self._k is not None:
            found = self._find_compiled(keys)
            if found is not None:
                return found
            return np.array(self._find(keys), np.int64)
        return np.array(self.find(keys), np.int64)

    def _joined(self, keys: Sequence[bytes]) -> tuple[npt.NDArray[np.uint32], I64] | None:
        """The words of ``keys`` one after another and their digests, for the kernels; None
        where the index is not compiled or a key is not of the compact length."""
        length, n = self.key_len, len(keys)
        if self._k is None or length is None or not n:
            return None
        joined = b"".join(keys)
        if len(joined) != n * length or max(map(len, keys)) != length:
            return None  # (with the total right and none longer, none is shorter)
        if self._own_digest:
            digests = self._no_digests
        else:
            digests = np.fromiter(map(self._digest, keys), np.int64, n)
        return np.frombuffer(joined, np.uint32), digests

    def _kernel_digest(self, key: bytes) -> int:
        """A key's digest as the kernels compute it (for the Python path's rare batches)."""
        digest: int = self._k.index_digest(np.frombuffer(key, np.uint32), self._seed)
        return digest

    def _find_compiled(self, keys: Sequence[bytes]) -> I64 | None:
        """:meth:`find_array` by a kernel, or None (see :meth:`_joined`). No dict of recent
        answers: the kernel's probe costs less than keeping one."""
        got = self._joined(keys)
        if got is None:
            return None if len(keys) else np.empty(0, np.int64)
        joined, digests = got
        out = np.empty(len(keys), np.int64)
        k, words, seed = self._k, (self.key_len or 0) // 4, self._seed
        k.index_find(self._cells, self._over, self._kbw, words, seed, digests, joined, out)
        return out

    def find_one(self, key: bytes) -> int | None:
        slot = self._find((key,))[0]
        return None if slot < 0 else slot

    def holds(self, slots: I64) -> npt.NDArray[np.bool_]:
        """Whether each of ``slots`` (in range) holds a key."""
        out: npt.NDArray[np.bool_] = self._cell[slots] != NO_SLOT
        return out

    def keys_of(self, slots: Sequence[int] | I64) -> list[bytes]:
        """The key of each of ``slots`` (in range, each holding a key)."""
        kb, length, where, other = self._kb, self.key_len or 0, self._sm, self._other_key
        arr = np.asarray(slots, np.int64)
        if length and len(arr) and bool((self._cell[arr] >= 0).all()):  # compact, all
            rows = np.frombuffer(kb, np.uint8).reshape(-1, length)[arr].tobytes()
            return [rows[i : i + length] for i in range(0, len(rows), length)]
        out = []
        for s in arr.tolist():
            if where[s] == _OTHER:
                out.append(other[s])
            else:
                out.append(bytes(kb[s * length : (s + 1) * length]))
        return out

    # -- changes -----------------------------------------------------------------------

    def insert(self, keys: Sequence[bytes], slots: Sequence[int] | npt.NDArray[np.integer]) -> None:
        """Enter each key at its slot: keys absent and distinct, slots holding none."""
        if self._k is not None and self._insert_compiled(keys, slots):
            return
        slot_list = np.asarray(slots, np.int64).tolist()
        self._insert(keys, slot_list)
        if self._k is not None:
            return  # (no dict of recent answers)
        recent = self._recent
        if len(recent) + len(keys) > self.recent_keys:
            recent.clear()
            self._recent_key.clear()
        if len(keys) <= self.recent_keys:
            recent.update(zip(keys, slot_list, strict=True))
            self._recent_key.update(zip(slot_list, keys, strict=True))

    def _room_for(self, keys: Sequence[bytes]) -> None:
        """Refuse a batch beyond the capacity; learn the compact length from the first key
        of ``MIN_KEY_LEN`` bytes or more (the shorter keys stored before it, in the other
        keys' dict, can never have that length: every key is looked for where it is)."""
        n = len(keys)
        if self.size + n > self.capacity:
            raise OverflowError(f"KeyIndex of {self.capacity} keys: {self.size} + {n}")
        if not n or self.key_len is not None:
            return
        first = next((k for k in keys if len(k) >= MIN_KEY_LEN), None)
        if first is not None:
            self.key_len = len(first)
            self._kb = bytearray(self.capacity * self.key_len)
            if self.key_len % 4:  # the kernels read words: Python's hash and loops serve
                self._k, self._own_digest = None, False
                self._digest = self._given_digest or hash
            else:
                self._kbw = np.frombuffer(self._kb, np.uint32)

    def _insert_compiled(
        self, keys: Sequence[bytes], slots: Sequence[int] | npt.NDArray[np.integer]
    ) -> bool:
        """:meth:`insert` by a kernel; False (nothing changed) where it leaves the batch to
        the Python path: see :meth:`_joined`, or a slot out of range or holding a key."""
        self._room_for(keys)
        got = self._joined(keys)
        if got is None:
            return False
        joined, digests = got
        arr = np.ascontiguousarray(slots, np.int64)
        if len(arr) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(arr)} slots")
        k, words, seed = self._k, (self.key_len or 0) // 4, self._seed
        table = (self._cells, self._over, self._cell, self._shift, self._kbw)
        if not k.index_insert(*table, words, seed, digests, joined, arr):
            return False
        self.size += len(arr)
        return True

    def _insert(self, keys: Sequence[bytes], slot_list: list[int]) -> None:
        n = len(keys)
        self._room_for(keys)
        if not n:
            return
        length = self.key_len
        if length is None or not min(map(len, keys)) == length == max(map(len, keys)):
            self._insert_each(keys, slot_list)
            return
        # As chains of map over builtins, like find: the bytes of every key, then the keys
        # whose home cell is free take it; the others (a taken home, or one home wanted
        # by two keys) probe on in a Python loop.
        ncells, cells = self._ncells, self._cm
        offsets = list(map(length.__mul__, slot_list))
        kb = self._kb
        deque(map(kb.__setitem__, map(slice, offsets, map(length.__add__, offsets)), keys), 0)
        homes = list(map(ncells.__rmod__, map(self._digest, keys)))
        free = list(map(EMPTY.__eq__, map(cells.__getitem__, homes)))
        took = list(compress(homes, free))
        took_slots = list(compress(slot_list, free))
        deque(map(cells.__setitem__, took, took_slots), 0)
        deque(map(self._sm.__setitem__, took_slots, took), 0)
        deque(map(self._hm.__setitem__, took_slots, repeat(0)), 0)
        self.size += n
        if len(took) == n and len(set(took)) == n:
            return
        # Of two keys with one free home, the last written holds the cell: the first
        # probes on; its bookkeeping is rewritten by _place.
        held = list(map(cells.__getitem__, homes))
        for i in compress(range(n), map(int.__ne__, held, slot_list)):
            self._place(slot_list[i], homes[i])

    def _place(self, s: int, p: int) -> None:
        """Put slot ``s`` in the first empty cell from ``p``, counting the cells passed."""
        ncells, cells, over = self._ncells, self._cm, self._om
        k = 0
        while cells[p] != EMPTY:
            if over[p] < _SATURATED:
                over[p] += 1  # passed over: a search must go on from here
            p = p + 1 if p + 1 < ncells else 0
            k += 1
        cells[p] = s
        self._sm[s] = p
        self._hm[s] = min(k, _FAR)

    def _insert_each(self, keys: Sequence[bytes], slots: list[int]) -> None:
        """:meth:`insert` one key at a time (a batch with keys of another length)."""
        for key, s in zip(keys, slots, strict=True):
            if len(key) == self.key_len:
                self._insert([key], [s])
            else:
                self._other[key] = s
                self._other_key[s] = key
                self._sm[s] = _OTHER
                self.size += 1

    def remove(self, slots: Sequence[int] | I64) -> list[int]:
        """Remove the keys of ``slots`` (in range; a slot named twice, once); returns the
        slots that held no key (left alone)."""
        arr = np.asarray(slots, np.int64)
        if self._k is not None:
            n = self._k.index_remove(self._cells, self._over, self._cell, self._shift, arr)
            if n >= 0:
                self.size -= n
                return []
        missing: list[int] = []
        held = self._cell[arr] != NO_SLOT
        if not held.all():
            missing = arr[~held].tolist()
            arr = arr[held]
        if self._recent:  # the answers about these keys, found by slot (none: b"")
            keys = map(self._recent_key.pop, arr.tolist(), repeat(b""))
            deque(map(self._recent.pop, keys, repeat(None)), 0)
        n = len(arr)
        if n > self.vectorize_removals:
            self._remove_many(arr)
            return missing
        ncells, cells, over, where, shift = self._ncells, self._cm, self._om, self._sm, self._hm
        for s in arr.tolist():
            p = where[s]
            if p == NO_SLOT:  # named twice: removed already
                n -= 1
                continue
            where[s] = NO_SLOT
            if p == _OTHER:
                del self._other[self._other_key.pop(s)]
                continue
            cells[p] = EMPTY
            k = shift[s]
            if k == _FAR:
                k = (p - self._home_of(s)) % ncells
            for _ in range(k):  # give back the counts of the cells it passed
                p = p - 1 if p > 0 else ncells - 1
                if over[p] < _SATURATED:
                    over[p] -= 1
        self.size -= n
        return missing

    def _home_of(self, slot: int) -> int:
        length = self.key_len or 0
        home: int = (
            self._digest(bytes(self._kb[slot * length : (slot + 1) * length])) % self._ncells
        )
        return home

    def _remove_many(self, arr: I64) -> None:
        """:meth:`remove` as numpy passes."""
        arr = np.unique(arr)  # a slot named twice, once
        pos = self._cell[arr].astype(np.int64)
        other = pos == _OTHER
        for s in arr[other].tolist():
            del self._other[self._other_key.pop(s)]
        keep = ~other
        arr, pos = arr[keep], pos[keep]
        steps = self._shift[arr].astype(np.int64)
        for i in np.flatnonzero(steps == _FAR).tolist():
            steps[i] = (pos[i] - self._home_of(int(arr[i]))) % self._ncells
        moved = np.flatnonzero(steps)
        if len(moved):
            counts = steps[moved]
            first = np.repeat(pos[moved] - counts, counts)
            within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            passed = (first + within) % self._ncells
            np.subtract.at(self._over, passed[self._over[passed] < _SATURATED], 1)
        self._cells[pos] = EMPTY
        self._cell[arr] = NO_SLOT
        self.size -= len(arr) + int(other.sum())

    def clear(self) -> None:
        """Forget every key (the compact length stays)."""
        self._cells.fill(EMPTY)
        self._over.fill(0)
        self._cell.fill(NO_SLOT)
        self._other.clear()
        self._other_key.clear()
        self._recent.clear()
        self._recent_key.clear()
        self.size = 0


class DictIndex:
    """:class:`KeyIndex`'s interface over a dict of the caller's key objects and a list
    back: one dict get a key, the cheapest per request, and ~150 bytes a block (the key
    object, its entry, the slot's int). The directory's default (``index="dict"``)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._slot_of: dict[bytes, int] = {}
        self._key_of: list[bytes | None] = [None] * capacity

    @property
    def size(self) -> int:
        return len(self._slot_of)

    def find(self, keys: Sequence[bytes]) -> list[int]:
        return list(map(self._slot_of.get, keys, repeat(NO_SLOT)))

    def find_array(self, keys: Sequence[bytes]) -> I64:
        """:meth:`find` as an int64 array, with no list between."""
        return np.fromiter(map(self._slot_of.get, keys, repeat(NO_SLOT)), np.int64, len(keys))

    def find_one(self, key: bytes) -> int | None:
        return self._slot_of.get(key)

    def holds(self, slots: I64) -> npt.NDArray[np.bool_]:
        held = list(map(self._key_of.__getitem__, slots.tolist()))
        if None not in held:
            return np.ones(len(held), np.bool_)
        return np.fromiter(map(is_not, held, repeat(None)), np.bool_, len(held))

    def keys_of(self, slots: Sequence[int] | I64) -> list[bytes]:
        key_of = self._key_of
        return [k for s in np.asarray(slots, np.int64).tolist() if (k := key_of[s]) is not None]

    def insert(self, keys: Sequence[bytes], slots: Sequence[int] | npt.NDArray[np.integer]) -> None:
        slot_list = np.asarray(slots, np.int64).tolist()
        if len(slot_list) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(slot_list)} slots")
        deque(map(self._key_of.__setitem__, slot_list, keys), 0)  # no bytecode per key
        self._slot_of.update(zip(keys, slot_list, strict=True))

    def remove(self, slots: Sequence[int] | I64) -> list[int]:
        # As chains of map over builtins: no Python bytecode per key (an eviction's cost).
        key_of = self._key_of
        slot_list = np.asarray(slots, np.int64).tolist()
        held = list(map(key_of.__getitem__, slot_list))
        if None in held:
            missing = [s for s, k in zip(slot_list, held, strict=True) if k is None]
            keys = [k for k in held if k is not None]
        else:
            missing, keys = [], cast(list[bytes], held)
        deque(map(self._slot_of.pop, keys, repeat(None)), 0)  # a slot given twice: once
        deque(map(key_of.__setitem__, slot_list, repeat(None)), 0)
        return missing

    def clear(self) -> None:
        self._slot_of.clear()
        self._key_of = [None] * self.capacity
