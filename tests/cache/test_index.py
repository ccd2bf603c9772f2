"""The directory's compact key index against a dict: digest collisions, removals that give
back what a probe passed, a full index, and keys of unusual length; each with the index's
chains of ``map`` and with its kernels (``compiled``)."""

from __future__ import annotations

import hashlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.cache import Directory, replay
from kvferry.cache._index import EMPTY, KeyIndex

from ._compiled import both

SETTINGS = settings(max_examples=60, derandomize=True, database=None, deadline=None)


def key(i: int, group: int = 0) -> bytes:
    """A 36-byte offload key, as the connector makes them."""
    return hashlib.sha256(i.to_bytes(8, "big")).digest() + group.to_bytes(4, "big")


def colliding(k: bytes) -> int:
    """Every key has the same digest: every probe walks one cluster."""
    return 7


def two_homes(k: bytes) -> int:
    return k[0] & 1


def check(index: KeyIndex, ref: dict[bytes, int], universe: list[bytes]) -> None:
    assert index.find(universe[::3]) == [ref.get(k, -1) for k in universe[::3]]
    assert index.find(universe) == [ref.get(k, -1) for k in universe]
    assert len(index._recent) <= index.recent_keys
    assert index.size == len(ref)
    slots = np.array(sorted(ref.values()), np.int64)
    assert sorted(index.keys_of(slots)) == sorted(ref)
    if not ref:
        assert int(index._over.sum()) == 0 and (index._cells == EMPTY).all()


@both
@pytest.mark.parametrize("digest", [None, hash, colliding, two_homes])
@pytest.mark.parametrize(("vectorized", "recent"), [(False, 0), (True, 0), (False, 5), (True, 64)])
@SETTINGS
@given(ops=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 40), max_size=6))))
def test_the_index_maps_like_a_dict(
    compiled: bool,
    digest: object,
    vectorized: bool,
    recent: int,
    ops: list[tuple[bool, list[int]]],
) -> None:
    """Inserts and removals in batches; removals one by one or vectorized; answers from
    the table alone, or from a dict of recent answers that overflows (5) or not (64)
    (compiled: no such dict); digests the index's own (None), Python's, or colliding."""
    index = KeyIndex(16, digest=digest, compiled=compiled)  # type: ignore[arg-type]
    index.recent_keys = recent
    if vectorized:
        index.vectorize_removals = 0
    universe = [key(i) for i in range(41)]
    ref: dict[bytes, int] = {}
    for insert, batch in ops:
        keys = list(dict.fromkeys(universe[i] for i in batch))
        if insert:
            keys = [k for k in keys if k not in ref][: 16 - len(ref)]
            free = sorted(set(range(16)) - set(ref.values()))[: len(keys)]
            index.insert(keys, np.array(free, np.int64))
            ref.update(zip(keys, free, strict=True))
        else:
            gone = [ref.pop(k) for k in keys if k in ref]
            index.remove(np.array(gone, np.int64))
        check(index, ref, universe)


@both
def test_equal_digests_of_different_keys_are_told_apart_by_their_bytes(compiled: bool) -> None:
    index = KeyIndex(8, digest=colliding, compiled=compiled)
    index.recent_keys = 0  # the table's own answers
    index.insert([key(1), key(2), key(3)], np.array([5, 6, 7]))
    assert index.find([key(3), key(2), key(1), key(4)]) == [7, 6, 5, -1]
    index.remove(np.array([6]))  # the middle of the cluster: a search goes on past it
    assert index.find([key(3), key(2), key(1)]) == [7, -1, 5]


@both
@pytest.mark.parametrize("vectorized", [False, True])
def test_a_full_index_of_colliding_keys_shifted_past_255_cells(
    compiled: bool, vectorized: bool
) -> None:
    n = 300  # each key lands past all the others: shifts beyond what a slot records
    index = KeyIndex(n, digest=colliding, compiled=compiled)
    index.recent_keys = 0
    if vectorized:
        index.vectorize_removals = 0
    keys = [key(i) for i in range(n)]
    index.insert(keys, np.arange(n))
    assert index.size == n and index.find(keys) == list(range(n))
    with pytest.raises(OverflowError):
        index.insert([key(n)], np.array([0]))
    index.remove(np.arange(0, n, 2))
    assert index.find(keys) == [-1 if i % 2 == 0 else i for i in range(n)]
    index.remove(np.arange(1, n, 2))
    assert int(index._over.sum()) == 0 and index.size == 0


@both
def test_the_default_index_fills_to_capacity_with_real_keys(compiled: bool) -> None:
    n = 5_000
    index = KeyIndex(n, compiled=compiled)
    index.recent_keys = 0
    keys = [key(i, group=i % 3) for i in range(n)]
    index.insert(keys, np.arange(n))
    assert index.find(keys) == list(range(n))
    assert index.find([key(i, group=3) for i in range(100)]) == [-1] * 100
    assert index.nbytes < 70 * n  # no Python object per key
    index.remove(np.arange(n))
    assert int(index._over.sum()) == 0 and (index._cells == EMPTY).all()


@both
def test_keys_of_another_length_than_the_first_work_too(compiled: bool) -> None:
    index = KeyIndex(6, compiled=compiled)
    odd = [b"", b"x", key(9)[:35], key(9) + b"!", b"y" * 100]
    index.insert([key(1)], np.array([0]))
    index.insert(odd, np.arange(1, 6))
    assert index.key_len == 36
    # A key that is a prefix, or an extension, of a stored one is not that one.
    assert index.find([key(1), *odd, key(1)[:35], key(9)]) == [0, 1, 2, 3, 4, 5, -1, -1]
    assert index.keys_of(np.array([4, 0, 1])) == [key(9) + b"!", key(1), b""]
    index.remove(np.array([3, 0]))
    assert index.find([key(9)[:35], key(1), b"y" * 100]) == [-1, -1, 5]
    assert index.holds(np.arange(6)).tolist() == [False, True, True, False, True, True]


@both
def test_the_compact_length_is_learnt_from_the_first_long_enough_key(compiled: bool) -> None:
    """A first batch that starts with a key too short to be compact: the length is the
    first long-enough key's, and that key (stored in the same batch) is found in the table,
    before and after more keys of its length came in."""
    index = KeyIndex(8, compiled=compiled)
    index.insert([b"tiny", key(1)], np.array([0, 1]))
    assert index.key_len == 36
    index.insert([key(2)], np.array([2]))
    index._recent.clear()  # (the Python path's dict of recent answers, emptied when full)
    assert index.find([key(1), b"tiny", key(2), key(3)]) == [1, 0, 2, -1]
    assert index.find_array([key(1)]).tolist() == [1]


@both
def test_a_directory_whose_first_key_is_short_finds_the_keys_stored_with_it(
    compiled: bool,
) -> None:
    """Found, the key is a hit, is not stored a second time, and the events replay to
    what a lookup hits."""
    d = Directory(4, index="compact", compiled=compiled, watermarks=(1.0, 1.0), events=True)
    a, b, c = key(1), key(2), key(3)
    d.complete_store(d.prepare_store([b"k", a]), True)  # slots 0, 1
    d.complete_store(d.prepare_store([b]), True)
    assert d.lookup([a]) == 1
    assert d.prepare_store([a]).tolist() == [-1]  # present: not stored again
    d.complete_store(d.prepare_store([c]), True)
    assert replay(d.take_events()) == d.visible_keys()


@both
def test_keys_whose_length_is_not_a_multiple_of_4_take_the_python_way(compiled: bool) -> None:
    """The kernels read keys as 32-bit words: an index whose keys are 10 bytes long gives
    them up at its first key, and answers all the same."""
    index = KeyIndex(8, compiled=compiled)
    keys = [key(i)[:10] for i in range(6)]
    index.insert(keys[:4], np.arange(4))
    assert index._k is None and index.key_len == 10
    assert index.find(keys) == [0, 1, 2, 3, -1, -1]
    index.remove(np.array([1]))
    assert index.find(keys[:3]) == [0, -1, 2] and index.size == 3


@both
def test_clear_forgets_every_key(compiled: bool) -> None:
    index = KeyIndex(4, digest=colliding, compiled=compiled)
    index.insert([key(1), b"short"], np.array([0, 1]))
    index.clear()
    assert index.find([key(1), b"short"]) == [-1, -1] and index.size == 0
    index.insert([key(2)], np.array([0]))
    assert index.find([key(2)]) == [0]


@both
def test_the_directory_is_correct_under_digest_collisions(compiled: bool) -> None:
    d = Directory(4, watermarks=(1.0, 1.0), events=True, compiled=compiled)
    d._index = KeyIndex(4, digest=colliding, compiled=compiled)
    keys = [key(i) for i in range(6)]
    for k in keys:
        slots = d.prepare_store([k])
        d.complete_store(slots, ok=True)
    assert d.lookup(keys[2:]) == 4 and d.lookup(keys[:2]) == 0
    assert d.visible_keys() == set(keys[2:])
    assert d.prepare_load(keys[3:5]) is not None
    assert d.discard([keys[2]]) == [keys[2]]
    assert d.lookup(keys[3:]) == 3


def test_a_resolution_reused_by_the_next_call_is_dropped_when_a_key_came_in_between() -> None:
    d = Directory(4)
    a, b = key(1), key(2)
    assert d.lookup([a, b]) == 0
    d.complete_store(d.prepare_store([a]), ok=True)  # a key came: the lookup's answer is old
    slots = d.prepare_store([a, b])  # a prefix of the lookup's keys
    assert slots[0] == -1 and slots[1] >= 0
    assert d.statistics().stores_skipped_present == 1


@both
@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo"])
def test_a_compact_directory_answers_as_a_dict_one_does(compiled: bool, policy: str) -> None:
    """The same seeded calls, with keys of two lengths, through both indexes: the same
    answers, slots and events."""
    rng = np.random.default_rng(16)
    dirs = [
        Directory(
            24, policy=policy, events=True, watermarks=(0.7, 0.9), index=kind, compiled=compiled
        )
        for kind in ("compact", "dict")
    ]
    universe = [key(i, group=i % 2) for i in range(60)] + [b"k%d" % i for i in range(10)]
    inflight: list[np.ndarray] = []
    for step in range(400):
        keys = [universe[i] for i in rng.choice(len(universe), int(rng.integers(1, 8)))]
        results = []
        for d in dirs:
            n = d.lookup(keys)
            load = d.prepare_load(keys[:n]) if n else None
            store = d.prepare_store(keys[n:])
            results.append((n, None if load is None else load.tolist(), store.tolist()))
        assert results[0] == results[1]
        inflight.append(np.asarray(results[0][2]))
        if len(inflight) > 3:
            done = inflight.pop(0)
            for d in dirs:
                d.complete_store(done[done >= 0], ok=bool(step % 7))
                d.touch(keys)
                if load is not None:
                    d.complete_load(np.asarray(results[0][1]))
                d.evict()
        if step % 97 == 96:
            assert dirs[0].reset() == dirs[1].reset()
        assert dirs[0].take_events() == dirs[1].take_events()
        assert dirs[0].visible_keys() == dirs[1].visible_keys()
    assert dirs[0].statistics() == dirs[1].statistics()


def test_an_unknown_index_is_refused() -> None:
    with pytest.raises(ValueError, match="index"):
        Directory(4, index="btree")


@both
@pytest.mark.parametrize("vectorized", [False, True])
@pytest.mark.parametrize("kind", ["compact", "dict"])
def test_a_removal_names_the_slots_that_held_no_key_and_removes_the_rest(
    kind: str, vectorized: bool, compiled: bool
) -> None:
    from kvferry.cache._index import DictIndex

    index: KeyIndex | DictIndex = (
        KeyIndex(8, compiled=compiled) if kind == "compact" else DictIndex(8)
    )
    if vectorized and isinstance(index, KeyIndex):
        index.vectorize_removals = 0
    index.insert([key(1), key(2), key(3)], np.array([1, 2, 3]))
    assert index.remove(np.array([2, 5, 1, 7])) == [5, 7]
    assert index.find([key(1), key(2), key(3)]) == [-1, -1, 3]
    assert index.size == 1
    assert index.remove(np.array([3])) == []
    assert index.size == 0


@both
@pytest.mark.parametrize("vectorized", [False, True])
def test_a_slot_named_twice_in_a_removal_is_removed_once(compiled: bool, vectorized: bool) -> None:
    """As the dict index does: the table stays whole (no cell emptied twice, no count given
    back twice) and the size right."""
    index = KeyIndex(8, digest=colliding, compiled=compiled)
    if vectorized:
        index.vectorize_removals = 0
    keys = [key(i) for i in range(4)]
    index.insert(keys, np.arange(4))
    assert index.remove(np.array([1, 1, 2, 1])) == []
    assert index.size == 2
    assert index.find(keys) == [0, -1, -1, 3]
    index.remove(np.array([3, 0, 3]))
    assert index.size == 0 and int(index._over.sum()) == 0 and (index._cells == EMPTY).all()


def test_the_directory_reports_a_slot_it_unindexes_without_a_key() -> None:
    """Invariant: a slot the directory drops holds a key. Broken (here by hand), the
    report names the slot, and the other slots are dropped all the same."""
    d = Directory(4)
    slots = d.prepare_store([key(1), key(2)])
    d.complete_store(slots, ok=True)
    d._index.remove(slots[:1])  # the bug this guards against
    before = d.invariant_errors
    d._unindex(slots)
    assert d.invariant_errors == before + 1
    assert d._index.size == 0


def _every_cell_passed(compiled: bool) -> tuple[KeyIndex, dict[bytes, int], list[bytes]]:
    """An index of 6 keys in 7 cells where every cell, the empty one too, was passed by a
    live key (each overflow count above zero): the homes are chosen by ``digest``."""
    homes: dict[bytes, int] = {}
    keys = [hashlib.sha256(i.to_bytes(8, "big")).digest() + bytes(4) for i in range(10)]
    index = KeyIndex(6, max_load=0.9, digest=lambda k: homes[k], compiled=compiled)
    assert index._ncells == 7
    ref: dict[bytes, int] = {}

    def put(i: int, home: int, slot: int) -> None:
        homes[keys[i]] = home
        index.insert([keys[i]], [slot])
        ref[keys[i]] = slot

    def drop(i: int) -> None:
        index.remove([ref.pop(keys[i])])

    for i in range(6):
        put(i, 0, i)  # cells 0-5, each passing the ones before
    drop(0)  # cell 0 empty
    put(6, 5, 0)  # passes 5, into 6
    drop(1)  # cell 1 empty (still passed by keys 2-5)
    put(7, 6, 1)  # passes 6, into 0
    homes[keys[8]] = 2  # absent: its chain is the whole ring
    return index, ref, keys


@both
def test_a_probe_ends_where_every_cell_was_passed(compiled: bool) -> None:
    """Overflow counts never fall back while their keys live, and saturated ones never:
    every cell can be passed, an empty one too. A lookup of an absent key ends (once round
    the ring at most, in the kernel and in the chains of map alike) and answers as a dict.
    Run in a fresh interpreter: a probe that never ends fails the test."""
    code = (
        "import hashlib, json\n"
        "from kvferry.cache._index import KeyIndex\n"
        + inspect.getsource(_every_cell_passed)
        + f"index, ref, keys = _every_cell_passed({compiled})\n"
        "index.recent_keys = 0\n"
        "print(json.dumps({'over': index._over.tolist(), 'found': index.find(keys[:9]),\n"
        "    'array': index.find_array(keys[:9]).tolist(),\n"
        "    'ref': [ref.get(k, -1) for k in keys[:9]]}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    out = json.loads(done.stdout)
    assert all(out["over"]), out["over"]  # the state meant: every cell passed
    assert out["found"] == out["ref"] and out["array"] == out["ref"]
    assert out["ref"][8] == -1 and out["ref"][0] == -1  # absent keys asked
