"""DiskStore on a real temporary directory: round trips, every corruption a counted
miss, crash consistency, a full disk, bad configuration, warm restart."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from kvferry import ConfigError
from kvferry.tiers import (
    ALIGNMENT,
    HEADER_SIZE,
    DiskStore,
    FileOps,
    Outcome,
    aligned_buffer,
)
from kvferry.tiers._disk import TEMP_STALE_S

from .conftest import FP, key, payload

SIZES = [1, 4095, 4096, 3 * 4096 + 100, 1 << 20]


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("nbytes", SIZES)
def test_round_trip_is_bit_exact(make_store: Any, direct: bool, nbytes: int) -> None:
    store = make_store(direct=direct)
    assert store.direct_io is direct
    data = payload(nbytes, nbytes)
    assert store.write(key(1), data) == Outcome.OK
    aligned = aligned_buffer(nbytes)
    assert store.read(key(1), aligned) == Outcome.OK
    assert np.array_equal(aligned, data)
    unaligned = np.zeros(nbytes + 1, np.uint8)[1:]  # an address off the alignment
    assert store.read(key(1), unaligned) == Outcome.OK
    assert np.array_equal(unaligned, data)


def test_the_file_is_padded_so_the_payload_and_the_end_are_aligned(make_store: Any) -> None:
    store = make_store()
    store.write(key(1), payload(1, 5000))
    size = store.path_of(key(1)).stat().st_size
    assert size == HEADER_SIZE + 2 * ALIGNMENT
    assert store.used_bytes == size


def test_a_rewrite_replaces_the_chunk_and_its_accounting(make_store: Any) -> None:
    store = make_store()
    store.write(key(1), payload(1, 100))
    store.write(key(1), payload(2, 100))
    out = np.empty(100, np.uint8)
    assert store.read(key(1), out) == Outcome.OK
    assert np.array_equal(out, payload(2, 100))
    assert store.used_bytes == HEADER_SIZE + ALIGNMENT and len(store) == 1


def test_an_unknown_key_is_absent(make_store: Any) -> None:
    store = make_store()
    assert store.read(key(9), np.empty(10, np.uint8)) == Outcome.ABSENT
    assert store.statistics().absent == 1


def test_delete_removes_the_file_and_frees_its_bytes(make_store: Any) -> None:
    store = make_store()
    store.write(key(1), payload(1))
    assert store.delete(key(1)) is True
    assert not store.path_of(key(1)).exists()
    assert store.used_bytes == 0 and store.delete(key(1)) is False


# ------------------------------------------------------------------ corruption


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def truncate(path: Path, _: int) -> None:
    os.truncate(path, path.stat().st_size - ALIGNMENT)


@pytest.mark.parametrize(
    ("damage", "offset", "check"),
    [
        (flip_byte, HEADER_SIZE + 5000, "checksum"),  # a payload bit
        (flip_byte, 20, "header_checksum"),  # a header bit (the fingerprint)
        (flip_byte, 0, "magic"),
        (truncate, 0, "length"),
    ],
    ids=["payload-bit", "header-bit", "magic", "truncated"],
)
def test_a_damaged_chunk_is_a_counted_miss_and_deleted(
    make_store: Any, damage: Any, offset: int, check: str
) -> None:
    store = make_store()
    data = payload(1)
    store.write(key(1), data)
    path = store.path_of(key(1))
    damage(path, offset)
    out = np.zeros_like(data)
    assert store.read(key(1), out) == Outcome.CORRUPT
    stats = store.statistics()
    assert stats.corrupt == 1 and dict(stats.corrupt_by_check) == {check: 1}
    assert not path.exists() and key(1) not in store and store.used_bytes == 0
    assert store.read(key(1), out) == Outcome.ABSENT  # never loaded later either


def test_two_files_swapped_between_keys_are_both_misses(make_store: Any) -> None:
    store = make_store()
    store.write(key(1), payload(1))
    store.write(key(2), payload(2))
    a, b = store.path_of(key(1)), store.path_of(key(2))
    tmp = a.with_suffix(".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    out = np.zeros_like(payload(1))
    assert store.read(key(1), out) == Outcome.CORRUPT
    assert store.read(key(2), out) == Outcome.CORRUPT
    assert dict(store.statistics().corrupt_by_check) == {"key": 2}
    assert not a.exists() and not b.exists()


def test_a_chunk_of_another_fingerprint_is_a_counted_miss_left_on_disk(
    make_store: Any, tmp_path: Path
) -> None:
    other = make_store(fingerprint=attrs.evolve(FP, tp_rank=0, tp_world_size=2))
    other.write(key(1), payload(1))
    store = make_store()
    store.write(key(1), payload(1))
    mine = store.path_of(key(1))
    shutil.copyfile(other.path_of(key(1)), mine)  # e.g. a copy made by hand
    assert store.read(key(1), np.zeros_like(payload(1))) == Outcome.FOREIGN
    stats = store.statistics()
    assert stats.foreign == 1 and stats.corrupt == 0
    assert mine.exists() and key(1) not in store


def test_a_read_with_the_wrong_length_is_a_miss(make_store: Any) -> None:
    store = make_store()
    store.write(key(1), payload(1, 8192))
    assert store.read(key(1), np.zeros(4096, np.uint8)) == Outcome.CORRUPT
    assert dict(store.statistics().corrupt_by_check) == {"length": 1}


def test_corruption_is_logged_once_per_check(
    make_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    store = make_store()
    for i in range(3):
        store.write(key(i), payload(i))
        flip_byte(store.path_of(key(i)), HEADER_SIZE + 1)
    caplog.set_level(logging.WARNING, logger="kvferry.tiers")
    for i in range(3):
        assert store.read(key(i), np.zeros_like(payload(i))) == Outcome.CORRUPT
    warnings = [r for r in caplog.records if "disk_chunk_corrupt" in r.getMessage()]
    assert len(warnings) == 1
    assert store.statistics().corrupt == 3


# ------------------------------------------------------------------ crash consistency

WRITER = textwrap.dedent(
    """
    import sys
    from kvferry.tiers import DiskStore, FileOps, Fingerprint
    from tests.tiers.conftest import FP, key, payload

    class Slow(FileOps):
        '''Writes at most 64 KiB per call; once the header and a first piece of the
        payload are in the file, tells the parent and waits to be killed.'''
        def pwritev(self, fd, buffers, offset):
            if buffers and len(buffers[0]) > 65536:
                buffers = [buffers[0][:65536]]
            elif sum(map(len, buffers)) > 65536:
                buffers = buffers[:1]
            done = super().pwritev(fd, buffers, offset)
            if offset > 0:  # the header and a first piece of the payload are written
                print("mid-chunk", flush=True)
                sys.stdin.readline()  # blocks until the parent kills us
            return done

    store = DiskStore(sys.argv[1], 64 << 20, FP, ops=Slow())
    store.write(key(1), payload(1, 4 << 20))
    print("finished", flush=True)
    """
)


def test_a_writer_killed_mid_chunk_leaves_nothing_that_scans_as_valid(tmp_path: Path) -> None:
    path = tmp_path / "disk"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=Path(__file__).parents[2],
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "mid-chunk"
        beside = DiskStore(path, 64 << 20, FP)  # the writer holds <digest>: not this one
        assert beside.locked and beside.namespace.name == f"{FP.digest.hex()}.1"
        assert list(beside.namespace.rglob("*.tmp")) == []
        temps = list(path.glob(f"kvferry-v*/{FP.digest.hex()}/*/*.tmp"))
        assert len(temps) == 1 and temps[0].stat().st_size > HEADER_SIZE  # really mid-write
        assert beside.scan().temp_removed == 0  # nor does it touch the writer's file
        beside.close()
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    store = DiskStore(path, 64 << 20, FP)
    assert store.locked and store.namespace == temps[0].parents[1]  # its lock went with it
    report = store.scan(verify_headers=True)
    # Nobody else can write in a namespace held locked: the file is a dead writer's.
    assert report.chunks == 0 and report.temp_removed == 1 and report.temp_kept == 0
    assert list(store.namespace.rglob("*.tmp")) == [] and len(store) == 0
    assert store.read(key(1), np.zeros(4 << 20, np.uint8)) == Outcome.ABSENT


class NoFlock(FileOps):
    """A file system without ``flock`` (some network file systems): ENOLCK."""

    def flock(self, fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))


class ScanMidChunk(FileOps):
    """Once armed, another store on the same path starts and scans while this one's
    write is mid-chunk (its temporary file made, its bytes not yet written). ``locks``
    False: a file system without ``flock`` for both."""

    def __init__(self, make_other: Any, *, locks: bool = True) -> None:
        self.make_other = make_other
        self.locks = locks
        self.armed = False
        self.report: Any = None

    def flock(self, fd: int, operation: int) -> None:
        if not self.locks:
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        super().flock(fd, operation)

    def pwritev(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        if self.armed:
            self.armed = False
            self.report = self.make_other().scan()
        return super().pwritev(fd, buffers, offset)


@pytest.mark.parametrize("locks", [True, False], ids=["flock", "no-flock"])
def test_a_scan_leaves_the_temporary_file_of_a_write_in_flight_alone(
    make_store: Any, locks: bool
) -> None:
    """Two engines of one fingerprint on one path (or a worker started beside a running
    one): the one that starts scans while the other writes. With ``flock`` it scans a
    namespace of its own; without, the shared one, where a fresh ``.tmp`` may be a live
    writer's: deleting it would fail that write (its rename finds nothing)."""
    ops = ScanMidChunk(lambda: make_store(ops=FileOps() if locks else NoFlock()), locks=locks)
    writer = make_store(ops=ops)
    ops.armed = True
    data = payload(1)
    assert writer.write(key(1), data) == Outcome.OK
    assert ops.report.temp_removed == 0 and ops.report.temp_kept == (0 if locks else 1)
    out = np.zeros_like(data)
    assert writer.read(key(1), out) == Outcome.OK and np.array_equal(out, data)
    writer.close()
    assert make_store().scan().chunks == 1  # the next start finds it


def test_without_flock_a_scan_deletes_a_temporary_file_only_once_it_is_stale(
    make_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """No ``flock``: engines of one fingerprint share ``<digest>`` (a warning says so).
    A ``.tmp`` untouched for ``TEMP_STALE_S`` is a dead writer's (a live one writes its
    whole chunk in far less): deleted. A younger one is left to a later scan."""
    caplog.set_level(logging.WARNING, logger="kvferry.tiers")
    store = make_store(ops=NoFlock())
    assert not store.locked and store.namespace.name == FP.digest.hex()
    fan = store.path_of(key(1)).parent
    fresh, stale = fan / f"{key(1).hex()}.1.0.tmp", fan / f"{key(2).hex()}.1.1.tmp"
    for tmp in (fresh, stale):
        tmp.write_bytes(bytes(HEADER_SIZE))
    old = time.time() - TEMP_STALE_S - 1
    os.utime(stale, (old, old))
    other = make_store(ops=NoFlock())
    assert other.namespace == store.namespace  # shared, as without a lock there is no telling
    report = other.scan()
    assert report.temp_removed == 1 and report.temp_kept == 1 and report.chunks == 0
    assert fresh.exists() and not stale.exists()
    assert len([r for r in caplog.records if "disk_namespace_not_locked" in r.getMessage()]) == 1


def test_a_scan_of_a_namespace_held_locked_deletes_every_temporary_file(make_store: Any) -> None:
    """No other writer can be in a namespace its store holds locked, and the scan runs
    before the store's first write: every ``.tmp`` is a dead writer's, however young."""
    first = make_store()
    fan = first.path_of(key(1)).parent
    fresh = fan / f"{key(1).hex()}.1.0.tmp"
    fresh.write_bytes(bytes(HEADER_SIZE))
    first.close()
    store = make_store()
    assert store.locked and store.namespace == first.namespace
    report = store.scan()
    assert report.temp_removed == 1 and report.temp_kept == 0 and not fresh.exists()


# ------------------------------------------------------------------ failures


class Failing(FileOps):
    """Raises ``error`` from every pwritev once ``armed``."""

    def __init__(self, error: int) -> None:
        self.error = error
        self.armed = False

    def pwritev(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        if self.armed:
            raise OSError(self.error, os.strerror(self.error))
        return super().pwritev(fd, buffers, offset)


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (errno.ENOSPC, Outcome.NO_SPACE),
        (errno.EIO, Outcome.IO_ERROR),
        (errno.EACCES, Outcome.DENIED),
    ],
)
def test_a_failing_write_skips_the_store_counts_it_and_logs_once(
    make_store: Any, caplog: pytest.LogCaptureFixture, error: int, outcome: Outcome
) -> None:
    ops = Failing(error)
    store = make_store(ops=ops)
    store.write(key(0), payload(0))
    ops.armed = True
    caplog.set_level(logging.WARNING, logger="kvferry.tiers")
    assert store.write(key(1), payload(1)) == outcome
    assert store.write(key(2), payload(2)) == outcome
    stats = store.statistics()
    assert stats.writes_skipped == 2 and dict(stats.writes_skipped_by_outcome) == {outcome.name: 2}
    assert key(1) not in store and stats.used_bytes == store.path_of(key(0)).stat().st_size
    assert list(store.namespace.rglob("*.tmp")) == []  # the temporary files were removed
    assert len([r for r in caplog.records if "disk_store_skipped" in r.getMessage()]) == 1
    ops.armed = False
    assert store.write(key(1), payload(1)) == Outcome.OK  # the disk has room again


def test_a_read_error_is_a_counted_miss(make_store: Any) -> None:
    class BadRead(FileOps):
        def preadv(self, fd: int, buffers: list[memoryview], offset: int) -> int:
            raise OSError(errno.EIO, "I/O error")

    store = make_store(ops=BadRead())
    store.write(key(1), payload(1))
    assert store.read(key(1), np.zeros_like(payload(1))) == Outcome.IO_ERROR
    assert store.statistics().read_errors == 1 and key(1) not in store


class OpenFailsOnce(FileOps):
    """Raises ``error`` from the next open of a chunk file for reading, once armed."""

    def __init__(self, error: int) -> None:
        self.error = error
        self.armed = False

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        if self.armed and path.endswith(".kvc") and not flags & os.O_CREAT:
            self.armed = False
            raise OSError(self.error, os.strerror(self.error))
        return super().open(path, flags, mode)


class ReadFailsOnce(FileOps):
    """Raises ``error`` from the next preadv, once armed."""

    def __init__(self, error: int) -> None:
        self.error = error
        self.armed = False

    def preadv(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        if self.armed:
            self.armed = False
            raise OSError(self.error, os.strerror(self.error))
        return super().preadv(fd, buffers, offset)


def _cases(fails: type[FileOps], errors: list[int]) -> list[Any]:
    return [
        pytest.param(fails, e, id=f"{fails.__name__[:4].lower()}-{errno.errorcode[e]}")
        for e in errors
    ]


@pytest.mark.parametrize(
    ("fails", "error"),
    _cases(OpenFailsOnce, [errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EINTR, errno.EAGAIN])
    + _cases(ReadFailsOnce, [errno.ENOMEM, errno.EINTR, errno.EAGAIN]),
)
def test_a_transient_read_error_fails_the_read_and_keeps_the_chunk(
    make_store: Any, fails: Any, error: int
) -> None:
    """No file descriptor or memory left, an interrupted call: nothing is wrong with the
    file, so the read is a miss (the request recomputes) and the chunk stays a hit."""
    ops = fails(error)
    store = make_store(ops=ops)
    data = payload(1)
    store.write(key(1), data)
    ops.armed = True
    out = np.zeros_like(data)
    assert store.read(key(1), out) == Outcome.IO_ERROR
    stats = store.statistics()
    assert stats.read_errors == 1 and stats.corrupt == 0
    assert store.path_of(key(1)).exists() and key(1) in store
    assert stats.used_bytes == store.path_of(key(1)).stat().st_size
    assert store.read(key(1), out) == Outcome.OK and np.array_equal(out, data)


@pytest.mark.parametrize(
    ("fails", "error"),
    _cases(OpenFailsOnce, [errno.EIO, errno.EUCLEAN])
    + _cases(ReadFailsOnce, [errno.EIO, errno.EBADMSG, errno.EUCLEAN]),
)
def test_a_read_error_that_says_the_file_is_bad_deletes_the_chunk(
    make_store: Any, fails: Any, error: int
) -> None:
    """A media error, or the file system's own checksum or structure check failing on the
    file (EFSBADCRC, EFSCORRUPTED): the bytes cannot be read back, the chunk goes."""
    ops = fails(error)
    store = make_store(ops=ops)
    store.write(key(1), payload(1))
    ops.armed = True
    assert store.read(key(1), np.zeros_like(payload(1))) == Outcome.IO_ERROR
    assert store.statistics().read_errors == 1 and store.used_bytes == 0
    assert not store.path_of(key(1)).exists() and key(1) not in store


OUT_OF_FILES = textwrap.dedent(
    """
    import errno, os, resource, sys
    import numpy as np
    from kvferry.tiers import DiskStore
    from tests.tiers.conftest import FP, key, payload

    store = DiskStore(sys.argv[1], 64 << 20, FP)
    data = payload(1)
    store.write(key(1), data)
    out = np.zeros_like(data)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1024), hard))
    held = []
    try:
        while True:  # every descriptor this process may have, taken
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError as exc:
        assert exc.errno == errno.EMFILE, exc
    first = store.read(key(1), out)
    exists = store.path_of(key(1)).exists()
    os.close(held.pop())
    second = store.read(key(1), out)
    print(first.name, exists, second.name, np.array_equal(out, data), flush=True)
    """
)


def test_a_read_in_a_process_out_of_file_descriptors_keeps_the_chunk(tmp_path: Path) -> None:
    """A real EMFILE (RLIMIT_NOFILE lowered, every descriptor taken): the read fails, the
    chunk stays, and reads once a descriptor is free again."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", OUT_OF_FILES, str(tmp_path / "disk")],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).parents[2],
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["IO_ERROR", "True", "OK", "True"]


def test_a_write_whose_directory_fsync_failed_leaves_no_file(make_store: Any) -> None:
    """fsync "always": the chunk is complete under its final name when the directory's
    fsync fails, and the write is a failure; the file goes too (one the index does not
    hold would be neither counted nor ever deleted)."""

    class DirFsyncFails(FileOps):
        def fsync_dir(self, path: str) -> None:
            raise OSError(errno.EIO, "Input/output error")

    store = make_store(fsync="always", ops=DirFsyncFails())
    assert store.write(key(1), payload(1)) == Outcome.IO_ERROR
    assert key(1) not in store and store.used_bytes == 0
    assert list(store.namespace.rglob("*.kvc")) == []
    assert list(store.namespace.rglob("*.tmp")) == []


def test_bytes_to_use_bounds_the_store(make_store: Any) -> None:
    chunk = HEADER_SIZE + ALIGNMENT
    store = make_store(bytes_to_use=2 * chunk)
    assert store.write(key(1), payload(1, 100)) == Outcome.OK
    assert store.write(key(2), payload(2, 100)) == Outcome.OK
    assert store.write(key(3), payload(3, 100)) == Outcome.FULL
    assert dict(store.statistics().writes_skipped_by_outcome) == {"FULL": 1}
    store.delete(key(1))
    assert store.write(key(3), payload(3, 100)) == Outcome.OK
    assert store.used_bytes == 2 * chunk


def test_a_path_that_cannot_be_a_directory_fails_at_start_naming_the_key(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    with pytest.raises(ConfigError) as caught:
        DiskStore(blocker / "disk", 64 << 20, FP, tier_index=1)
    assert caught.value.key == "tiers[1].path"


def test_an_unwritable_path_fails_at_start_naming_the_key(tmp_path: Path) -> None:
    class ReadOnly(FileOps):  # as a read-only mount answers (root ignores mode bits)
        def open(self, path: str, flags: int, mode: int = 0o644) -> int:
            if flags & os.O_CREAT:
                raise OSError(errno.EROFS, "Read-only file system")
            return super().open(path, flags, mode)

    with pytest.raises(ConfigError) as caught:
        DiskStore(tmp_path / "disk", 64 << 20, FP, tier_index=2, ops=ReadOnly())
    assert caught.value.key == "tiers[2].path"
    assert "Read-only" in str(caught.value)


@pytest.mark.parametrize("size", [0, 4096, -1, 1.5, "1GB", 1 << 62])
def test_a_bad_size_fails_at_start_naming_the_key(tmp_path: Path, size: Any) -> None:
    with pytest.raises(ConfigError) as caught:
        DiskStore(tmp_path / "disk", size, FP, tier_index=0)
    assert caught.value.key == "tiers[0].bytes_to_use"


def test_a_file_system_without_o_direct_falls_back_to_buffered_io(make_store: Any) -> None:
    class NoDirect(FileOps):  # as tmpfs answers
        def open(self, path: str, flags: int, mode: int = 0o644) -> int:
            if flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return super().open(path, flags, mode)

    store = make_store(ops=NoDirect())
    assert store.direct_io is False
    assert store.write(key(1), payload(1)) == Outcome.OK
    assert store.read(key(1), np.zeros_like(payload(1))) == Outcome.OK


# ------------------------------------------------------------------ warm restart


def test_a_new_store_on_the_same_path_finds_what_the_old_one_held(make_store: Any) -> None:
    old = make_store()
    for i in range(20):
        old.write(key(i), payload(i))
    old.delete(key(3))
    old.close()  # its engine stops
    new = make_store()
    assert len(new) == 0  # nothing before the scan
    report = new.scan()
    assert report.complete and report.chunks == 19 and report.bytes == old.used_bytes
    assert sorted(new.keys()) == sorted(old.keys())
    out = np.zeros_like(payload(0))
    for i in (0, 7, 19):
        assert new.read(key(i), out) == Outcome.OK and np.array_equal(out, payload(i))
    assert new.read(key(3), out) == Outcome.ABSENT


def test_scan_logs_its_progress_and_end(make_store: Any, caplog: pytest.LogCaptureFixture) -> None:
    make_store().write(key(1), payload(1))
    caplog.set_level(logging.INFO, logger="kvferry.tiers")
    make_store().scan()
    events = [r.getMessage().split()[0] for r in caplog.records]
    assert events[0] == "disk_scan_started" and events[-1] == "disk_scan_finished"


def test_scan_stops_at_its_entry_budget_and_says_so(make_store: Any) -> None:
    old = make_store()
    for i in range(10):
        old.write(key(i), payload(i, 10))
    old.close()
    report = make_store().scan(max_entries=4)
    assert not report.complete and report.chunks == 4


def test_scan_leaves_other_fingerprints_and_strange_files_alone(make_store: Any) -> None:
    other_fp = attrs.evolve(FP, model="another-model")
    other = make_store(fingerprint=other_fp)
    other.write(key(1), payload(1))
    other.close()
    store = make_store()
    store.write(key(2), payload(2))
    stray = store.path_of(key(2)).parent / "notes.txt"
    stray.write_text("not a chunk")
    store.close()
    report = make_store().scan()
    assert report.chunks == 1 and report.foreign_namespaces == 1 and report.ignored == 1
    assert report.sibling_namespaces == 0
    assert stray.exists() and other.path_of(key(1)).exists()
    again = make_store(fingerprint=other_fp)
    assert again.scan().chunks == 1  # the other engine still finds its own


def test_scan_with_headers_skips_a_foreign_chunk_and_deletes_a_corrupt_one(
    make_store: Any,
) -> None:
    other = make_store(fingerprint=attrs.evolve(FP, dtype="float16"))
    other.write(key(1), payload(1))
    store = make_store()
    store.write(key(1), payload(1))
    store.write(key(2), payload(2))
    shutil.copyfile(other.path_of(key(1)), store.path_of(key(1)))
    flip_byte(store.path_of(key(2)), 17)
    store.close()
    report = make_store().scan(verify_headers=True)
    assert report.chunks == 0 and report.foreign_chunks == 1 and report.corrupt_removed == 1
    assert store.path_of(key(1)).exists() and not store.path_of(key(2)).exists()


def test_scan_deletes_a_chunk_file_of_impossible_size(make_store: Any) -> None:
    store = make_store()
    store.write(key(1), payload(1))
    os.truncate(store.path_of(key(1)), 100)
    store.close()
    report = make_store().scan()
    assert report.corrupt_removed == 1 and report.chunks == 0
    assert not store.path_of(key(1)).exists()


# ------------------------------------------------------------------ engines sharing a path


def test_one_engines_eviction_never_deletes_a_chunk_another_engine_holds(
    make_store: Any,
) -> None:
    """Two engines of one fingerprint on one ``path`` (two ``vllm serve`` of one model on
    a node, data-parallel engines): the same prompt stored by both, then evicted by one.
    The other still holds its chunk, and reads it."""
    a, b = make_store(), make_store()
    data = payload(1)
    assert a.write(key(1), data) == Outcome.OK
    assert b.write(key(1), data) == Outcome.OK
    assert b.delete(key(1))  # b's tier evicts it
    out = np.zeros_like(data)
    assert a.read(key(1), out) == Outcome.OK and np.array_equal(out, data)


def test_a_restarted_engine_indexes_its_own_chunks_not_a_running_neighbours(
    make_store: Any,
) -> None:
    """``bytes_to_use`` of two chunks each: an engine restarted beside a running one
    finds the chunks of its previous run, within its own ``bytes_to_use``, and leaves
    the other's alone."""
    from kvferry.tiers._format import file_size

    size = 2 * file_size(len(payload(0)))
    a, b = make_store(bytes_to_use=size), make_store(bytes_to_use=size)
    for i in (1, 2):
        assert a.write(key(i), payload(i)) == Outcome.OK
    for i in (3, 4):
        assert b.write(key(i), payload(i)) == Outcome.OK
    del b  # its engine stops (its process ends)
    again = make_store(bytes_to_use=size)
    report = again.scan()
    assert sorted(again.keys()) == [key(3), key(4)]
    assert report.chunks == 2 and again.used_bytes <= size
    assert sorted(a.keys()) == [key(1), key(2)]
    out = np.zeros_like(payload(1))
    assert a.read(key(1), out) == Outcome.OK and np.array_equal(out, payload(1))


def test_a_second_store_of_one_fingerprint_takes_the_next_namespace_and_a_restart_the_first(
    make_store: Any,
) -> None:
    """``flock`` conflicts between two opens even in one process: the second store takes
    ``<digest>.1``; once the first closed, a new store takes ``<digest>`` again and finds
    its chunks. Siblings are counted as such, not as other fingerprints'."""
    base = FP.digest.hex()
    first, second = make_store(), make_store()
    assert first.locked and second.locked
    assert (first.namespace.name, second.namespace.name) == (base, f"{base}.1")
    assert first.write(key(1), payload(1)) == Outcome.OK
    first.close()
    first.close()  # idempotent
    again = make_store()
    assert again.namespace == first.namespace
    report = again.scan()
    assert again.keys() == [key(1)]
    assert report.sibling_namespaces == 1 and report.foreign_namespaces == 0
    third = make_store()  # both held: the next one
    assert third.namespace.name == f"{base}.2"
    assert (third.namespace / "fingerprint.json").exists()


def test_an_attached_store_scans_the_namespace_its_owner_holds(make_store: Any) -> None:
    """The scheduler side scans, without locking, the namespace its engine's worker took:
    the one whose lock reads its owner; else the one a store of this process took last;
    else ``<digest>``."""
    base = FP.digest.hex()
    theirs, ours = make_store(owner="engine-2"), make_store(owner="engine-1")
    assert ours.namespace.name == f"{base}.1"
    for store, k in ((theirs, key(1)), (ours, key(2))):
        assert store.write(k, payload(1)) == Outcome.OK
    found = make_store(owner="engine-1", attach=True)
    assert not found.locked and found.namespace == ours.namespace
    assert found.scan().chunks == 1 and found.keys() == [key(2)]
    assert make_store(owner="engine-2", attach=True).namespace == theirs.namespace
    assert make_store(owner="engine-9", attach=True).namespace == ours.namespace  # taken last
    theirs.close()
    ours.close()
    assert make_store(owner="engine-9", attach=True).namespace.name == base
    assert make_store().namespace.name == base  # attaching locked nothing
