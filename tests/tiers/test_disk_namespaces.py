"""DiskStore namespaces over time: a forked child never keeps its parent's namespace
locked, and namespaces engines that no longer run left behind are reclaimed (only
those: never one held, one used within STALE_NAMESPACE_S, or without a lock)."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from kvferry.tiers import DiskStore, FileOps, Outcome
from kvferry.tiers import _disk as disk_module
from kvferry.tiers._disk import LOCK_FILE, STALE_NAMESPACE_S, _fan

from .conftest import FP, key, payload

BASE = FP.digest.hex()


def try_lock(lock: Path) -> bool:
    """Whether a new open file description can take ``lock``'s flock now (let go at once)."""
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # lets it go, if taken
    return True


# ------------------------------------------------------------------ forks

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")


def forked(child: Callable[[], bytes]) -> tuple[int, int, bytes]:
    """Fork a child that runs ``child``, writes what it returns, then waits until told
    to exit (see :func:`end`): its pid, the pipe's end that tells it, what it wrote."""
    said_r, said_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing but the pipes, then out (no pytest teardown)
        try:
            os.close(said_r)
            os.close(go_w)
            os.write(said_w, child())
            os.read(go_r, 1)  # until the parent writes, or closes its end
        finally:
            os._exit(0)
    os.close(said_w)
    os.close(go_r)
    said = os.read(said_r, 64)  # the child runs (its fork hooks ran before this)
    os.close(said_r)
    return pid, go_w, said


def end(pid: int, go_w: int) -> None:
    os.write(go_w, b"x")
    os.close(go_w)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


@needs_fork
def test_a_forked_child_does_not_keep_the_namespace_locked(make_store: Any) -> None:
    """A ``flock`` belongs to the open file description, which a forked child shares
    (vLLM, torch and multiprocessing fork workers): were the child's copy kept, the
    namespace would stay locked after the store closed, as long as the child lives, and
    a restarted engine would take ``<digest>.1`` (its chunks orphaned in ``<digest>``).
    The child closes its copy at the fork; the parent's lock is unchanged."""
    store = make_store()
    lock = store.namespace / LOCK_FILE
    assert store.write(key(1), payload(1)) == Outcome.OK
    pid, go_w, said = forked(lambda: b"locked" if store.locked else b"not locked")
    try:
        assert store.locked and not try_lock(lock)  # the parent holds it still
        store.close()
        assert try_lock(lock)  # the child lives, and holds nothing
        again = make_store()
        assert again.locked and again.namespace == store.namespace
        assert again.scan().chunks == 1
        assert said == b"not locked"  # the child's copy of the store knows
    finally:
        end(pid, go_w)


@needs_fork
def test_a_forked_child_closing_its_copy_of_the_store_leaves_the_parents_lock(
    make_store: Any,
) -> None:
    """A child that closes the store it inherited (or runs its finalizers at exit) lets
    go of nothing: it truncated the parent's ``lock`` file (its owner gone: the
    scheduler could not find the namespace), and could close a descriptor the child
    had since reused."""
    store = make_store(owner="engine-1")
    lock = store.namespace / LOCK_FILE

    def child() -> bytes:
        store.close()
        return b"closed"

    pid, go_w, said = forked(child)
    try:
        assert said == b"closed"
        assert store.locked and not try_lock(lock)
        assert lock.read_text() == "engine-1\n"
        assert make_store(owner="engine-1", attach=True).namespace == store.namespace
    finally:
        end(pid, go_w)
    store.close()
    assert try_lock(lock)


# ------------------------------------------------------------------ reclaiming namespaces


def age(namespace: Path, seconds: float = STALE_NAMESPACE_S + 60) -> None:
    """Make ``namespace`` look idle for ``seconds``: its lock file and its fan
    directories (what says when it was last taken, let go, written or deleted in)."""
    then = time.time() - seconds
    os.utime(namespace / LOCK_FILE, (then, then))
    for entry in os.scandir(namespace):
        if entry.is_dir(follow_symlinks=False):
            os.utime(entry.path, (then, then))


SAME_FAN = [i for i in range(10_000) if _fan(key(i)) == _fan(key(0))][:3]
"""Keys whose chunks share a fan directory (a reclaim stopped between two: see the
last test)."""


@attrs.define
class Left:
    holder: DiskStore
    """Holds ``<digest>``, its own chunk from an earlier run in it, not scanned yet."""
    namespace: Path
    """``<digest>.1``: an engine's that stopped, its 3 chunks (``SAME_FAN``) in it."""
    nbytes: int


@pytest.fixture
def left(make_store: Any) -> Left:
    """Two engines of one fingerprint on one path, the second stopped: the first restarts
    (``holder``: it takes ``<digest>``), and ``<digest>.1`` holds what the second left."""
    earlier = make_store()
    assert earlier.write(key(9), payload(9)) == Outcome.OK
    earlier.close()
    holder = make_store()
    gone = make_store()
    assert (holder.namespace.name, gone.namespace.name) == (BASE, f"{BASE}.1")
    for i in SAME_FAN:
        assert gone.write(key(i), payload(i)) == Outcome.OK
    (gone.namespace / "layout.json").write_text("{}")  # the connector's, beside its chunks
    nbytes = gone.used_bytes
    gone.close()
    return Left(holder, gone.namespace, nbytes)


def test_a_stale_namespace_nobody_holds_is_reclaimed_at_start(
    left: Left, make_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Idle for ``STALE_NAMESPACE_S``: its chunks (up to that engine's bytes_to_use)
    would stay forever; the store that starts deletes it, once, and says so. Its own
    chunks, and other fingerprints' directories however old, stay."""
    other = make_store(fingerprint=attrs.evolve(FP, model="another-model"))
    assert other.write(key(1), payload(1)) == Outcome.OK
    other.close()
    age(left.namespace)
    age(other.namespace)
    caplog.set_level(logging.INFO, logger="kvferry.tiers")
    report = left.holder.scan()
    assert report.reclaimed_namespaces == 1 and report.reclaimed_bytes == left.nbytes
    assert report.sibling_namespaces == 0 and report.foreign_namespaces == 1
    assert report.chunks == 1 and left.holder.keys() == [key(9)]
    assert not left.namespace.exists()
    assert other.path_of(key(1)).exists()
    lines = [
        r.getMessage() for r in caplog.records if "disk_namespaces_reclaimed" in r.getMessage()
    ]
    assert len(lines) == 1 and f"'{BASE}.1'" in lines[0]
    again = make_store()  # another engine beside: <digest>.1 made afresh, empty
    assert again.namespace == left.namespace and again.scan().chunks == 0
    assert left.holder.scan().reclaimed_namespaces == 0  # nothing more


def test_a_namespace_let_go_within_the_day_is_kept(left: Left, make_store: Any) -> None:
    """Its engine may restart (a redeploy, a crash): it finds its chunks again."""
    age(left.namespace, STALE_NAMESPACE_S - 60)
    report = left.holder.scan()
    assert report.reclaimed_namespaces == 0 and report.reclaimed_bytes == 0
    assert report.sibling_namespaces == 1
    restarted = make_store()
    assert restarted.namespace == left.namespace and restarted.scan().chunks == 3


def test_a_namespace_written_within_the_day_is_kept_though_its_lock_file_is_old(
    left: Left,
) -> None:
    """An engine killed after a long run never let go (its lock file as old as its
    start): while it wrote within the day (a fan directory's mtime), it is not stale."""
    age(left.namespace)
    fan = next(p for p in left.namespace.iterdir() if p.is_dir())
    os.utime(fan)  # a chunk written there a moment ago
    report = left.holder.scan()
    assert report.reclaimed_namespaces == 0 and report.sibling_namespaces == 1
    assert len(list(left.namespace.glob("*/*.kvc"))) == 3


@pytest.mark.parametrize("by", ["store", "flock"])
def test_a_namespace_held_is_never_reclaimed(left: Left, make_store: Any, by: str) -> None:
    """However old its lock file: a running engine holds it (a store of this process, or
    any other open of its lock file holding the flock)."""
    held: Any
    if by == "store":
        held = make_store()
        assert held.namespace == left.namespace
    else:
        held = os.open(left.namespace / LOCK_FILE, os.O_RDWR)
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        age(left.namespace)
        report = left.holder.scan()
        assert report.reclaimed_namespaces == 0 and report.sibling_namespaces == 1
        assert len(list(left.namespace.glob("*/*.kvc"))) == 3
    finally:
        held.close() if by == "store" else os.close(held)


class NoFlock(FileOps):
    def flock(self, fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))


@pytest.mark.parametrize("how", ["attached", "no-flock"])
def test_a_store_without_a_lock_reclaims_nothing(left: Left, make_store: Any, how: str) -> None:
    """Without a namespace of its own locked (the scheduler's attached scan; a file
    system without flock, where engines share ``<digest>``) a store cannot tell a
    namespace in use from one left: it deletes none."""
    left.holder.close()
    age(left.namespace)
    store = make_store(attach=True) if how == "attached" else make_store(ops=NoFlock())
    assert not store.locked
    report = store.scan()
    assert report.reclaimed_namespaces == 0 and report.sibling_namespaces == 1
    assert len(list(left.namespace.glob("*/*.kvc"))) == 3


class ReclaimBeforeLock(FileOps):
    """Runs ``reclaim`` once, when the store is about to flock the file ``inode``: it
    opened the lock file, and a reclaim removes it before its flock."""

    def __init__(self, inode: int, reclaim: Callable[[], object]) -> None:
        self.inode = inode
        self.reclaim: Callable[[], object] | None = reclaim

    def flock(self, fd: int, operation: int) -> None:
        if self.reclaim is not None and os.fstat(fd).st_ino == self.inode:
            reclaim, self.reclaim = self.reclaim, None
            reclaim()
        super().flock(fd, operation)


def test_a_store_that_locks_a_lock_file_a_reclaim_removed_takes_the_namespace_afresh(
    left: Left, make_store: Any
) -> None:
    """A store opened ``<digest>.1/lock``; a reclaim removed it and let it go; the store
    then locks the unlinked file. Held by it, but at the path there is none (or a new
    one) that a third store would lock too: two engines in one namespace. The store sees
    the file it locked is not the path's, and takes the namespace with a new one."""
    age(left.namespace)
    reports = []
    ops = ReclaimBeforeLock(
        (left.namespace / LOCK_FILE).stat().st_ino,
        lambda: reports.append(left.holder.scan()),
    )
    taker = make_store(ops=ops)
    assert ops.reclaim is None and reports[0].reclaimed_namespaces == 1
    assert taker.locked and taker.namespace == left.namespace
    third = make_store()
    assert third.namespace.name == f"{BASE}.2"  # not in taker's
    assert not try_lock(taker.namespace / LOCK_FILE)  # the path's lock file is held


class Clock:
    """The ``time`` the disk module sees: the real one, its monotonic clock jumping past
    any deadline once told (see :class:`JumpOnUnlink`)."""

    def __init__(self) -> None:
        self.offset = 0.0
        self.time = time.time

    def monotonic(self) -> float:
        return time.monotonic() + self.offset


class JumpOnUnlink(FileOps):
    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def unlink(self, path: str) -> None:
        super().unlink(path)
        if f"{BASE}.1" in path:
            self.clock.offset = 1e9  # the scan's budget spent after this one


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    fake = Clock()
    monkeypatch.setattr(disk_module, "time", fake)
    yield fake


def test_a_reclaim_the_scans_budget_stopped_goes_on_at_a_later_start(
    left: Left, make_store: Any, clock: Clock
) -> None:
    """A namespace of many chunks: the reclaim stops with the scan's budget (the engine
    starts), here between two chunks of one fan directory, and the namespace stays stale
    (the delete changed that directory's mtime: set back), so a later start reclaims
    the rest."""
    age(left.namespace)
    left.holder.close()
    chunk = left.nbytes // 3
    stopped = make_store(ops=JumpOnUnlink(clock))
    report = stopped.scan(budget_s=3600)
    assert report.complete and report.chunks == 1
    assert report.reclaimed_namespaces == 0 and report.reclaimed_bytes == chunk
    assert report.sibling_namespaces == 1
    assert len(list(left.namespace.glob("*/*.kvc"))) == 2
    stopped.close()
    clock.offset = 0.0
    report = make_store().scan()
    assert report.reclaimed_namespaces == 1 and report.reclaimed_bytes == 2 * chunk
    assert not left.namespace.exists()
