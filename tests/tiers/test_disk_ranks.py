"""DiskStore namespaces of the ranks of one engine: every rank takes the sibling index its
rank 0 took (``leader``), so that all of them hold the chunks one earlier engine left;
the scheduler keeps only the chunks held by every rank, and deletes the others.

Each rank is a DiskStore of its own (flock locks on different open file descriptions
conflict within one process, as between processes). A follower's clock moves only when
it sleeps, never for real (:class:`Steps`); what other ranks do while it waits runs in
its sleeps.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest

from kvferry.tiers import DiskStore, FileOps, Outcome
from kvferry.tiers import _disk as disk_module
from kvferry.tiers._disk import FOLLOW_POLL_S, LOCK_FILE

from .conftest import FP, key, payload
from .test_disk_namespaces import NoFlock, age

FPS = (attrs.evolve(FP, tp_world_size=2), attrs.evolve(FP, tp_rank=1, tp_world_size=2))
D0, D1 = (fp.digest.hex() for fp in FPS)


class Steps:
    """A follower's time: its monotonic clock moves only when it sleeps. ``meanwhile``:
    what happens elsewhere (another rank starting) during its next sleeps, one each."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept = 0
        self.meanwhile: list[Callable[[], object]] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept += 1
        self.now += seconds
        if self.meanwhile:
            self.meanwhile.pop(0)()

    def run_left(self) -> None:
        """What was to happen meanwhile and has not (a rank that did not wait)."""
        while self.meanwhile:
            self.meanwhile.pop(0)()


def never_sleep(seconds: float) -> None:
    raise AssertionError(f"slept {seconds} s")


@pytest.fixture
def steps() -> Steps:
    return Steps()


@pytest.fixture
def rank(make_store: Any, steps: Steps) -> Callable[..., DiskStore]:
    """Rank ``r`` of the engine ``owner`` (rank 0's fingerprint its leader)."""

    def make(r: int, owner: str, **kwargs: Any) -> DiskStore:
        kwargs.setdefault("clock", steps.clock)
        kwargs.setdefault("sleep", steps.sleep)
        store: DiskStore = make_store(fingerprint=FPS[r], owner=owner, leader=FPS[0], **kwargs)
        return store

    return make


def names(*stores: DiskStore) -> list[str]:
    return [s.namespace.name for s in stores]


def engine(rank: Callable[..., DiskStore], owner: str, keys: range) -> list[DiskStore]:
    """An engine of two ranks, each holding the chunks of ``keys``."""
    stores = [rank(0, owner), rank(1, owner)]
    for store in stores:
        for i in keys:
            assert store.write(key(i), payload(i)) == Outcome.OK
    return stores


def held_by_every_rank(make_store: Any, owner: str) -> set[bytes]:
    """What the scheduler side of engine ``owner`` restores: it attaches to each rank's
    namespace (the one whose lock names ``owner``, as DiskTier does) and keeps the keys
    every rank holds."""
    held: dict[bytes, int] = {}
    for fp in FPS:
        store = make_store(fingerprint=fp, owner=owner, attach=True)
        store.scan()
        for k in store.keys():
            held[k] = held.get(k, 0) + 1
    return {k for k, n in held.items() if n == len(FPS)}


def not_followed(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [
        r.kvferry  # type: ignore[attr-defined]
        for r in caplog.records
        if getattr(r, "kvferry_event", None) == "disk_namespace_not_followed"
    ]


def test_two_engines_restarting_at_once_keep_each_ones_ranks_on_one_index(
    rank: Callable[..., DiskStore],
    make_store: Any,
    steps: Steps,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A node reboots; engines X and Y had run there (X in ``<d0>``, ``<d1>``; Y in
    ``<d0>.1``, ``<d1>.1``). Two engines start at once: A's rank 0 takes ``<d0>``, B's
    rank 1 starts before B's rank 0. Taking the first free one of its own family, it
    would take ``<d1>`` (B's rank 0 then ``<d0>.1``, A's rank 1 ``<d1>.1``): each engine's
    ranks would hold two earlier engines' chunks, and its scheduler would keep only those
    both hold (none here). Following rank 0, B's rank 1 waits for it, and each engine
    finds all the chunks of one earlier engine."""
    for store in [*engine(rank, "X", range(0, 3)), *engine(rank, "Y", range(10, 13))]:
        store.close()
    caplog.set_level(logging.INFO, logger="kvferry.tiers")
    a0 = rank(0, "A")
    started: list[DiskStore] = []
    steps.meanwhile.append(lambda: started.append(rank(0, "B")))
    b1 = rank(1, "B")
    steps.run_left()
    (b0,) = started
    a1 = rank(1, "A")
    assert held_by_every_rank(make_store, "A") == {key(i) for i in range(0, 3)}
    assert held_by_every_rank(make_store, "B") == {key(i) for i in range(10, 13)}
    assert names(a0, a1) == [D0, D1]
    assert names(b0, b1) == [f"{D0}.1", f"{D1}.1"]
    assert steps.slept == 1 and not not_followed(caplog)


def test_a_rank_that_starts_before_its_rank_0_waits_for_it_and_follows(
    rank: Callable[..., DiskStore], steps: Steps, caplog: pytest.LogCaptureFixture
) -> None:
    """Engine X's rank 0 holds ``<d0>``, its rank 1 not started yet; engine A's rank 1
    starts first, then its rank 0 (``<d0>.1``), then X's rank 1. A's rank 1 waits for its
    rank 0 (polling, its clock injected), then takes ``<d1>.1``, not the first free
    ``<d1>``: X's rank 1 takes that one."""
    x0 = rank(0, "X")
    started: list[DiskStore] = []
    steps.meanwhile += [lambda: None, lambda: None, lambda: started.append(rank(0, "A"))]
    a1 = rank(1, "A")
    steps.run_left()
    (a0,) = started
    x1 = rank(1, "X")
    assert names(a0, a1) == [f"{D0}.1", f"{D1}.1"]
    assert names(x0, x1) == [D0, D1]
    assert a1.locked and steps.slept == 3 and steps.now == pytest.approx(3 * FOLLOW_POLL_S)
    assert not not_followed(caplog)


def test_a_rank_whose_rank_0_never_comes_takes_the_first_free_after_the_wait(
    rank: Callable[..., DiskStore], steps: Steps, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 0 failed to start, or took no namespace naming its engine: the rank waits
    ``FOLLOW_WAIT_S`` (on its clock), then takes the first free one of its own family,
    as before, and says so (naming rank 0's family and the namespace taken)."""
    x0 = rank(0, "X")  # another engine's rank 0: not followed
    a1 = rank(1, "A")
    wait = disk_module.FOLLOW_WAIT_S
    assert names(x0, a1) == [D0, D1] and a1.locked
    assert wait <= steps.now < wait + 2 * FOLLOW_POLL_S
    (warning,) = not_followed(caplog)
    assert warning["leader"].endswith(D0) and warning["path"].endswith(D1)
    assert warning["waited_s"] >= wait


def test_a_rank_whose_index_another_engine_holds_takes_the_first_free_at_once(
    rank: Callable[..., DiskStore], make_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """``<d1>.1`` is held by a live engine (one of an earlier kvferry, or whose ranks
    diverged: its lock touched within the day) while A's rank 0 took ``<d0>.1``: A's
    rank 1 cannot follow, does not wait, and takes the first free ``<d1>``, naming
    both in its warning."""
    x0 = rank(0, "X")
    older = [make_store(fingerprint=FPS[1], owner="Z") for _ in range(2)]
    assert names(*older) == [D1, f"{D1}.1"]
    older[0].close()
    a0 = rank(0, "A")
    a1 = rank(1, "A", sleep=never_sleep)
    assert names(x0, a0, a1) == [D0, f"{D0}.1", D1]
    (warning,) = not_followed(caplog)
    assert warning["leader"].endswith(f"{D0}.1") and warning["wanted"].endswith(f"{D1}.1")
    assert warning["path"].endswith(D1) and warning["waited_s"] == 0


class Meanwhile(FileOps):
    """Runs ``then`` once, at the first unlink of a file under ``under``."""

    def __init__(self, under: Path, then: Callable[[], object]) -> None:
        self.under = str(under) + os.sep
        self.then: Callable[[], object] | None = then

    def unlink(self, path: str) -> None:
        if self.then is not None and path.startswith(self.under):
            then, self.then = self.then, None
            then()
        super().unlink(path)


def test_a_rank_whose_index_a_reclaim_holds_waits_for_it_and_takes_it_afterwards(
    rank: Callable[..., DiskStore], make_store: Any
) -> None:
    """Engine Y (index 1) stopped a day ago; X runs (index 0). X's rank 1 reclaims
    ``<d1>.1`` (stale: its rank 0's ``<d0>.1`` too) at its start scan; meanwhile A's rank 0
    takes ``<d0>.1`` and A's rank 1 finds ``<d1>.1`` held, its lock file stale: a
    reclaim, which lets go when done. It waits (it does not take ``<d1>.2``), and takes
    ``<d1>.1`` afresh once the reclaim let go."""
    x0 = rank(0, "X")
    y = engine(rank, "Y", range(10, 13))
    for store in y:
        store.close()
        age(store.namespace)
    waiting, reclaimed = threading.Event(), threading.Event()
    steps = Steps()
    started: dict[str, DiskStore] = {}
    threads: list[threading.Thread] = []

    def a1_sleeps(seconds: float) -> None:
        steps.sleep(seconds)
        waiting.set()
        assert reclaimed.wait(30), "the reclaim did not end"

    def a1_starts() -> None:
        started["a1"] = rank(1, "A", clock=steps.clock, sleep=a1_sleeps)

    def meanwhile() -> None:
        started["a0"] = rank(0, "A")
        threads.append(threading.Thread(target=a1_starts))
        threads[0].start()
        assert waiting.wait(30), "A's rank 1 did not wait"

    x1 = rank(1, "X", ops=Meanwhile(y[1].namespace, meanwhile))
    report = x1.scan()
    reclaimed.set()
    for thread in threads:
        thread.join(30)
    assert report.reclaimed_namespaces == 1 and "a1" in started
    assert names(x0, x1, started["a0"], started["a1"]) == [D0, D1, f"{D0}.1", f"{D1}.1"]
    assert started["a1"].locked and steps.slept >= 1


def test_a_following_rank_keeps_a_stale_namespace_whose_rank_0_was_taken_lately(
    rank: Callable[..., DiskStore], make_store: Any
) -> None:
    """Engine Y (index 1) stopped a day ago. A's rank 0 took ``<d0>.1``; before A's rank
    1 takes ``<d1>.1``, X's rank 1 scans: ``<d1>.1`` is stale, but the index's rank 0
    namespace was taken within the day: kept, and A finds all of Y's chunks. A rank 0
    namespace stale too: reclaimed, as before."""
    x0 = rank(0, "X")
    for store in engine(rank, "Y", range(10, 13)):
        store.close()
        age(store.namespace)
    a0 = rank(0, "A")
    x1 = rank(1, "X")
    report = x1.scan()
    assert report.reclaimed_namespaces == 0 and report.sibling_namespaces == 1
    a1 = rank(1, "A")
    assert names(x0, x1, a0, a1) == [D0, D1, f"{D0}.1", f"{D1}.1"]
    assert held_by_every_rank(make_store, "A") == {key(i) for i in range(10, 13)}
    for store in (a0, a1):
        store.close()
        age(store.namespace)
    x1.close()
    assert rank(1, "X").scan().reclaimed_namespaces == 1


def test_without_flock_a_rank_does_not_wait(make_store: Any) -> None:
    """Where the file system has no flock every rank uses its ``<digest>``, as before: a
    rank does not wait for a namespace it could not tell from another engine's."""
    a1 = make_store(fingerprint=FPS[1], owner="A", leader=FPS[0], ops=NoFlock(), sleep=never_sleep)
    assert names(a1) == [D1] and not a1.locked


@pytest.mark.parametrize("case", ["no owner", "rank 0", "no leader"])
def test_nothing_is_followed_without_an_owner_or_another_leader(make_store: Any, case: str) -> None:
    """An empty owner names no engine (a lock file let go reads empty too); rank 0
    itself (its own fingerprint as leader), or no leader (one rank): the first free."""
    x = [make_store(fingerprint=fp, owner="X") for fp in FPS]  # held while referenced
    fp, owner, leader = {
        "no owner": (FPS[1], "", FPS[0]),
        "rank 0": (FPS[0], "A", FPS[0]),
        "no leader": (FPS[1], "A", None),
    }[case]
    store = make_store(fingerprint=fp, owner=owner, leader=leader, sleep=never_sleep)
    assert store.locked and store.namespace.name == f"{fp.digest.hex()}.1"
    assert names(*x) == [D0, D1]


def test_a_rank_0_lock_let_go_is_not_followed(rank: Callable[..., DiskStore], steps: Steps) -> None:
    """Rank 0 that let its namespace go (closed: its lock file emptied) is not found:
    only a lock file naming the engine is."""
    gone = rank(0, "A")
    gone.close()
    assert (gone.namespace / LOCK_FILE).read_text() == ""
    started: list[DiskStore] = []
    steps.meanwhile.append(lambda: started.append(rank(0, "B")))  # in the same namespace
    a1 = rank(1, "A")
    assert names(*started, a1) == [D0, D1] and steps.now >= disk_module.FOLLOW_WAIT_S
