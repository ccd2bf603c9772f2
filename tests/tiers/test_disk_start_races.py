"""The disk tier's namespaces while engines start: a store's start scan that judges a
sibling namespace must not keep another store that takes it at that moment out of it, and
a store that fails to start lets the namespace it took go.

Stores of one process stand for engines: ``flock`` locks of different open file
descriptions conflict within one process as between processes. What another engine
does "at that moment" runs inside the scanning store's own ``flock`` call
(:class:`AfterFlock`): deterministic, no sleeps.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvferry import ConfigError
from kvferry.tiers import DiskStore, FileOps, Outcome
from kvferry.tiers._disk import LOCK_FILE

from .conftest import FP, key, payload
from .test_disk_namespaces import try_lock
from .test_disk_ranks import D0, D1, FPS, never_sleep

BASE = FP.digest.hex()


class AfterFlock(FileOps):
    """Runs ``then`` once, right after this store's ``flock`` of the ``lock`` file of
    ``namespace`` succeeded (while it holds it): another engine starting meanwhile."""

    def __init__(self) -> None:
        self.namespace: Path | None = None
        self.then: Callable[[], object] | None = None

    def flock(self, fd: int, operation: int) -> None:
        super().flock(fd, operation)
        if self.then is None or self.namespace is None:
            return
        lock = self.namespace / LOCK_FILE
        if lock.exists() and os.fstat(fd).st_ino == lock.stat().st_ino:
            then, self.then = self.then, None
            then()

    def run_left(self) -> None:
        """What was to happen meanwhile and has not (the scan never locked it)."""
        if self.then is not None:
            then, self.then = self.then, None
            then()


def test_a_restarting_engine_takes_its_namespace_while_another_engine_scans(
    make_store: Any,
) -> None:
    """Two engines of a fingerprint ran on a node (``<digest>``, ``<digest>.1``) and it
    reboots: both start at once. X takes ``<digest>`` and scans; Y finds ``<digest>``
    held and takes ``<digest>.1``, let go a moment ago, its chunks there. Were X's scan
    to lock ``<digest>.1`` just to see it is not stale, Y would find it held at that
    moment and take an empty ``<digest>.2``: its chunks orphaned (deleted a day
    later). A namespace used within the day is not locked by a scan at all."""
    ops = AfterFlock()
    x = make_store(ops=ops)
    gone = make_store()
    assert (x.namespace.name, gone.namespace.name) == (BASE, f"{BASE}.1")
    for i in range(3):
        assert gone.write(key(i), payload(i)) == Outcome.OK
    gone.close()
    started: list[DiskStore] = []
    ops.namespace, ops.then = gone.namespace, lambda: started.append(make_store())
    report = x.scan()
    ops.run_left()
    (y,) = started
    assert report.reclaimed_namespaces == 0 and report.sibling_namespaces == 1
    assert y.namespace.name == f"{BASE}.1" and y.locked
    assert y.scan().chunks == 3


def test_a_following_rank_takes_its_index_while_another_engine_scans(
    make_store: Any,
) -> None:
    """Engine Y (``<d0>.1``, ``<d1>.1``) stopped a moment ago; X runs (index 0). A starts:
    its rank 0 takes ``<d0>.1``; its rank 1 follows into ``<d1>.1`` while X's rank 1
    (restarted) scans. Were the scan to lock ``<d1>.1`` to judge it, A's rank 1 would find
    it held, its lock file fresh (a live engine's, it must think), and not follow: it
    would take ``<d1>.2``, and A's scheduler, keeping only the chunks every rank holds,
    would delete all of Y's."""

    def rank(r: int, owner: str, **kwargs: Any) -> DiskStore:
        store: DiskStore = make_store(fingerprint=FPS[r], owner=owner, leader=FPS[0], **kwargs)
        return store

    ops = AfterFlock()
    x0, x1 = rank(0, "X"), rank(1, "X", ops=ops, sleep=never_sleep)
    y = [rank(0, "Y"), rank(1, "Y", sleep=never_sleep)]
    for store in y:
        for i in range(3):
            assert store.write(key(i), payload(i)) == Outcome.OK
        store.close()
    a0 = rank(0, "A")
    started: list[DiskStore] = []
    ops.namespace, ops.then = (
        y[1].namespace,
        lambda: started.append(rank(1, "A", sleep=never_sleep)),
    )
    report = x1.scan()
    ops.run_left()
    (a1,) = started
    assert report.reclaimed_namespaces == 0
    assert [s.namespace.name for s in (x0, x1, a0, a1)] == [D0, D1, f"{D0}.1", f"{D1}.1"]
    assert a1.locked and a1.scan().chunks == 3


def test_a_store_that_fails_to_start_lets_its_namespace_go(make_store: Any, tmp_path: Path) -> None:
    """A store whose start fails after it took its namespace (here: more bytes asked
    than the file system holds) is never returned, so nobody can close it; its lock
    stayed held as long as the error lived (its traceback holds the store: a caller
    that keeps or logs it), and the next store took ``<digest>.1``."""
    with pytest.raises(ConfigError) as failed:
        make_store(bytes_to_use=1 << 62)
    assert "file system holds" in str(failed.value)
    assert try_lock(tmp_path / "disk" / "kvferry-v1" / BASE / LOCK_FILE)
    store = make_store()
    assert store.namespace.name == BASE and store.locked
