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
        store_dir = DiskStore(path, 64 << 20, FP).namespace
        temps = list(store_dir.rglob("*.tmp"))
        assert len(temps) == 1 and temps[0].stat().st_size > HEADER_SIZE  # really mid-write
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    store = DiskStore(path, 64 << 20, FP)
    report = store.scan(verify_headers=True)
    assert report.chunks == 0 and report.temp_removed == 1
    assert list(store.namespace.rglob("*.tmp")) == [] and len(store) == 0
    assert store.read(key(1), np.zeros(4 << 20, np.uint8)) == Outcome.ABSENT


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
    report = make_store().scan(max_entries=4)
    assert not report.complete and report.chunks == 4


def test_scan_leaves_other_fingerprints_and_strange_files_alone(make_store: Any) -> None:
    other_fp = attrs.evolve(FP, model="another-model")
    other = make_store(fingerprint=other_fp)
    other.write(key(1), payload(1))
    store = make_store()
    store.write(key(2), payload(2))
    stray = store.path_of(key(2)).parent / "notes.txt"
    stray.write_text("not a chunk")
    report = make_store().scan()
    assert report.chunks == 1 and report.foreign_namespaces == 1 and report.ignored == 1
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
    report = make_store().scan(verify_headers=True)
    assert report.chunks == 0 and report.foreign_chunks == 1 and report.corrupt_removed == 1
    assert store.path_of(key(1)).exists() and not store.path_of(key(2)).exists()


def test_scan_deletes_a_chunk_file_of_impossible_size(make_store: Any) -> None:
    store = make_store()
    store.write(key(1), payload(1))
    os.truncate(store.path_of(key(1)), 100)
    report = make_store().scan()
    assert report.corrupt_removed == 1 and report.chunks == 0
    assert not store.path_of(key(1)).exists()
