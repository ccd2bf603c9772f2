"""The directory's compiled loops (numba) against its Python loops.

Two directories, one with ``compiled=True`` and one with ``compiled=False``, take the same
seeded histories — lookups, leases, loads, stores completed ok or failed, touches,
discards, evictions, resets, and calls that break an invariant (an unpin too many, a
store completed twice, slots out of range) — and must answer every call alike, tell their
policies the same, and end in the same state: slot states, pins, statistics, events,
invariant errors. The compiled one also keeps its requests' lookups for their touches (as
it does from a million slots): a touch from a lookup kept must tell the policy what one
resolving its keys again tells it. Then each kernel's contract on its own: it does the
whole job or changes nothing.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from kvferry.cache import Directory, _directory, _kernels
from kvferry.cache._directory import READY, STORING
from kvferry.cache._testing import key

kernels = _kernels.load()
needs_numba = pytest.mark.skipif(kernels is None, reason="numba is not installed")


def _same(a: Any, b: Any) -> None:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert a is not None and b is not None
        assert np.asarray(a).tolist() == np.asarray(b).tolist()
    else:
        assert a == b


class _Recorded:
    """A directory's policy, every call it gets written down (arrays as lists)."""

    def __init__(self, inner: Any, log: list[Any]) -> None:
        self._inner, self._log = inner, log

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any) -> Any:
            seen = [a.tolist() if isinstance(a, np.ndarray) else a for a in args]
            self._log.append((name, [a for a in seen if not callable(a)]))
            return attr(*args)

        return call


def _history(
    policy: str,
    watermarks: tuple[float, float],
    seed: int,
    keep: bool,
    monkeypatch: Any,
    index: str = "dict",
) -> None:
    rng = np.random.default_rng(seed)
    if keep:
        monkeypatch.setattr(_directory, "_KEEP_LOOKUPS_FROM", 0)
    pair = [
        Directory(24, policy=policy, watermarks=watermarks, events=True, index=index, compiled=c)
        for c in (True, False)
    ]
    assert pair[0]._k is not None and pair[1]._k is None
    assert pair[0]._keeps == keep and not pair[1]._keeps
    kept = [0]
    found_at_end = pair[0]._found_at_end

    def counted(keys: Any) -> Any:
        out = found_at_end(keys)
        kept[0] += out is not None
        return out

    pair[0]._found_at_end = counted  # type: ignore[method-assign]
    if keep and rng.random() < 0.5:  # the release counter passes its bound on the way
        pair[0]._epoch = _directory._EPOCH_MAX - 3
    logs: list[list[Any]] = [[], []]
    for d, log in zip(pair, logs, strict=True):
        d.policy = _Recorded(d.policy, log)  # type: ignore[assignment]
        d._touch_found = getattr(d.policy, "touch_found", None)  # LRU's, recorded too
    stores: list[Any] = []  # slots of stores in flight (the same in both)
    pins: list[Any] = []  # slots pinned by loads and leases
    running: list[Any] = []  # requests' keys, touched when they end
    for _ in range(400):
        op = int(rng.integers(0, 13))
        keys = [key(int(i)) for i in rng.integers(0, 60, size=int(rng.integers(1, 10)))]
        if op == 0:
            _same(*(d.lookup(keys) for d in pair))
        elif op == 1:
            got = [d.lookup_and_lease(keys) for d in pair]
            _same(*got)
            pins.append(got[0])
        elif op == 2:
            got = [d.lease(keys) for d in pair]
            _same(*got)
            pins.append(got[0])
        elif op == 3:
            got = [d.prepare_load(keys) for d in pair]
            assert (got[0] is None) == (got[1] is None)
            if got[0] is not None:
                _same(*got)
                pins.append(got[0])
        elif op == 4:
            got = [d.prepare_store(keys) for d in pair]
            _same(*got)
            stores.append(got[0][got[0] >= 0])
        elif op == 5 and stores:
            slots = stores.pop(int(rng.integers(0, len(stores))))
            ok = bool(rng.random() < 0.8)
            for d in pair:
                d.complete_store(slots, ok)
            if rng.random() < 0.1:  # completed twice: a bug elsewhere, reported
                for d in pair:
                    d.complete_store(slots, ok)
        elif op == 6 and pins:
            slots = pins.pop(int(rng.integers(0, len(pins))))
            _same(*(d.unpin(slots) for d in pair))
            if rng.random() < 0.1:  # one unpin too many, a slot out of range
                bad = np.append(slots, [-3, 10_000]).astype(np.int64)
                _same(*(d.unpin(bad) for d in pair))
        elif op == 7:
            for d in pair:
                d.touch(keys)
        elif op == 8:
            _same(*(d.discard(keys[:2]) for d in pair))
        elif op == 9:
            most = int(rng.integers(1, 6))
            _same(*(d.evict(most) for d in pair))
        elif op == 10 and rng.random() < 0.05:
            _same(*(d.reset() for d in pair))
        elif op == 11:  # a request: its lookup (and lease), its load, its store
            leased = bool(rng.random() < 0.5)
            if leased:
                got = [d.lookup_and_lease(keys) for d in pair]
                _same(*got)
                n = len(got[0])
            else:
                n = pair[0].lookup(keys)
                _same(n, pair[1].lookup(keys))
            if n and rng.random() < 0.8:
                loads = [d.prepare_load(keys[:n]) for d in pair]
                _same(*loads)
                pins.append(loads[0])
            if leased:
                pins.append(got[0])
            got = [d.prepare_store(keys[n:]) for d in pair]
            _same(*got)
            stores.append(got[0][got[0] >= 0])
            running.append(tuple(keys))
        elif op == 12 and running:  # one ends: its touch (the same keys, a new tuple)
            keys = list(running.pop(int(rng.integers(0, len(running)))))
            for d in pair:
                d.touch(tuple(keys))
    # Everything evictable, evicted: the same victims in the same order (the policies
    # learned the same from what each path handed them).
    _same(*(d._evict(d.num_slots, None) for d in pair))
    a, b = pair
    assert a._state.tolist() == b._state.tolist()
    assert a._pins.tolist() == b._pins.tolist()
    assert a.statistics() == b.statistics()
    assert a.take_events() == b.take_events()
    assert a.invariant_errors == b.invariant_errors > 0  # the bad calls were made
    assert len(logs[0]) > 20 and logs[0] == logs[1]  # the policy was told the same
    assert (kept[0] > 5) == keep  # touches came from lookups kept (where they are kept)


@needs_numba
@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo"])
@pytest.mark.parametrize("watermarks", [(1.0, 1.0), (0.6, 0.8)])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("keep", [False, True], ids=["resolve", "keep"])
@pytest.mark.parametrize("index", ["dict", "compact"])
def test_compiled_and_python_loops_answer_alike(
    policy: str,
    watermarks: tuple[float, float],
    seed: int,
    keep: bool,
    index: str,
    monkeypatch: Any,
) -> None:
    """The same history through a directory with its loops compiled and one without, each
    with the index named (compact: its kernels against its chains of ``map``)."""
    _history(policy, watermarks, seed, keep, monkeypatch, index)


def _duplicate_in_a_store(d: Directory) -> None:
    """A request names a key twice: its store takes it once; the touch finds it twice."""
    keys = (key(1), key(2), key(1), key(3))
    assert d.lookup(keys) == 0
    slots = d.prepare_store(keys)
    d.complete_store(slots[slots >= 0], True)
    d.touch(keys)


def _stored_by_another(d: Directory) -> None:
    """What a request did not find was stored by another one before it ended."""
    first = (key(1), key(2), key(3))
    second = (key(1), key(2), key(4))
    assert d.lookup(first) == 0
    d.lookup(second)
    slots = d.prepare_store(second)
    d.complete_store(slots, True)
    d.touch(first)


def _hit_evicted_by_its_own_store(d: Directory) -> None:
    """A request's hit, neither loaded nor leased, is evicted to make room for the rest
    of its keys (the directory is full): its slots hold other keys at its end."""
    old = [key(100 + i) for i in range(4)]
    for part in (old[:2], old[2:]):  # its hit, the oldest
        slots = d.prepare_store(part)
        d.complete_store(slots, True)
    keys = (*old[:2], *(key(i) for i in range(4)))
    n = d.lookup(keys)
    assert n == 2
    slots = d.prepare_store(keys[n:])
    assert (slots >= 0).all()
    d.complete_store(slots, True)
    assert d.slot_of(old[0]) is None  # its hit was evicted
    d.touch(keys)


@needs_numba
@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo"])
@pytest.mark.parametrize(
    "story", [_duplicate_in_a_store, _stored_by_another, _hit_evicted_by_its_own_store]
)
def test_a_lookup_kept_is_trusted_only_while_it_holds(
    policy: str, story: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each way a kept lookup goes stale between a request's lookup and its end: the
    touch tells the policy what resolving the keys again tells it."""
    monkeypatch.setattr(_directory, "_KEEP_LOOKUPS_FROM", 0)
    pair = [Directory(6, policy=policy, watermarks=(1.0, 1.0), compiled=c) for c in (True, False)]
    assert pair[0]._keeps and not pair[1]._keeps
    logs: list[list[Any]] = [[], []]
    for d, log in zip(pair, logs, strict=True):
        d.policy = _Recorded(d.policy, log)  # type: ignore[assignment]
        d._touch_found = getattr(d.policy, "touch_found", None)  # LRU's, recorded too
    kept = pair[0]._recent
    for d in pair:
        story(d)
    assert logs[0] == logs[1]
    assert len(kept) <= 1  # the touch took its request's lookup kept
    assert any(name == "touch" or name == "touch_found" for name, _ in logs[0])


@needs_numba
def test_a_kernel_that_fails_changes_nothing() -> None:
    assert kernels is not None
    state = np.zeros(8, np.int8)
    pins = np.zeros(8, np.int32)
    state[[1, 2, 3]] = READY
    pins[[1, 2]] = 1
    state[4] = STORING
    # Slot 1 twice, pinned once: the second release fails, the first is undone.
    assert not kernels.unpin_ready(state, pins, np.array([2, 1, 1], np.int64), 7)
    assert pins.tolist() == [0, 1, 1, 0, 0, 0, 0, 0]
    assert kernels.unpin_ready(state, pins, np.array([2, 1], np.int64), 7)
    assert pins.tolist() == [0] * 8
    assert not kernels.pin_if_all_ready(state, pins, np.array([1, 4], np.int64))
    assert pins.tolist() == [0] * 8
    assert not kernels.ready_if_all_storing(state, np.array([4, 3], np.int64), 7)
    assert state[4] == STORING
    assert not kernels.evictable_distinct(state, pins, np.array([1, 3, 1], np.int64), 7)
    assert not kernels.evictable_distinct(state, pins, np.array([1, 7], np.int64), 7)
    assert kernels.evictable_distinct(state, pins, np.array([3, 1], np.int64), 7)
    # Read-only and strided slots (what messages carry) are taken as they are.
    frozen = np.array([9, 1, 9, 3, 9, 2], np.int64)[1::2]
    frozen.flags.writeable = False
    assert kernels.leading_ready(state, frozen) == 3
    absent, ready = kernels.absent_and_ready(state, np.array([-1, 1, 4, -1], np.int64))
    assert absent.tolist() == [0, 3] and ready.tolist() == [1]
    released_at = np.array([0, 5, 2, 0, 0, 0, 0, 0], np.uint32)
    found = np.array([2, -1, 3, -1], np.int64)
    assert kernels.absent_if_current(released_at, found, 2) == 2
    assert kernels.absent_if_current(released_at, np.append(found, 1), 4) == -1


def test_compiled_true_without_numba_names_what_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_kernels, "load", lambda: None)
    with pytest.raises(ValueError, match="numba"):
        Directory(4, compiled=True)
    assert Directory(4)._k is None  # the default falls back to the Python loops


@needs_numba
def test_kvferry_jit_0_turns_the_compiled_loops_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Directory(4)._k is not None
    monkeypatch.setenv(_kernels.ENV, "0")
    assert Directory(4)._k is None
    assert Directory(4, compiled=True)._k is not None  # asked for by name: the caller's say


@needs_numba
def test_a_second_process_loads_every_kernel_from_numbas_cache() -> None:
    """This process compiled (or loaded) the kernels and numba cached them: a new one loads
    each from the cache, none compiled again (seconds at every engine start). A kernel
    that held a compiled helper in a closure cell was missed by the cache."""
    code = (
        "from kvferry.cache import _kernels\n"
        "k = _kernels.load()\n"
        "print(sorted(n for n, d in vars(k).items()"
        " if d.stats.cache_misses or not d.stats.cache_hits))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
