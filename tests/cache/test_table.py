"""The tag table and fingerprint queue against dicts, including bucket overflow: in numpy,
and compiled (numba, where installed)."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.cache._table import WIDTH, FingerprintQueue, GhostQueue, TagTable

from ._compiled import both

SETTINGS = settings(max_examples=80, derandomize=True, database=None, deadline=None)


def tags(values: list[int]) -> np.ndarray:
    return np.asarray(values, np.int64) | 1


@both
@SETTINGS
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=120))
def test_tag_table_maps_like_a_dict(compiled: bool, ops: list[tuple[bool, int]]) -> None:
    table = TagTable(32, max_load=1.0, compiled=compiled)  # 4 buckets of 8
    nb = table.num_buckets

    def tag_of(raw: int) -> int:
        # A third of the tags crowd bucket 0, so buckets overflow into their neighbours
        # and removals must give the overflow counts back.
        return ((raw * nb if raw % 3 == 0 else raw) << 1) | 1

    universe = tags([tag_of(r) for r in range(41)] + [tag_of(r) + 2 * nb for r in range(41)])
    ref: dict[int, int] = {}
    for insert, raw in ops:
        t = tag_of(raw)
        if insert and t not in ref and len(ref) < 32:
            table.insert(tags([t]), [raw])
            ref[t] = raw
        elif not insert and t in ref:
            table.remove_at(table.find(tags([t])))
            del ref[t]
        found = table.values_at(table.find(universe)).tolist()
        assert found == [ref.get(int(u), -1) for u in universe]
    assert table.size == len(ref)
    if not ref:
        assert int(table._over.sum()) == 0


@both
@SETTINGS
@given(st.lists(st.integers(1, 700), min_size=1, max_size=5), st.integers(0, 2**32 - 1))
def test_batch_inserts_land_where_find_finds_them(
    compiled: bool, batches: list[int], seed: int
) -> None:
    """Batches small and large (the sorted path with ties in a bucket, and spills) into a
    crowded table: every tag is found with its value, at the position insert returned."""
    rng = np.random.default_rng(seed)
    table = TagTable(sum(batches), max_load=0.9, compiled=compiled)
    drawn = rng.choice(1 << 20, size=sum(batches), replace=False).astype(np.int64) << 1 | 1
    ref: dict[int, int] = {}
    start = 0
    for n in batches:
        batch, vals = drawn[start : start + n], np.arange(start, start + n)
        pos = table.insert(batch, vals)
        assert (table._tags.reshape(-1)[pos] == batch).all()
        ref.update(zip(batch.tolist(), vals.tolist(), strict=True))
        start += n
    assert table.values_at(table.find(drawn)).tolist() == [ref[t] for t in drawn.tolist()]
    assert table.contains(drawn).all() and table.size == len(ref)


@both
def test_a_batch_insert_into_one_bucket_spills_to_the_next(compiled: bool) -> None:
    table = TagTable(4 * WIDTH, max_load=1.0, compiled=compiled)
    nb = table.num_buckets
    same_home = tags([(i * nb) << 1 for i in range(WIDTH + 3)])
    table.insert(same_home, np.arange(len(same_home)))
    assert table.values_at(table.find(same_home)).tolist() == list(range(WIDTH + 3))
    table.remove_at(table.find(same_home[WIDTH:]))
    assert int(table._over.sum()) == 0
    assert (table.find(same_home[WIDTH:]) == -1).all()


@both
@SETTINGS
@given(
    st.lists(
        st.tuples(st.sampled_from(["push", "discard", "trim"]), st.integers(1, 60)), max_size=80
    )
)
def test_fingerprint_queue_is_a_bounded_fifo_set(
    compiled: bool, ops: list[tuple[str, int]]
) -> None:
    q = FingerprintQueue(20, payload=True, initial=4, compiled=compiled)
    ref: OrderedDict[int, int] = OrderedDict()
    for op, v in ops:
        t = v * 2 + 1
        if op == "push" and t not in ref:
            q.push(tags([t]), v)
            ref[t] = v
            while len(ref) > 20:
                ref.popitem(last=False)
        elif op == "discard":
            assert q.discard(tags([t])).tolist() == [t in ref]
            ref.pop(t, None)
        elif op == "trim":
            q.trim(v % 20)
            while len(ref) > v % 20:
                ref.popitem(last=False)
        assert len(q) == len(ref)
        probe = tags(list(range(1, 130, 2)))
        idx = q.find(probe)
        payload = q.payload(np.maximum(idx, 0))
        members = {int(p): int(payload[i]) for i, p in enumerate(probe) if idx[i] >= 0}
        assert members == dict(ref)


@both
@SETTINGS
@given(
    st.integers(1, 40),
    st.integers(1, 9),
    st.integers(1, 6),
    st.lists(
        st.tuples(st.sampled_from(["push", "discard"]), st.lists(st.integers(0, 90), max_size=12)),
        max_size=60,
    ),
)
def test_ghost_queue_answers_as_the_fingerprint_queue(
    compiled: bool, capacity: int, fresh: int, batch: int, ops: list[tuple[str, list[int]]]
) -> None:
    """Fresh pushes in a dict, owed trims, large pushes at once: every answer and size
    is the plain queue's (in numpy)."""
    ghost = GhostQueue(capacity, fresh=fresh, compiled=compiled)
    ghost.batch = batch
    ref = FingerprintQueue(capacity, initial=4, compiled=False)
    for op, values in ops:
        batch = tags(values)
        if op == "push":
            batch = tags(list(dict.fromkeys(v | 1 for v in values)))  # distinct, not members
            batch = batch[ref.find(batch) < 0]
            ghost.push(batch)
            ref.push(batch)
        else:
            assert ghost.discard(batch).tolist() == ref.discard(batch).tolist()
        assert len(ghost) == len(ref)
    probe = tags(list(range(0, 91)))
    assert ghost.discard(probe).tolist() == (ref.find(probe) >= 0).tolist()


@both
def test_tag_table_contains_follows_overflow_chains(compiled: bool) -> None:
    table = TagTable(32, max_load=1.0, compiled=compiled)  # 4 buckets of 8
    nb = table.num_buckets
    same_home = tags([(i * nb) << 1 for i in range(1, 2 * WIDTH + 3)])  # all in bucket 0
    table.insert(same_home, np.arange(len(same_home)))
    assert table.contains(same_home).all()
    assert not table.contains(tags([(99 * nb) << 1, 7 << 1])).any()
    table.remove_at(table.find(same_home[:WIDTH]))
    assert table.contains(same_home).tolist() == [False] * WIDTH + [True] * (WIDTH + 2)


@both
def test_removing_an_empty_entry_is_refused_and_changes_nothing(compiled: bool) -> None:
    table = TagTable(32, max_load=1.0, compiled=compiled)
    nb = table.num_buckets
    same_home = tags([(i * nb) << 1 for i in range(1, WIDTH + 3)])  # two spill over
    pos = table.insert(same_home, np.arange(len(same_home)))
    over = table._over.tolist()
    with pytest.raises(KeyError):
        table.remove_at(np.append(pos[-2:], pos[-1] + 1))  # the cell after the last: empty
    assert table._over.tolist() == over and table.size == len(same_home)
    assert table.values_at(table.find(same_home)).tolist() == list(range(len(same_home)))


@both
def test_a_ring_full_of_holes_is_squeezed_in_place(compiled: bool) -> None:
    """Discards from the middle leave holes until the ring is full of them: the members
    are rewritten from the ring's start, in the same table, and every answer stays."""
    q = FingerprintQueue(16, payload=True, initial=16, compiled=compiled)
    ref: OrderedDict[int, int] = OrderedDict()
    table = q._table
    squeezed = 0
    squeeze = q._squeeze

    def counted() -> None:
        nonlocal squeezed
        squeezed += 1
        squeeze()

    q._squeeze = counted  # type: ignore[method-assign]
    nxt = 0
    for step in range(60):
        batch = [2 * (nxt + i) + 1 for i in range(2)]
        nxt += 2
        q.push(tags(batch), [b % 1000 for b in batch])
        for b in batch:
            ref[b] = b % 1000
        while len(ref) > 16:
            ref.popitem(last=False)
        if step >= 8:  # two members from the middle
            middle = list(ref)[4:6]
            assert q.discard(tags(middle)).all()
            for m in middle:
                del ref[m]
        members = tags(list(ref))
        idx = q.find(members)
        assert (idx >= 0).all() and q.payload(idx).tolist() == list(ref.values())
        assert len(q) == len(ref)
    assert squeezed >= 2 and q._table is table  # squeezed, never rebuilt


def _every_bucket_overflowed(compiled: bool) -> tuple[TagTable, dict[int, int]]:
    """Two buckets of 8 (max_load 1.0), each with an overflow count and a free cell: the
    chain of an absent tag is a cycle, which only the bound of ``nb`` buckets ends."""
    table = TagTable(16, max_load=1.0, compiled=compiled)
    nb = table.num_buckets
    ref: dict[int, int] = {}

    def tag(home: int, i: int) -> int:
        return ((i * nb + home) << 1) | 1

    def put(t: int) -> None:
        ref[t] = len(ref)
        table.insert(np.array([t], np.int64), [ref[t]])

    def drop(t: int) -> None:
        table.remove_at(table.find(np.array([t], np.int64)))
        del ref[t]

    for i in range(WIDTH + 1):  # bucket 1 full, one spilled into bucket 0
        put(tag(1, i))
    drop(tag(1, 0))  # a cell free in bucket 1
    for i in range(WIDTH):  # bucket 0 full (with the spilled one), one spilled into 1
        put(tag(0, i))
    drop(tag(0, 1))  # not full: a cell free in bucket 0
    return table, ref


def _bounded(code: str, timeout: float = 60) -> str:
    """Run ``code`` in a fresh interpreter, from the repository root: a probe that never
    ends fails the test (``TimeoutExpired``) instead of hanging the suite."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return done.stdout


@both
def test_a_probe_ends_where_every_bucket_has_overflowed(compiled: bool) -> None:
    """Reachable at a high ``max_load``: every bucket's overflow count above zero, a cell
    free. find and contains of absent tags end (numpy's probes are bounded to ``nb``
    buckets, as the kernel's are) and answer as a dict, compiled or not."""
    code = (
        "import json\nimport numpy as np\n"
        "from kvferry.cache._table import WIDTH, TagTable\n"
        + inspect.getsource(_every_bucket_overflowed)
        + f"table, ref = _every_bucket_overflowed({compiled})\n"
        "probe = np.array([*ref, *(((i << 1) | 1) for i in range(40))], np.int64)\n"
        "print(json.dumps({'over': table._over.tolist(), 'size': table.size, 'ref': ref,\n"
        "    'probe': probe.tolist(), 'values': table.values_at(table.find(probe)).tolist(),\n"
        "    'contains': table.contains(probe).tolist()}))\n"
    )
    out = json.loads(_bounded(code))
    assert out["over"] == [1, 1] and out["size"] == 2 * WIDTH - 1  # the state meant
    ref = {int(t): v for t, v in out["ref"].items()}
    assert out["values"] == [ref.get(t, -1) for t in out["probe"]]
    assert out["contains"] == [t in ref for t in out["probe"]]
    assert len(ref) < len(out["probe"])  # absent tags asked too


def test_a_numpy_insert_with_no_free_cell_raises_instead_of_probing_forever() -> None:
    """A table whose size disagrees with its cells (a bug) cannot make insert loop."""
    code = (
        "import numpy as np\n"
        "from kvferry.cache._table import TagTable\n"
        "table = TagTable(16, max_load=1.0, compiled=False)\n"
        "table.insert(np.arange(1, 33, 2, dtype=np.int64), np.zeros(16))\n"
        "table.capacity += 1\n"
        "try:\n"
        "    table.insert(np.array([99], np.int64), [0])\n"
        "except OverflowError:\n"
        "    print('refused')\n"
    )
    assert _bounded(code).split() == ["refused"]
