"""The disk tier's reclaims at their edges: a stale namespace a reclaim cannot remove whole
(a file no store makes left in it, a delete that fails, a file made there as its lock
file goes) is not counted, is logged, and keeps a lock file as old as it was, so that a
later start judges it again (a namespace without one is never judged: it stayed
forever); nothing a store does not make is deleted. And a live engine's lock file stays
fresh however long it runs, so a rank that follows rank 0 does not wait for it as for a
reclaim.

What happens "meanwhile" runs inside the reclaiming store's own file-system calls
(:class:`FileOps` hooks); a store's clock is injected (:class:`Steps`): no sleeps.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from kvferry.tiers import DiskStore, FileOps, Outcome
from kvferry.tiers._disk import LOCK_FILE, LOCK_REFRESH_S, STALE_NAMESPACE_S, _fan

from .conftest import FP, key, payload
from .test_disk_namespaces import age, try_lock
from .test_disk_ranks import D0, D1, FPS, Steps, never_sleep, not_followed

BASE = FP.digest.hex()
FOREIGN = b"not a store's"


@attrs.define
class Stale:
    holder: DiskStore
    """Holds ``<digest>``, not scanned yet."""
    namespace: Path
    """``<digest>.1``: an engine's that stopped over a day ago, its 3 chunks in it."""
    chunk: int
    """One chunk file's bytes."""


@pytest.fixture
def stale(make_store: Any) -> Stale:
    holder = make_store()
    gone = make_store()
    assert (holder.namespace.name, gone.namespace.name) == (BASE, f"{BASE}.1")
    for i in range(3):
        assert gone.write(key(i), payload(i)) == Outcome.OK
    (gone.namespace / "layout.json").write_text("{}")  # the connector's
    chunk = gone.used_bytes // 3
    gone.close()
    age(gone.namespace)
    return Stale(holder, gone.namespace, chunk)


def chunk_path(namespace: Path, i: int) -> Path:
    return namespace / _fan(key(i)) / (key(i).hex() + ".kvc")


def not_reclaimed(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [
        r.kvferry  # type: ignore[attr-defined]
        for r in caplog.records
        if getattr(r, "kvferry_event", None) == "disk_namespace_not_reclaimed"
    ]


def lock_age(namespace: Path) -> float:
    return time.time() - (namespace / LOCK_FILE).stat().st_mtime


# ------------------------------------------------------------------ not removed whole


ELSEWHERE = next(i for i in range(100, 200) if _fan(key(i)) != _fan(key(0)))
"""A key whose chunk file belongs in another fan directory than ``key(0)``'s."""


@pytest.mark.parametrize(
    "foreign",
    ["notes.txt", "notes.json", "FAN/notes.kvc", f"FAN/{key(ELSEWHERE).hex()}.kvc", "FAN/README"],
)
def test_a_stale_namespace_a_foreign_file_keeps_is_not_counted_and_is_judged_again(
    stale: Stale, caplog: pytest.LogCaptureFixture, foreign: str
) -> None:
    """A file no store makes (another name at the top, another ``.json``; in a fan
    directory, a ``.kvc`` whose name is no key of that directory, which the scan leaves
    alone too, or another name) stays, and so does the namespace: its chunks go, but it is
    not counted as reclaimed, its lock file stays (as old as it was), and the reclaim
    says so once, naming it and what is left. A later start judges it again: the file
    gone, it is reclaimed. (Its lock file removed, it was never judged again.)"""
    name = foreign.replace("FAN", _fan(key(0)))
    target = stale.namespace / name
    target.write_bytes(FOREIGN)
    age(stale.namespace)  # the fan directory changed: as stale as the rest
    caplog.set_level(logging.INFO, logger="kvferry.tiers")
    report = stale.holder.scan()
    assert report.reclaimed_namespaces == 0 and report.sibling_namespaces == 1
    assert report.reclaimed_bytes == 3 * stale.chunk
    assert target.read_bytes() == FOREIGN
    assert not any(chunk_path(stale.namespace, i).exists() for i in range(3))
    assert lock_age(stale.namespace) > STALE_NAMESPACE_S
    (warning,) = not_reclaimed(caplog)
    assert warning["path"] == str(stale.namespace) and warning["left"] == [name]
    assert os.strerror(errno.ENOTEMPTY) in warning["error"]
    assert stale.holder.scan().reclaimed_namespaces == 0  # judged again: still there
    assert len(not_reclaimed(caplog)) == 2 and target.exists()
    target.unlink()  # its owner takes it away; a day passes
    age(stale.namespace)
    report = stale.holder.scan()
    assert report.reclaimed_namespaces == 1 and report.sibling_namespaces == 0
    assert not stale.namespace.exists() and len(not_reclaimed(caplog)) == 2


class Refuse(FileOps):
    """Fails the unlink of ``path`` (EACCES) while ``refusing``."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.refusing = True

    def unlink(self, path: str) -> None:
        if self.refusing and path == self.path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        super().unlink(path)


def test_a_chunk_a_reclaim_cannot_delete_keeps_its_namespace_judged_again(
    stale: Stale, make_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A chunk file whose delete fails stays, and so does the namespace: not counted,
    its lock file kept, the error logged once with the path; the next start deletes the
    chunk and the namespace."""
    stale.holder.close()
    refused = chunk_path(stale.namespace, 1)
    ops = Refuse(refused)
    store = make_store(ops=ops)
    report = store.scan()
    assert report.reclaimed_namespaces == 0 and report.sibling_namespaces == 1
    assert report.reclaimed_bytes == 2 * stale.chunk
    assert refused.exists() and lock_age(stale.namespace) > STALE_NAMESPACE_S
    (warning,) = not_reclaimed(caplog)
    assert warning["path"] == str(stale.namespace) and "PermissionError" in warning["error"]
    assert warning["left"] == [f"{refused.parent.name}/{refused.name}"]
    store.close()
    ops.refusing = False
    report = make_store(ops=ops).scan()
    assert report.reclaimed_namespaces == 1 and report.reclaimed_bytes == stale.chunk
    assert not stale.namespace.exists() and len(not_reclaimed(caplog)) == 1


class AtLockUnlink(FileOps):
    """Runs ``then`` once, right after the unlink of the ``lock`` file of ``namespace``
    (a reclaim's, which removes the directory next)."""

    def __init__(self, namespace: Path, then: Callable[[], object]) -> None:
        self.lock = str(namespace / LOCK_FILE)
        self.then: Callable[[], object] | None = then

    def unlink(self, path: str) -> None:
        super().unlink(path)
        if self.then is not None and path == self.lock:
            then, self.then = self.then, None
            then()


def test_a_namespace_whose_directory_stays_after_its_lock_file_gets_one_back(
    stale: Stale, make_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Its lock file removed, the directory cannot be (here a file made in it at that
    moment): a lock file is made again, as old as the one removed, so the namespace is
    judged again; not counted, logged."""
    stale.holder.close()
    foreign = stale.namespace / "notes.txt"
    ops = AtLockUnlink(stale.namespace, lambda: foreign.write_bytes(FOREIGN))
    store = make_store(ops=ops)
    report = store.scan()
    assert ops.then is None and report.reclaimed_namespaces == 0
    assert report.sibling_namespaces == 1 and foreign.read_bytes() == FOREIGN
    assert lock_age(stale.namespace) > STALE_NAMESPACE_S
    (warning,) = not_reclaimed(caplog)
    assert warning["path"] == str(stale.namespace) and warning["left"] == ["notes.txt"]
    assert os.strerror(errno.ENOTEMPTY) in warning["error"]
    foreign.unlink()
    store.close()
    assert make_store().scan().reclaimed_namespaces == 1
    assert not stale.namespace.exists()


def test_a_store_that_takes_the_namespace_as_its_lock_file_goes_keeps_it(
    stale: Stale, make_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A store starting as the reclaim removed the lock file makes a new one and takes
    the namespace (empty now): the directory stays, in use. Not counted, not logged,
    and its lock file stays the taker's."""
    stale.holder.close()
    started: list[DiskStore] = []
    ops = AtLockUnlink(stale.namespace, lambda: started.append(make_store()))
    scanner = make_store(ops=ops)
    report = scanner.scan()
    (taker,) = started
    assert taker.namespace == stale.namespace and taker.locked
    assert report.reclaimed_namespaces == 0 and report.sibling_namespaces == 1
    assert report.reclaimed_bytes == 3 * stale.chunk and not not_reclaimed(caplog)
    assert not try_lock(stale.namespace / LOCK_FILE) and lock_age(stale.namespace) < 60
    assert taker.scan().chunks == 0
    assert make_store().namespace.name == f"{BASE}.2"


# ------------------------------------------------------------------ a live engine's lock


@pytest.mark.parametrize("use", ["write", "read"])
def test_a_rank_does_not_wait_for_a_live_engine_that_took_its_index_over_a_day_ago(
    make_store: Any, caplog: pytest.LogCaptureFixture, use: str
) -> None:
    """``<d1>.1`` is held by engine Z, which took it over a day ago and runs since; A's
    rank 0 takes ``<d0>.1``. Z's lock file, touched only when Z took it, looked like a
    reclaim's (stale), and A's rank 1 waited ``FOLLOW_WAIT_S`` for nothing. A store
    touches its lock file again as it reads and writes, once ``LOCK_REFRESH_S`` passed
    (one clock read a call till then): A's rank 1 takes the first free ``<d1>`` at once."""
    steps = Steps()
    x0 = make_store(fingerprint=FPS[0], owner="X")
    z = [make_store(fingerprint=FPS[1], owner="Z", clock=steps.clock) for _ in range(2)]
    assert [s.namespace.name for s in z] == [D1, f"{D1}.1"]
    z[0].close()
    assert z[1].write(key(1), payload(1)) == Outcome.OK
    age(z[1].namespace)

    def used() -> None:
        if use == "write":
            assert z[1].write(key(2), payload(2)) == Outcome.OK
        else:
            assert z[1].read(key(1), np.empty(len(payload(1)), np.uint8)) == Outcome.OK

    steps.now += LOCK_REFRESH_S / 2
    used()
    assert lock_age(z[1].namespace) > STALE_NAMESPACE_S  # not yet
    steps.now += LOCK_REFRESH_S / 2
    used()
    assert lock_age(z[1].namespace) < 60
    a0 = make_store(fingerprint=FPS[0], owner="A", leader=FPS[0])
    a1 = make_store(
        fingerprint=FPS[1], owner="A", leader=FPS[0], clock=steps.clock, sleep=never_sleep
    )
    assert [s.namespace.name for s in (x0, a0, a1)] == [D0, f"{D0}.1", D1]
    (warning,) = not_followed(caplog)
    assert warning["wanted"].endswith(f"{D1}.1") and warning["waited_s"] == 0
    assert z[1].locked and (z[1].namespace / LOCK_FILE).read_text() == "Z\n"
