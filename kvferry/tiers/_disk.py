"""DiskStore: a bounded, verified, persistent directory of chunk files.

Layout under ``path``::

    kvferry-v1/<namespace>/fingerprint.json    what the digest stands for
    kvferry-v1/<namespace>/lock                held (flock) by the store using it
    kvferry-v1/<namespace>/<fan>/<key hex>.kvc  one chunk (see ._format)

A namespace is the fingerprint's digest in hex, ``<digest>``, or a numbered sibling of
it, ``<digest>.1``, ``<digest>.2``, ...: one per engine of that fingerprint running on
``path``. A store takes the first whose ``lock`` it can hold (an exclusive, non-blocking
``flock``, made if missing) and holds it until :meth:`DiskStore.close` (or its process
ends): two engines of one fingerprint (two ``vllm serve`` of one model on a node,
data-parallel engines: the fingerprint names neither) never share one, so neither
deletes, evicts, counts or scans the other's chunks, and each keeps to its own
``bytes_to_use``. An engine restarted takes the first free one again, and its scan finds
the chunks a previous engine left there. Where the file system has no ``flock`` (ENOLCK,
EOPNOTSUPP on some network file systems) the store warns once and uses ``<digest>``
without a lock, shared as before. The scheduler side scans the namespace its worker
took without locking it (``attach``: see :meth:`DiskStore.__init__`).

Ranks of one engine: each tensor-parallel rank has a fingerprint of its own (its own
bytes), hence its own family of namespaces, and the scheduler keeps only the chunks held
by every rank (deleting the others). Were each rank to take the first free index of its
own family, two engines starting at once (a node reboot) could interleave: engine A's
rank 0 in ``<d0>`` and its rank 1 in ``<d1>.1`` (engine B's rank 1 took ``<d1>``
first), each holding the chunks of another earlier engine: most of both caches deleted.
So every rank but the first follows it (``leader``: rank 0's fingerprint): rank 0 takes
the first free index ``n`` of its family and its ``lock`` names the engine (``owner``);
rank ``r`` finds, among ``<d0>``, ``<d0>.1``, ..., the namespace whose ``lock`` names
its ``owner``, and takes the same index ``n`` of its own family, waiting for rank 0 (it
may start later) up to :data:`FOLLOW_WAIT_S`, polling every :data:`FOLLOW_POLL_S`; with
its ``<dr>.n`` held by another store, it waits too while that ``lock`` file looks stale
(a reclaim holds it, and removes it when done). Where it cannot follow (its ``<dr>.n``
held by a live engine: one of an earlier kvferry, or one whose ranks diverged; or rank 0
not found, or ``<dr>.n`` not let go, in time) it takes the first free index of its own
family, as before, and says so (``disk_namespace_not_followed``, a warning naming rank
0's namespace and the one taken). Where the file system has no ``flock`` nothing is
followed (every rank uses its ``<digest>``).

A namespace outlives its engine: when two engines of a fingerprint on ``path`` become
one, ``<digest>.1`` keeps up to ``bytes_to_use`` of chunks nobody takes again. Its
``lock`` file's mtime says when a store last took it, let it go, or used it (touched
then; while it holds it, again at a read or write once :data:`LOCK_REFRESH_S` passed),
its fan directories' when a chunk was last written or deleted there; a store holding its
own namespace locked, when it scans at start, reclaims every other namespace of its
fingerprint that nobody holds (it takes the ``flock`` itself, non-blocking, and holds it
while it deletes: no engine can take it meanwhile) and that has been idle for
:data:`STALE_NAMESPACE_S` (a day): its files, then its ``lock`` file, its directory, and
only then the ``flock``. One it cannot remove whole (a file no store makes left in it, a
delete that failed) keeps its ``lock`` file, so that later starts judge it again, and is
logged, not counted. A store taking a namespace checks, once it holds the ``flock``,
that the ``lock`` file at the path is still the one it locked (one opened before a
reclaim removed it is not), and else opens it afresh. A store without a lock (no
``flock`` on the file system, or attached) reclaims nothing. A rank that follows rank 0
(above) does not reclaim its ``<dr>.n`` while rank 0's ``<d0>.n`` was taken, let go or
used within :data:`STALE_NAMESPACE_S` (its ``lock`` file's mtime): an engine whose rank 0
took ``<d0>.n`` a moment ago has its rank ``r`` about to take ``<dr>.n``, and finds the
chunks the earlier engine left there, beside rank 0's.

Forks: the ``flock`` belongs to the open file description, which a child forked without
exec shares (vLLM, torch and multiprocessing fork workers): the lock would stay held
while the child lives, after the store closed or its process died, and a restarted
engine would take a sibling (its chunks orphaned). The lock's descriptor is opened with
``O_CLOEXEC``, and a forked child closes its copy at once (``os.register_at_fork``): the
child holds no namespace (its copy of the store reads ``locked`` False), the parent's
lock is unchanged. A fork done in C without Python's fork hooks (not ``os.fork``,
``multiprocessing``, ``subprocess``) still shares it until the child execs or exits.

``<fan>`` is 2 hex digits of the key's xxh3_64: 256 directories, made at start (once:
they persist), so a directory holds about ``chunks / 256`` entries (4096 for a million
chunks, 2 TB of 2 MiB chunks; ext4 indexes directories). Making a directory on a chunk's
first write costs about as much as the write (measured with benchmarks/tiers.py: writes
into fresh directories ran at 0.58 of a plain O_DIRECT loop, into made ones at 0.87),
hence made at start (256 ``mkdir``, about 65 ms here, once).

Engines with another fingerprint (another model, dtype, layout, block size, rank, ...)
live in their own directory beside ours; a store never reads, counts as its own, or
deletes them. Many engines may share ``path``, of any fingerprints: each uses a
namespace of its own (above), and its own ``bytes_to_use`` (N engines on one ``path``
use up to N times theirs).

Writes: a temporary name in the chunk's directory (``<key hex>.<pid>.<n>.tmp``), the
header and the payload written, closed, then renamed over the final name. A writer that
dies mid-chunk leaves only a ``.tmp`` file, which no read opens and ``scan`` deletes: at
once in a namespace the store holds locked (no other writer can be there, and the scan
runs before the store's own first write), else once it is :data:`TEMP_STALE_S` old (no
lock: the file may be a live writer's in another process; a name's pid says nothing
across pid namespaces, and is reused; deleting it would fail that write).
fsync policy (``fsync``): ``"never"`` (the default) calls no fsync — a crash of the
process cannot leave a torn chunk under a final name, and a power loss can (the rename
may reach the disk before the data), but every read verifies the header and the xxh3
checksum, so a torn chunk is a miss, never a load; the price is only lost hits after a
power loss. ``"always"`` fdatasyncs the file before the rename and fsyncs the directory
after it, for chunks that survive power loss (each write then waits for the device).

Failures are misses, never errors the caller must handle: a full disk (ENOSPC,
EDQUOT), an I/O error, a permission or read-only error skip the store (counted in
:class:`DiskStatistics`, logged once per kind); a chunk that fails verification is
counted by the check that failed, logged once per check, deleted, and never loaded; a
chunk of another fingerprint found under our name is counted and left alone. A read the
file system fails is a miss; the chunk is deleted only when the error says the file is
bad (EIO, EBADMSG, EUCLEAN), and stays for a transient one (EMFILE, ENOMEM, ...).

I/O: with ``O_DIRECT`` where the file system takes it (probed at start: a file opened and
written with ``O_DIRECT`` in the store's directory; ``EINVAL`` means buffered I/O), from
and into aligned memory: a payload at an aligned address is written and read in place
(one ``pwritev`` / ``preadv`` with the header), anything else goes through a bounce
buffer. Files are always padded to :data:`~._format.ALIGNMENT`, so either mode reads
the other's files.

Who owns what: the index (key -> bytes on disk) and the counters are guarded by one
lock; ``read``, ``write``, ``delete`` may be called from several threads at once (the
disk actor runs them in worker threads). ``scan`` is called once, at start, before any
other call; ``close`` once I/O has stopped (it lets the namespace go).
"""

from __future__ import annotations

import enum
import errno
import fcntl
import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt
import xxhash
from typing_extensions import Buffer

from .._errors import ConfigError
from .._logging import get_logger
from ._format import (
    ALIGNMENT,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAX_KEY_BYTES,
    ChunkCorrupt,
    ChunkForeign,
    ChunkHeader,
    Fingerprint,
    decode_header,
    file_size,
    padded,
    payload_checksum,
)

FANOUT_HEX_DIGITS = 2
_SUFFIX = ".kvc"
_TEMP_SUFFIX = ".tmp"
_O_DIRECT: int = getattr(os, "O_DIRECT", 0)

SCAN_PROGRESS_EVERY_S = 5.0
"""A ``disk_scan_progress`` line at most this often while a scan runs."""

TEMP_STALE_S = 60.0
"""In a namespace the store could not lock (no ``flock`` on the file system, or a scan
that attached without locking), a ``.tmp`` file untouched this long is a dead writer's,
and ``scan`` deletes it; a younger one may be a live writer's (another engine of the
same fingerprint sharing the namespace) and is left for a later scan. A live writer
touches its file with every write and renames it within one chunk's I/O. In a namespace
the store holds locked, ``scan`` deletes every ``.tmp`` at once."""

LOCK_FILE = "lock"
"""In a namespace: the file whose ``flock`` its store holds; it reads the holder's
``owner`` (see :class:`DiskStore`). Its mtime is when a store last took or let go of the
namespace, or used it (:data:`LOCK_REFRESH_S`)."""

LOCK_REFRESH_S = 3600.0
"""A store holding its namespace touches its ``lock`` file again at a read or write once
this long passed since it last did (its ``clock``): a live engine's ``lock`` file stays
fresh, however long it runs. A rank that follows rank 0 into a namespace held waits
while its ``lock`` file is stale (a reclaim's hold, let go soon: :func:`_may_be_reclaimed`);
an engine that ran over a day on a ``lock`` file touched only when it took it looked like
one, and the rank waited :data:`FOLLOW_WAIT_S` for nothing. (One that neither read nor
wrote for :data:`STALE_NAMESPACE_S` still does.) Read at each call (tests change it)."""

STALE_NAMESPACE_S = 24 * 3600.0
"""A namespace of our fingerprint that nobody holds locked, that no store took or let go
of (its ``lock`` file's mtime) and no chunk was written into or deleted from (its fan
directories' mtimes) for this long, is left by an engine that no longer runs on ``path``
(two engines of a fingerprint became one, a data-parallel size shrank): a store holding
its own namespace reclaims it at its start scan, freeing up to that engine's
``bytes_to_use``. A day: an engine restarted within it (a redeploy, a crash loop, a node
reboot, a failure fixed the next morning) takes its namespace again and finds its
chunks; a prefix cache a day old is worth less than the disk it holds, and a day later
the engines on ``path`` most likely stay fewer. The fan directories count too: an
engine killed after a long run (no ``close``, its ``lock`` file touched up to
:data:`LOCK_REFRESH_S` before its last read or write) is not stale while it wrote within
the day. Read at each scan (tests change it)."""

FINGERPRINT_FILE = "fingerprint.json"
"""At a namespace's top: the fingerprint its chunks were written under (a change clears
them)."""

LAYOUT_FILE = "layout.json"
"""At a namespace's top, beside the chunk files: the host row layout the connector's
worker saw (written and read by it, which imports this name; named here, as a reclaim
deletes it too)."""

_DESCRIPTIONS = frozenset((FINGERPRINT_FILE, LAYOUT_FILE))
"""At a namespace's top, the files that describe it. A reclaim deletes these (and
``.tmp`` files), and no other file there (see :meth:`DiskStore._empty`)."""

_LEFT_NAMED = 8
"""At most this many of the names left in a namespace a reclaim could not remove are
logged (``disk_namespace_not_reclaimed``)."""

_RETAKES = 8
"""Attempts to lock one namespace whose ``lock`` file (or directory) a reclaim removes
meanwhile, before :meth:`DiskStore.__init__` gives up (each needs another reclaim)."""

FOLLOW_WAIT_S = 60.0
"""How long a rank that follows rank 0 (see the module docstring) waits for rank 0 to
take its namespace (ranks start at once, in any order), or for a reclaim to let go of
the namespace it follows into, before it takes the first free one of its own family.
Read at each start (tests change it)."""

FOLLOW_POLL_S = 0.05
"""How often a rank waiting for rank 0's namespace looks again."""

MAX_NAMESPACES = 256
"""Namespaces of one fingerprint on one ``path`` (``<digest>``, ``<digest>.1``, ...):
engines of that fingerprint running on it at once."""

_NO_FLOCK_ERRNOS = frozenset(
    getattr(errno, name) for name in ("ENOLCK", "EOPNOTSUPP", "ENOTSUP") if hasattr(errno, name)
)
"""``flock`` errors that say the file system does not lock (some network file systems)."""

_BUSY_ERRNOS = frozenset((errno.EWOULDBLOCK, errno.EAGAIN))

_held_lock = threading.RLock()
"""Guards the three below; held across a fork (see :func:`_after_fork_in_child`).
Reentrant: a store's finalizer (:func:`_release`) may run in a garbage collection that
starts inside a section holding it."""
_held: dict[tuple[str, bytes], list[Path]] = {}
"""(``path`` resolved, digest) -> the namespaces stores of this process hold locked, in
the order they were taken: where a store that attaches in this process looks first."""
_lock_fds: dict[int, object] = {}
"""The ``lock`` files' descriptors this process has open -> a token of their opener (a
store, or a reclaim's probe): what a forked child closes. Keyed by descriptor, not by
store, so that it keeps no store alive; the token tells a closer whether the number is
still its descriptor (a child closed it, and may have reused the number since)."""
_no_flock_warned: set[str] = set()
"""The ``path`` values whose missing ``flock`` was warned about (once each)."""


class Outcome(enum.IntEnum):
    """What happened to one chunk (an int8 in the actors' result arrays)."""

    OK = 0
    """Read: loaded and verified. Write: stored."""
    ABSENT = 1
    """Read: not in the index, or the file is gone."""
    CORRUPT = 2
    """Read: failed verification; the file was deleted."""
    FOREIGN = 3
    """Read: another fingerprint's chunk; left on disk, dropped from the index."""
    IO_ERROR = 4
    """Read or write: the file system failed (EIO, ...)."""
    FULL = 5
    """Write: ``bytes_to_use`` would be exceeded."""
    NO_SPACE = 6
    """Write: the file system is full (ENOSPC, EDQUOT)."""
    DENIED = 7
    """Write: not allowed (EACCES, EPERM, EROFS)."""
    DROPPED = 8
    """Write: dropped before it started (the disk actor's write queue was full)."""
    ABORTED = 9
    """Not done: the disk actor stopped first."""
    TIMEOUT = 10
    """Read or write (a remote tier): no answer within the operation's timeout or the
    job's deadline."""
    UNAVAILABLE = 11
    """Read or write (a remote tier): not sent, the circuit breaker is open."""


_ERRNO_OUTCOME = {
    errno.ENOSPC: Outcome.NO_SPACE,
    errno.EDQUOT: Outcome.NO_SPACE,
    errno.EACCES: Outcome.DENIED,
    errno.EPERM: Outcome.DENIED,
    errno.EROFS: Outcome.DENIED,
}


_BAD_FILE_ERRNOS = frozenset(
    getattr(errno, name) for name in ("EIO", "EBADMSG", "EUCLEAN") if hasattr(errno, name)
)
"""Read errors that say the file itself cannot be read back: a media error, or the file
system's own checksum or structure check failing on it (EFSBADCRC, EFSCORRUPTED). Any
other (EMFILE, ENFILE, ENOMEM, EINTR, EAGAIN, EACCES, ...) is about the process or the
moment, not the file: deleting a good chunk for it would lose a hit for nothing."""


class FileOps:
    """The operating-system calls a :class:`DiskStore` makes, in one place: tests
    subclass it to inject faults (ENOSPC, EIO) at the ``os`` level."""

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        return os.open(path, flags, mode)

    def pwritev(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def flock(self, fd: int, operation: int) -> None:
        fcntl.flock(fd, operation)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def aligned_buffer(nbytes: int) -> npt.NDArray[np.uint8]:
    """A zeroed uint8 array of ``nbytes`` at an :data:`ALIGNMENT`-aligned address."""
    raw = np.zeros(nbytes + ALIGNMENT, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start : start + nbytes]


def _byte_view(buf: BufferLike, *, writable: bool) -> memoryview:
    view = buf.data if isinstance(buf, np.ndarray) else memoryview(buf)
    if not view.c_contiguous:
        raise ValueError("a chunk's buffer must be contiguous")
    if writable and view.readonly:
        raise ValueError("the buffer to read a chunk into is read-only")
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _advance(buffers: list[memoryview], nbytes: int) -> list[memoryview]:
    out: list[memoryview] = []
    for b in buffers:
        if nbytes >= len(b):
            nbytes -= len(b)
            continue
        out.append(b[nbytes:])
        nbytes = 0
    return out


@attrs.frozen(kw_only=True)
class ScanReport:
    """What :meth:`DiskStore.scan` found."""

    chunks: int
    bytes: int
    temp_removed: int
    """``.tmp`` files of writers that died mid-chunk (any, in a namespace the store holds
    locked; else :data:`TEMP_STALE_S` old): deleted."""
    temp_kept: int
    """Without the namespace's lock, younger ``.tmp`` files (maybe a live writer's): left
    for a later scan."""
    corrupt_removed: int
    """Chunks whose size (or, with ``verify_headers``, header) cannot be valid: deleted."""
    foreign_namespaces: int
    """Directories of other fingerprints beside ours: not read, not deleted."""
    sibling_namespaces: int
    """Other namespaces of our fingerprint beside ours (``<digest>``, ``<digest>.<n>``:
    engines of it running on ``path``, or left by earlier ones) that stay: not read, not
    deleted (the reclaimed ones not counted)."""
    reclaimed_namespaces: int
    """Other namespaces of our fingerprint nobody held and idle for
    :data:`STALE_NAMESPACE_S` (left by engines that no longer run): deleted, files and
    directory (only by a store holding its own namespace locked). One emptied but not
    removed (a file no store makes in it, a delete that failed) is not counted here but
    in ``sibling_namespaces`` (``disk_namespace_not_reclaimed`` in the log)."""
    reclaimed_bytes: int
    """The chunk and ``.tmp`` files' bytes those reclaims deleted (with those of a
    reclaim the scan's budget stopped midway: the rest at a later start)."""
    foreign_chunks: int
    """With ``verify_headers``: chunks under our name written by another fingerprint
    (left on disk, not indexed)."""
    ignored: int
    """Files that are not chunk files (other names): left alone."""
    complete: bool
    """False when the scan stopped at its budget (see :meth:`DiskStore.scan`)."""
    seconds: float


@attrs.frozen(kw_only=True)
class DiskStatistics:
    """A snapshot of a :class:`DiskStore`'s counters."""

    chunks: int
    used_bytes: int
    capacity_bytes: int
    direct_io: bool
    writes: int
    bytes_written: int
    reads: int
    bytes_read: int
    absent: int
    corrupt: int
    corrupt_by_check: tuple[tuple[str, int], ...]
    foreign: int
    read_errors: int
    writes_skipped: int
    writes_skipped_by_outcome: tuple[tuple[str, int], ...]
    deleted: int


FsyncPolicy = Literal["never", "always"]

BufferLike: TypeAlias = Buffer | npt.NDArray[Any]
"""A contiguous buffer: bytes, a memoryview, a numpy array (a host pool slot's rows)."""


class DiskStore:
    """A directory of chunk files for one engine (one :class:`Fingerprint`).

    ``tier_index`` is the tier's place in the configuration: errors about ``path`` and
    ``bytes_to_use`` name the keys ``tiers[i].path`` and ``tiers[i].bytes_to_use``
    (:class:`~kvferry.ConfigError`). ``direct``: None probes O_DIRECT, False never uses
    it, True requires it. ``ops`` replaces the operating-system calls (tests).

    The namespace (see the module docstring): the first of ``<digest>``, ``<digest>.1``,
    ... that the store can lock, held until :meth:`close` (or until the store is garbage
    collected, or its process ends), its ``lock`` file reading ``owner`` (who holds it:
    the connector writes its engine's identity, shared by its scheduler and workers).
    ``attach=True`` takes no lock and uses the namespace another store took for the
    same fingerprint (the scheduler side scanning its workers' files): the one whose
    ``lock`` reads ``owner``, else the one a store of this process took last, else
    ``<digest>``. :attr:`locked` says whether the store holds its namespace's lock.

    ``leader``: the fingerprint of the engine's rank 0 (on the other ranks of an engine of
    several; with a non-empty ``owner``): the store takes the sibling index rank 0's store
    took, waiting for it up to :data:`FOLLOW_WAIT_S` (see the module docstring). ``clock``
    (monotonic seconds) and ``sleep`` time that wait (tests: no real sleep); ``clock``
    also times when the ``lock`` file is touched again (:data:`LOCK_REFRESH_S`).

    The index is empty until :meth:`scan` (call it once at start, off the event loop).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        bytes_to_use: int,
        fingerprint: Fingerprint,
        *,
        tier_index: int = 0,
        fsync: FsyncPolicy = "never",
        direct: bool | None = None,
        ops: FileOps | None = None,
        owner: str = "",
        attach: bool = False,
        leader: Fingerprint | None = None,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], object] | None = None,
    ) -> None:
        path_key = f"tiers[{tier_index}].path"
        size_key = f"tiers[{tier_index}].bytes_to_use"
        if isinstance(bytes_to_use, bool) or not isinstance(bytes_to_use, int):
            raise ConfigError(size_key, f"must be a whole number of bytes, got {bytes_to_use!r}")
        if bytes_to_use < file_size(1):
            raise ConfigError(
                size_key, f"must hold at least one chunk ({file_size(1)} bytes), got {bytes_to_use}"
            )
        if fsync not in ("never", "always"):
            raise ConfigError(f"tiers[{tier_index}].fsync", f"'never' or 'always', got {fsync!r}")
        self.fingerprint = fingerprint
        self.capacity_bytes = bytes_to_use
        self.fsync: FsyncPolicy = fsync
        self._ops = ops or FileOps()
        self._log = get_logger("kvferry.tiers", tier=tier_index)
        self.root = Path(os.fspath(path))
        self.owner = owner
        self._leader = (
            leader if leader is not None and owner and leader.digest != fingerprint.digest else None
        )
        """Rank 0's fingerprint, whose index this store takes; None: the first free."""
        self._clock = clock
        self._sleep = sleep
        self._lock_fd: int | None = None
        self._lock_token: object = None
        self._touched = self._now()
        """When (``clock``) the ``lock`` file was last touched: :meth:`_keep_fresh`."""
        self._release: Callable[[], object] = lambda: None
        if attach:
            self.namespace = self._attached_namespace()
        else:
            self.namespace = self._take_namespace(path_key)
        try:
            self._prepare(path_key, size_key, direct)
        except BaseException:
            # Never returned, the store cannot be closed: its lock would stay held while
            # the error lives (its traceback holds the store), the next store of the
            # fingerprint taking another namespace.
            self.close()
            raise

        self._lock = threading.Lock()
        self._index: dict[bytes, int] = {}
        self._used = 0
        self._reserved = 0
        self._temp_names = itertools.count()
        self._local = threading.local()
        self._logged: set[str] = set()
        self._counts: dict[str, int] = dict.fromkeys(
            (
                "writes",
                "bytes_written",
                "reads",
                "bytes_read",
                "absent",
                "foreign",
                "read_errors",
                "deleted",
            ),
            0,
        )
        self._corrupt: dict[str, int] = {}
        self._skipped: dict[str, int] = {}

    # ---------------------------------------------------------------- start

    def _prepare(self, path_key: str, size_key: str, direct: bool | None) -> None:
        """Make the namespace taken ready: its directory, the size and O_DIRECT checks,
        its description and its fan directories (a :class:`ConfigError` if it cannot)."""
        try:
            self.namespace.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(path_key, f"cannot create {self.namespace}: {exc}") from exc
        total = os.statvfs(self.namespace)
        fs_bytes = total.f_frsize * total.f_blocks
        if self.capacity_bytes > fs_bytes:
            raise ConfigError(
                size_key,
                f"{self.capacity_bytes} bytes asked, but the file system holds {fs_bytes}",
            )
        self.direct_io = self._probe(path_key, direct)
        self._write_description(path_key)
        self._make_fan_directories(path_key)

    def _namespaces(self) -> tuple[Path, str]:
        """The directory of the namespaces and the base name, ``<digest hex>``."""
        return self.root / f"kvferry-v{FORMAT_VERSION}", self.fingerprint.digest.hex()

    @property
    def locked(self) -> bool:
        """Whether this store holds its namespace's lock (see the class docstring): False
        once closed, and in a child forked since (its copy of the descriptor closed)."""
        return self._lock_fd is not None and _lock_fds.get(self._lock_fd) is self._lock_token

    def _take_namespace(self, path_key: str) -> Path:
        """The namespace this store holds from now on: the index rank 0 took (with a
        ``leader``: :meth:`_follow`), else the first free one (:meth:`_take_first_free`)."""
        if self._leader is None:
            return self._take_first_free(path_key)
        followed = self._follow(path_key)
        if isinstance(followed, Path):
            return followed
        namespace = self._take_first_free(path_key)
        if followed is not None:
            self._log.warning(
                "disk_namespace_not_followed",
                path=str(namespace),
                **followed,
                note="this rank took another index than rank 0: chunks earlier engines "
                "left in the two namespaces are kept only where both hold them",
            )
        return namespace

    def _take_first_free(self, path_key: str) -> Path:
        """The first namespace of the fingerprint whose lock this store can hold, made if
        missing; ``<digest>`` unlocked where the file system has no ``flock``."""
        parent, base = self._namespaces()
        for n in range(MAX_NAMESPACES):
            namespace = _sibling(parent, base, n)
            got = self._try_take(namespace, path_key)
            if got is False:
                continue  # another engine's (or being reclaimed): the next one
            if got is True:
                if n:
                    self._log.info(
                        "disk_namespace_taken",
                        path=str(namespace),
                        note="the ones before it are held by other engines of this fingerprint",
                    )
                return namespace
            self._not_locked(namespace, got)
            return namespace
        raise ConfigError(
            path_key,
            f"{MAX_NAMESPACES} engines of this fingerprint already hold namespaces under "
            f"{parent} (the first is {base})",
        )

    def _try_take(self, namespace: Path, path_key: str) -> bool | OSError:
        """Lock ``namespace`` (made if missing) and hold it: True; False when another
        store holds it (or a reclaim does); the error where the file system has no
        ``flock`` (the ``lock`` file then names ``owner``, unlocked).

        A ``lock`` file opened just before a reclaim removed it (see :meth:`_reclaim`)
        can be locked once the reclaim let it go: an unlinked inode, which another store
        would not see held (it makes a new ``lock``), so two would share the namespace.
        Hence, once locked, the file at the path must still be the one locked; if not,
        or if the directory went between its ``mkdir`` and the ``open``, again."""
        lock_path = namespace / LOCK_FILE
        for _ in range(_RETAKES):
            try:
                namespace.mkdir(parents=True, exist_ok=True)
                fd, token = _open_lock(lock_path, create=True)
            except FileNotFoundError:
                continue  # reclaimed meanwhile: made again
            except OSError as exc:
                raise ConfigError(path_key, f"cannot create {namespace}: {exc}") from exc
            try:
                self._ops.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in _BUSY_ERRNOS:
                    _close_lock(fd, token)
                    return False
                if exc.errno not in _NO_FLOCK_ERRNOS:
                    _close_lock(fd, token)
                    raise ConfigError(path_key, f"cannot lock {namespace}: {exc}") from exc
                self._write_owner(fd)
                _close_lock(fd, token)
                return exc
            if _is_at(fd, lock_path):
                self._hold(namespace, fd, token)
                return True
            _close_lock(fd, token)  # a reclaim removed the file locked: a new one
        raise ConfigError(
            path_key,
            f"cannot lock {namespace}: its lock file was removed {_RETAKES} times "
            "while this store took it",
        )

    def _not_locked(self, namespace: Path, exc: OSError) -> None:
        with _held_lock:
            first = str(self.root) not in _no_flock_warned
            _no_flock_warned.add(str(self.root))
        (self._log.warning if first else self._log.debug)(
            "disk_namespace_not_locked",
            path=str(namespace),
            error=repr(exc),
            note="the file system has no flock: engines of one fingerprint on "
            "this path share this namespace (and each other's chunks); "
            "logged once",
        )

    def _follow(self, path_key: str) -> Path | dict[str, Any] | None:
        """Take the index rank 0 (``leader``) took: the namespace held, or why not (the
        warning's fields), or None where the file system has no ``flock`` (nothing to
        follow: every rank uses its ``<digest>``).

        Rank 0's namespace is the one of its family whose ``lock`` names ``owner`` (rank 0
        writes it once it holds the ``flock``, and empties it when it lets go). Until it
        is found (rank 0 may start later), and while ours of that index is held by a
        store whose ``lock`` file looks stale (a reclaim holds it, and removes it when
        done), this waits, up to :data:`FOLLOW_WAIT_S`; ours held by a live engine (its
        ``lock`` file touched within :data:`STALE_NAMESPACE_S`), not at all."""
        assert self._leader is not None
        parent, base = self._namespaces()
        lead = self._leader.digest.hex()
        if not self._flock_works(parent, path_key):
            return None
        clock = self._clock or time.monotonic
        sleep = self._sleep or time.sleep
        start = clock()
        deadline = start + FOLLOW_WAIT_S
        while True:
            n = _owned_index(parent, lead, self.owner)
            now = clock()
            if n is not None:
                namespace = _sibling(parent, base, n)
                got = self._try_take(namespace, path_key)
                if got is True:
                    (self._log.info if n or now > start else self._log.debug)(
                        "disk_namespace_followed",
                        path=str(namespace),
                        leader=str(_sibling(parent, lead, n)),
                        waited_s=round(now - start, 3),
                    )
                    return namespace
                if not isinstance(got, bool):
                    return None  # no flock here after all (the directory took one)
                if now >= deadline or not _may_be_reclaimed(namespace / LOCK_FILE):
                    return {
                        "leader": str(_sibling(parent, lead, n)),
                        "wanted": str(namespace),
                        "reason": "held by another engine",
                        "waited_s": round(now - start, 3),
                    }
            elif now >= deadline:
                return {
                    "leader": str(parent / lead),
                    "reason": f"rank 0 took no namespace of its family naming {self.owner!r}",
                    "waited_s": round(now - start, 3),
                }
            sleep(FOLLOW_POLL_S)

    def _flock_works(self, parent: Path, path_key: str) -> bool:
        """Whether the file system under ``parent`` (made if missing) takes ``flock``: a
        shared lock on the directory itself, let go at once (nobody takes it exclusive,
        so no other store is disturbed). An unexpected error: True (the take says)."""
        try:
            parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise ConfigError(path_key, f"cannot create {parent}: {exc}") from exc
        try:
            self._ops.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            return exc.errno not in _NO_FLOCK_ERRNOS
        finally:
            os.close(fd)
        return True

    def _hold(self, namespace: Path, fd: int, token: object) -> None:
        """Keep ``namespace``'s lock (``fd``, locked) until :meth:`close`."""
        self._write_owner(fd)
        _touch(fd)  # taken now: not stale (see STALE_NAMESPACE_S)
        self._touched = self._now()
        self._lock_fd, self._lock_token = fd, token
        key = (os.path.realpath(self.root), self.fingerprint.digest)
        with _held_lock:
            _held.setdefault(key, []).append(namespace)
        self._release = weakref.finalize(self, _release, fd, token, key, namespace)

    def _now(self) -> float:
        return (self._clock or time.monotonic)()

    def _keep_fresh(self) -> None:
        """At a read or write: touch the ``lock`` file of the namespace held again once
        :data:`LOCK_REFRESH_S` passed since it was last (a live engine's stays fresh: see
        there). One clock read per call; the ``lock`` file's descriptor is touched only
        while still this store's (under ``_held_lock``: not closed meanwhile, nor a
        forked child's copy, closed at the fork)."""
        now = self._now()
        if now - self._touched < LOCK_REFRESH_S:
            return
        self._touched = now
        with _held_lock:
            fd = self._lock_fd
            if fd is not None and _lock_fds.get(fd) is self._lock_token:
                _touch(fd)

    def _write_owner(self, fd: int) -> None:
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (self.owner + "\n").encode(), 0)
        except OSError:
            pass  # only an attaching scan reads it, and falls back without it

    def _attached_namespace(self) -> Path:
        """The namespace a store holding the lock took (see the class docstring)."""
        parent, base = self._namespaces()
        if self.owner:
            n = _owned_index(parent, base, self.owner)
            if n is not None:
                return _sibling(parent, base, n)
        with _held_lock:
            mine = _held.get((os.path.realpath(self.root), self.fingerprint.digest))
            if mine:
                return mine[-1]
        return parent / base

    def close(self) -> None:
        """Let the namespace go (its lock): the next engine of this fingerprint may take
        it, and finds its chunks. Call once no I/O runs any more; idempotent."""
        self._release()
        self._lock_fd = None

    def _probe(self, path_key: str, direct: bool | None) -> bool:
        """Whether O_DIRECT works here; a :class:`ConfigError` if nothing can be written."""
        probe = str(self.namespace / f".probe.{os.getpid()}{_TEMP_SUFFIX}")
        want_direct = direct is not False and _O_DIRECT != 0
        block = aligned_buffer(ALIGNMENT)
        for use_direct in (True, False) if want_direct else (False,):
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (_O_DIRECT if use_direct else 0)
            try:
                fd = self._ops.open(probe, flags)
                try:
                    self._ops.pwritev(fd, [block.data], 0)
                finally:
                    self._ops.close(fd)
            except OSError as exc:
                if use_direct and exc.errno == errno.EINVAL:
                    continue  # the file system does not take O_DIRECT
                raise ConfigError(path_key, f"cannot write in {self.namespace}: {exc}") from exc
            finally:
                try:
                    os.unlink(probe)
                except OSError:
                    pass
            if direct is True and not use_direct:
                raise ConfigError(path_key, f"{self.root} does not take O_DIRECT")
            return use_direct
        if direct is True:
            raise ConfigError(path_key, f"{self.root} does not take O_DIRECT")
        return False

    def _make_fan_directories(self, path_key: str) -> None:
        have = {e.name for e in os.scandir(self.namespace)}
        for i in range(16**FANOUT_HEX_DIGITS):
            name = f"{i:0{FANOUT_HEX_DIGITS}x}"
            if name in have:
                continue
            try:
                os.mkdir(self.namespace / name)
            except FileExistsError:
                pass  # another process sharing the namespace made it meanwhile
            except OSError as exc:
                raise ConfigError(
                    path_key, f"cannot create directories in {self.namespace}: {exc}"
                ) from exc

    def _write_description(self, path_key: str) -> None:
        target = self.namespace / FINGERPRINT_FILE
        if target.exists():
            return
        tmp = self.namespace / f"fingerprint.json.{os.getpid()}{_TEMP_SUFFIX}"
        try:
            tmp.write_bytes(self.fingerprint.canonical())
            os.replace(tmp, target)
        except OSError as exc:
            raise ConfigError(path_key, f"cannot write in {self.namespace}: {exc}") from exc

    def scan(
        self,
        *,
        budget_s: float = 60.0,
        max_entries: int = 10_000_000,
        verify_headers: bool = False,
    ) -> ScanReport:
        """Rebuild the index from the files (warm restart); call once, at start.

        Bounded: it stops after ``budget_s`` seconds or ``max_entries`` directory
        entries, whichever comes first, and says so (``complete=False``, a warning in the
        log); the files it did not reach stay on disk, unindexed and unaccounted, until a
        later scan (they are never loaded). A ``disk_scan_progress`` line is logged at
        most every :data:`SCAN_PROGRESS_EVERY_S` seconds, then ``disk_scan_finished``.

        By default it trusts file names and sizes (a ``stat`` per file, no read): every
        read verifies the chunk anyway. ``verify_headers`` also reads each header (one
        aligned block per file), deletes chunks that fail and skips other fingerprints'.

        Then, in the budget's time left, a store holding its namespace locked reclaims
        the other namespaces of its fingerprint nobody holds and idle for
        :data:`STALE_NAMESPACE_S` (see :meth:`_reclaim`; ``disk_namespaces_reclaimed``).
        """
        start = time.monotonic()
        last_progress = start
        entries = 0
        temp = temp_kept = corrupt = foreign = ignored = 0
        # No other writer can be in a namespace held locked: every .tmp is a dead one's.
        stale_before = float("inf") if self.locked else time.time() - TEMP_STALE_S
        complete = True
        index: dict[bytes, int] = {}
        self._log.info("disk_scan_started", path=str(self.namespace), budget_s=budget_s)
        parent, base = self._namespaces()
        own = self.namespace.name
        others = [
            e.name for e in os.scandir(parent) if e.is_dir(follow_symlinks=False) and e.name != own
        ]
        siblings = sorted(name for name in others if _sibling_index(name, base) is not None)
        foreign_namespaces = len(others) - len(siblings)
        for fan, entry in self._entries():
            entries += 1
            now = time.monotonic()
            if now - start > budget_s or entries > max_entries:
                complete = False
                break
            if now - last_progress >= SCAN_PROGRESS_EVERY_S:
                last_progress = now
                self._log.info(
                    "disk_scan_progress",
                    entries=entries,
                    chunks=len(index),
                    seconds=round(now - start, 1),
                )
            name = entry.name
            if name.endswith(_TEMP_SUFFIX):
                try:
                    stale = entry.stat(follow_symlinks=False).st_mtime < stale_before
                except OSError:
                    continue  # gone meanwhile: its writer renamed it
                if stale:
                    self._unlink(entry.path)
                    temp += 1
                else:
                    temp_kept += 1
                continue
            key = self._key_of(fan, name)
            if key is None:
                ignored += 1
                continue
            try:
                size = entry.stat(follow_symlinks=False).st_size
            except OSError:
                continue  # gone meanwhile
            if size < file_size(1) or size % ALIGNMENT:
                self._unlink(entry.path)
                corrupt += 1
                continue
            if verify_headers:
                try:
                    self._verify_header(entry.path, key, size)
                except ChunkForeign:
                    foreign += 1
                    continue
                except ChunkCorrupt:
                    self._unlink(entry.path)
                    corrupt += 1
                    continue
                except OSError:
                    continue
            index[key] = size
        with self._lock:
            self._index = index
            self._used = sum(index.values())
        reclaimed: list[str] = []
        reclaimed_bytes = 0
        if self.locked and siblings and complete:
            reclaimed, reclaimed_bytes = self._reclaim(siblings, deadline=start + budget_s)
        report = ScanReport(
            chunks=len(index),
            bytes=self._used,
            temp_removed=temp,
            temp_kept=temp_kept,
            corrupt_removed=corrupt,
            foreign_namespaces=foreign_namespaces,
            sibling_namespaces=len(siblings) - len(reclaimed),
            reclaimed_namespaces=len(reclaimed),
            reclaimed_bytes=reclaimed_bytes,
            foreign_chunks=foreign,
            ignored=ignored,
            complete=complete,
            seconds=time.monotonic() - start,
        )
        log = self._log.info if complete else self._log.warning
        log("disk_scan_finished", **attrs.asdict(report))
        if self._used > self.capacity_bytes:
            self._log.warning(
                "disk_tier_over_capacity", used=self._used, capacity=self.capacity_bytes
            )
        return report

    def _reclaim(self, names: list[str], *, deadline: float) -> tuple[list[str], int]:
        """Delete the namespaces among ``names`` (our fingerprint's, not ours) that nobody
        holds and that are stale (:meth:`_stale`); the names fully reclaimed, and the
        bytes of the chunk and ``.tmp`` files deleted. Stops at ``deadline`` (monotonic).

        Each under its ``flock``, taken here (non-blocking: a namespace held is a running
        engine's, and stays) once it looks stale unlocked: no store takes it meanwhile.
        One in use is never locked, not even to judge it: a store taking it at that
        moment would find it held and take another (the chunks here orphaned; a rank
        following rank 0, seeing its ``lock`` file fresh, would not follow). Its files go
        first, then its ``lock`` file and its directory, and the ``flock`` last: a store
        that opened the ``lock`` file before it went may lock it afterwards, an unlinked
        file, and sees that (:meth:`_take_namespace`). A namespace with no ``lock`` file
        (a store taking it made the directory a moment ago; no ``flock`` here) is not
        judged. A store that follows rank 0 keeps one whose index rank 0 took lately
        (:meth:`_followed_soon`). One that cannot be removed whole (a file not the
        store's in it, a removal that failed) keeps a ``lock`` file (:meth:`_remove`), so
        that later scans judge it again, is not counted, and is logged
        (``disk_namespace_not_reclaimed``, once a scan)."""
        reclaimed: list[str] = []
        nbytes = 0
        complete = True
        parent = self._namespaces()[0]
        for name in names:
            if time.monotonic() > deadline:
                complete = False
                break
            namespace = parent / name
            lock_path = namespace / LOCK_FILE
            if self._stale(None, namespace, lock_path) is None or self._followed_soon(name):
                continue  # in use lately (or gone): not locked, not even to judge it
            try:
                fd, token = _open_lock(lock_path, create=False)
            except OSError:
                continue
            try:
                try:
                    self._ops.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # a running engine's (or no flock: nothing to tell by)
                last = self._stale(fd, namespace, lock_path)
                if last is None or self._followed_soon(name):
                    continue
                try:
                    deleted, complete, error = self._empty(namespace, last, deadline)
                except OSError:
                    continue  # cannot list it: left as it is
                nbytes += deleted
                if not complete:
                    break  # the rest at a later start: still stale (see _empty)
                removed = self._remove(namespace, lock_path, last)
                if removed is True:
                    reclaimed.append(name)
                elif removed is not False:
                    self._log.warning(
                        "disk_namespace_not_reclaimed",
                        path=str(namespace),
                        error=repr(error or removed["error"]),
                        left=removed["left"],
                        note="stale, emptied of this store's files, but not removed: "
                        "what is left is not this store's, or could not be deleted; "
                        "judged again at the next start",
                    )
            finally:
                _close_lock(fd, token)
        if reclaimed or nbytes:
            self._log.info(
                "disk_namespaces_reclaimed",
                namespaces=reclaimed,
                bytes=nbytes,
                complete=complete,
                stale_after_s=STALE_NAMESPACE_S,
                note="namespaces of this fingerprint nobody held, idle for stale_after_s: "
                "left by engines that no longer run on this path",
            )
        return reclaimed, nbytes

    def _followed_soon(self, name: str) -> bool:
        """For a store that follows rank 0 (``leader``): whether rank 0's namespace of the
        index of ``name`` (ours) was taken, let go or used within :data:`STALE_NAMESPACE_S`
        (its ``lock`` file's mtime): that engine's rank of ours may be about to take
        ``name``, and find the chunks left there beside rank 0's."""
        if self._leader is None:
            return False
        parent, base = self._namespaces()
        n = _sibling_index(name, base)
        if n is None:
            return False
        return _lock_fresh(_sibling(parent, self._leader.digest.hex(), n) / LOCK_FILE)

    @staticmethod
    def _stale(fd: int | None, namespace: Path, lock_path: Path) -> float | None:
        """The newest of the ``lock`` file's (``fd``, locked) and the fan directories'
        mtimes, if it is :data:`STALE_NAMESPACE_S` old and the file at ``lock_path`` is
        still ``fd``'s (not reclaimed by another store meanwhile); else None. ``fd``
        None: the file at ``lock_path``, not locked (a first look)."""
        if fd is not None and not _is_at(fd, lock_path):
            return None
        try:
            times = [
                os.fstat(fd).st_mtime
                if fd is not None
                else os.stat(lock_path, follow_symlinks=False).st_mtime
            ]
            with os.scandir(namespace) as top:
                for entry in top:
                    if entry.is_dir(follow_symlinks=False):
                        times.append(entry.stat(follow_symlinks=False).st_mtime)
        except OSError:
            return None
        last = max(times)
        return last if last < time.time() - STALE_NAMESPACE_S else None

    def _empty(
        self, namespace: Path, last: float, deadline: float
    ) -> tuple[int, bool, OSError | None]:
        """Delete a stale namespace's files (its ``lock`` file aside): in the fan
        directories, the chunk files (names the scan indexes: :meth:`_key_of`) and
        ``.tmp`` files, then those directories; at its top, its descriptions
        (:data:`_DESCRIPTIONS`) and ``.tmp`` files (theirs, the O_DIRECT probe's). Only
        what a store makes: files of other names (another ``.kvc``, another ``.json``),
        and other directories, stay (then so does the namespace's directory). The bytes
        of the chunk and ``.tmp`` files deleted, whether all was done before
        ``deadline``, and the first error deleting one of them (it stays too); a fan
        directory left behind gets its mtime ``last`` back (the deletes changed it), so
        the namespace stays stale."""
        nbytes = 0
        error: OSError | None = None
        with os.scandir(namespace) as top:
            entries = list(top)
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                if len(entry.name) != FANOUT_HEX_DIGITS:
                    continue
                done = True
                try:
                    with os.scandir(entry.path) as it:
                        files = list(it)
                except OSError as exc:
                    files, error = [], error or exc
                for file in files:
                    if time.monotonic() > deadline:
                        done = False
                        break
                    if not (
                        file.name.endswith(_TEMP_SUFFIX)
                        or self._key_of(entry.name, file.name) is not None
                    ):
                        continue  # not a store's file: left alone, as the scan does
                    try:
                        size = file.stat(follow_symlinks=False).st_size
                        self._ops.unlink(file.path)
                    except FileNotFoundError:
                        continue
                    except OSError as exc:
                        error = error or exc
                        continue
                    nbytes += size
                try:
                    os.rmdir(entry.path)
                except OSError:
                    try:
                        os.utime(entry.path, (last, last))
                    except OSError:
                        pass
                if not done:
                    return nbytes, False, error
            elif entry.name in _DESCRIPTIONS or entry.name.endswith(_TEMP_SUFFIX):
                try:
                    os.unlink(entry.path)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    error = error or exc
        return nbytes, True, error

    def _remove(self, namespace: Path, lock_path: Path, last: float) -> bool | dict[str, Any]:
        """Remove an emptied namespace (:meth:`_empty`; its ``flock`` held here): its
        ``lock`` file, then its directory. True once removed; False where a store made a
        ``lock`` file in it again meanwhile (it takes the namespace: in use now); else
        the warning's fields (the error, what is left), the namespace left as later
        scans judge it again: with a ``lock`` file as old as it was.

        A namespace without a ``lock`` file is never judged (:meth:`_stale`): were the
        file removed while anything else stays, that would stay forever. So it goes only
        once nothing else is left; and where the directory cannot be removed after it
        (a file made there meanwhile, an error), a new one is made with the old mtime
        (:func:`_restore_lock`)."""
        try:
            left = _left_in(namespace)
        except OSError as exc:
            return {"error": exc, "left": []}
        if left:
            full = OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY), str(namespace))
            return {"error": full, "left": left}
        try:
            self._ops.unlink(str(lock_path))
        except OSError as exc:
            return {"error": exc, "left": [LOCK_FILE]}
        try:
            os.rmdir(namespace)
        except OSError as exc:
            if not _restore_lock(lock_path, last):
                return False
            try:
                left = _left_in(namespace)
            except OSError:
                left = []
            return {"error": exc, "left": left}
        return True

    def _entries(self) -> Iterator[tuple[str, os.DirEntry[str]]]:
        for fan in sorted(os.scandir(self.namespace), key=lambda e: e.name):
            if not fan.is_dir(follow_symlinks=False) or len(fan.name) != FANOUT_HEX_DIGITS:
                continue
            with os.scandir(fan.path) as it:
                for entry in it:
                    yield fan.name, entry

    @staticmethod
    def _key_of(fan: str, name: str) -> bytes | None:
        if not name.endswith(_SUFFIX):
            return None
        try:
            key = bytes.fromhex(name[: -len(_SUFFIX)])
        except ValueError:
            return None
        if not 0 < len(key) <= MAX_KEY_BYTES or _fan(key) != fan:
            return None
        return key

    def _verify_header(self, path: str, key: bytes, size: int) -> None:
        header = self._thread_buffers()[0]
        fd = self._ops.open(path, os.O_RDONLY | (_O_DIRECT if self.direct_io else 0))
        try:
            got = self._ops.preadv(fd, [header], 0)
        finally:
            self._ops.close(fd)
        if got < HEADER_SIZE:
            raise ChunkCorrupt("length", f"{got} header bytes")
        decoded = decode_header(header, fingerprint=self.fingerprint.digest, key=key)
        if file_size(decoded.payload_length) != size:
            raise ChunkCorrupt("length", f"file of {size} bytes for {decoded.payload_length}")

    # ---------------------------------------------------------------- I/O

    def path_of(self, key: bytes) -> Path:
        """Where ``key``'s chunk lives (whether or not it is there)."""
        return self.namespace / _fan(key) / (key.hex() + _SUFFIX)

    def _thread_buffers(self) -> tuple[memoryview, memoryview]:
        """This thread's aligned header block and tail block."""
        bufs: tuple[memoryview, memoryview] | None = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = (aligned_buffer(HEADER_SIZE).data, aligned_buffer(ALIGNMENT).data)
            self._local.bufs = bufs
        return bufs

    def _bounce(self, nbytes: int) -> memoryview:
        bounce: memoryview | None = getattr(self._local, "bounce", None)
        if bounce is None or len(bounce) < nbytes:
            bounce = aligned_buffer(nbytes).data
            self._local.bounce = bounce
        return bounce[:nbytes]

    def _segments(self, body: memoryview) -> tuple[list[memoryview], memoryview | None, int]:
        """The aligned buffers that carry ``body`` padded to the alignment: in place where
        it can be, else through this thread's bounce memory, which stands for
        ``body[start:]`` (bounce None: all in place)."""
        n = len(body)
        if _address(body) % ALIGNMENT:
            bounce = self._bounce(padded(n))
            return [bounce], bounce, 0
        whole = n - n % ALIGNMENT
        if whole == n:
            return [body], None, n
        tail = self._thread_buffers()[1]
        return ([body[:whole], tail] if whole else [tail]), tail, whole

    def write(self, key: bytes, payload: BufferLike) -> Outcome:
        """Store ``payload`` (a contiguous buffer) as ``key``'s chunk; replaces any.

        Returns :attr:`Outcome.OK`, or the reason it was skipped (never raises for a
        file-system failure): ``FULL`` (``bytes_to_use``), ``NO_SPACE``, ``DENIED``,
        ``IO_ERROR``. A skipped store is only a future miss.
        """
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"a key is 1 to {MAX_KEY_BYTES} bytes, got {len(key)}")
        body = _byte_view(payload, writable=False)
        n = len(body)
        if n == 0:
            raise ValueError("an empty chunk")
        size = file_size(n)
        with self._lock:
            if self._used + self._reserved + size > self.capacity_bytes:
                self._skip(Outcome.FULL, None)
                return Outcome.FULL
            self._reserved += size
        final = self.path_of(key)
        tmp = f"{final.parent}/{key.hex()}.{os.getpid()}.{next(self._temp_names)}{_TEMP_SUFFIX}"
        renamed = False
        try:
            header = self._thread_buffers()[0]
            header[:] = ChunkHeader(
                fingerprint=self.fingerprint.digest,
                key=key,
                payload_length=n,
                payload_checksum=payload_checksum(body),
            ).encode()
            segments, bounce, start = self._segments(body)
            if bounce is not None:
                bounce[: n - start] = body[start:]
                bounce[n - start :] = bytes(len(bounce) - (n - start))
            self._write_file(tmp, [header, *segments])
            self._ops.rename(tmp, str(final))
            renamed = True
            if self.fsync == "always":
                self._ops.fsync_dir(str(final.parent))
        except OSError as exc:
            if renamed:
                # The chunk is complete under its final name (over any earlier chunk of
                # the key), but not durable: a file the index does not hold would be
                # neither counted nor ever deleted, so it goes, with the key.
                self._forget(key, None)
                self._unlink(str(final))
            else:
                self._unlink(tmp)
            outcome = _ERRNO_OUTCOME.get(exc.errno or 0, Outcome.IO_ERROR)
            with self._lock:
                self._reserved -= size
                self._skip(outcome, exc)
            return outcome
        with self._lock:
            self._reserved -= size
            self._used += size - self._index.get(key, 0)
            self._index[key] = size
            self._counts["writes"] += 1
            self._counts["bytes_written"] += n
        self._keep_fresh()
        return Outcome.OK

    def _write_file(self, tmp: str, buffers: list[memoryview]) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (_O_DIRECT if self.direct_io else 0)
        try:
            fd = self._ops.open(tmp, flags)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(tmp), exist_ok=True)
            fd = self._ops.open(tmp, flags)
        try:
            offset = 0
            while buffers:
                done = self._ops.pwritev(fd, buffers, offset)
                if done <= 0:
                    raise OSError(errno.EIO, "a write made no progress")
                offset += done
                buffers = _advance(buffers, done)
            if self.fsync == "always":
                self._ops.fdatasync(fd)
        finally:
            self._ops.close(fd)

    def read(self, key: bytes, into: BufferLike) -> Outcome:
        """Load ``key``'s chunk into ``into`` (writable, contiguous, exactly the chunk's
        length) and verify it: :attr:`Outcome.OK` only when the header (magic, version,
        fingerprint, key, length) and the payload's checksum all match.

        Otherwise a miss: ``ABSENT``; ``CORRUPT`` (counted by check, the file deleted);
        ``FOREIGN`` (another fingerprint: counted, left on disk); ``IO_ERROR`` (the file
        deleted only for an error that says it is bad: EIO, EBADMSG, EUCLEAN; kept for a
        transient one such as EMFILE or ENOMEM). After a miss ``into`` holds nothing
        valid.
        """
        body = _byte_view(into, writable=True)
        n = len(body)
        with self._lock:
            if key not in self._index:
                self._counts["absent"] += 1
                return Outcome.ABSENT
        path = str(self.path_of(key))
        try:
            fd = self._ops.open(path, os.O_RDONLY | (_O_DIRECT if self.direct_io else 0))
        except FileNotFoundError:
            self._forget(key, "absent")
            return Outcome.ABSENT
        except OSError as exc:
            return self._read_failed(key, exc)
        header = self._thread_buffers()[0]
        segments, bounce, start = self._segments(body)
        try:
            try:
                got = self._read_file(fd, [header, *segments])
            finally:
                self._ops.close(fd)
        except OSError as exc:
            return self._read_failed(key, exc)
        try:
            if got < HEADER_SIZE:
                raise ChunkCorrupt("length", f"file of {got} bytes")
            decoded = decode_header(
                header, fingerprint=self.fingerprint.digest, key=key, payload_length=n
            )
            if got < file_size(n):
                raise ChunkCorrupt("length", f"file of {got} bytes, {file_size(n)} expected")
            if bounce is not None:
                body[start:] = bounce[: n - start]
            if payload_checksum(body) != decoded.payload_checksum:
                raise ChunkCorrupt("checksum", "payload bytes do not match their checksum")
        except ChunkForeign as exc:
            self._forget(key, "foreign")
            self._log_once("foreign", "disk_chunk_foreign", key=key.hex(), error=str(exc))
            return Outcome.FOREIGN
        except ChunkCorrupt as exc:
            with self._lock:
                self._corrupt[exc.field] = self._corrupt.get(exc.field, 0) + 1
            self._forget(key, None)
            self._unlink(path)
            self._log_once(
                f"corrupt:{exc.field}", "disk_chunk_corrupt", key=key.hex(), error=str(exc)
            )
            return Outcome.CORRUPT
        with self._lock:
            self._counts["reads"] += 1
            self._counts["bytes_read"] += n
        self._keep_fresh()
        return Outcome.OK

    def _read_file(self, fd: int, buffers: list[memoryview]) -> int:
        offset = 0
        while buffers:
            done = self._ops.preadv(fd, buffers, offset)
            if done <= 0:
                break  # end of file
            offset += done
            buffers = _advance(buffers, done)
            if self.direct_io and offset % ALIGNMENT:
                break  # a short direct read ends at the end of the file
        return offset

    def _read_failed(self, key: bytes, exc: OSError) -> Outcome:
        """A read the file system failed: the chunk goes only if the error says the file
        is bad; else this read is a miss and the chunk stays (file and index: a file the
        index does not hold would be neither counted nor ever deleted)."""
        if exc.errno in _BAD_FILE_ERRNOS:
            self._forget(key, "read_errors")
            self._unlink(str(self.path_of(key)))
        else:
            with self._lock:
                self._counts["read_errors"] += 1
        self._log_once(f"read:{exc.errno}", "disk_read_failed", key=key.hex(), error=repr(exc))
        return Outcome.IO_ERROR

    def delete(self, key: bytes) -> bool:
        """Remove ``key``'s chunk; False if it was not in the index."""
        if not self._forget(key, "deleted"):
            return False
        self._unlink(str(self.path_of(key)))
        return True

    def _forget(self, key: bytes, counter: str | None) -> bool:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
            if counter is not None:
                self._counts[counter] += 1
        return size is not None

    def _unlink(self, path: str) -> None:
        try:
            self._ops.unlink(path)
        except OSError:
            pass

    def _skip(self, outcome: Outcome, exc: OSError | None) -> None:
        """Count a skipped store (the caller holds the lock) and log its kind once."""
        self._skipped[outcome.name] = self._skipped.get(outcome.name, 0) + 1
        self._log_once(
            f"skip:{outcome.name}",
            "disk_store_skipped",
            reason=outcome.name,
            error=repr(exc) if exc is not None else None,
            used=self._used,
            capacity=self.capacity_bytes,
        )

    def _log_once(self, kind: str, event: str, **fields: Any) -> None:
        if kind in self._logged:
            self._log.debug(event, **fields)
            return
        self._logged.add(kind)
        self._log.warning(event, **fields, note="logged once; later ones are counted")

    # ---------------------------------------------------------------- state

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._index)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def statistics(self) -> DiskStatistics:
        with self._lock:
            c = self._counts
            return DiskStatistics(
                chunks=len(self._index),
                used_bytes=self._used,
                capacity_bytes=self.capacity_bytes,
                direct_io=self.direct_io,
                writes=c["writes"],
                bytes_written=c["bytes_written"],
                reads=c["reads"],
                bytes_read=c["bytes_read"],
                absent=c["absent"],
                corrupt=sum(self._corrupt.values()),
                corrupt_by_check=tuple(sorted(self._corrupt.items())),
                foreign=c["foreign"],
                read_errors=c["read_errors"],
                writes_skipped=sum(self._skipped.values()),
                writes_skipped_by_outcome=tuple(sorted(self._skipped.items())),
                deleted=c["deleted"],
            )


def _sibling_index(name: str, base: str) -> int | None:
    """``n`` for the namespace ``<base>.<n>`` (0 for ``<base>``); None for another name."""
    if name == base:
        return 0
    head, dot, n = name.partition(".")
    if head != base or not dot or not n.isdigit() or n != str(int(n)) or int(n) == 0:
        return None
    return int(n)


def _sibling(parent: Path, base: str, n: int) -> Path:
    """The namespace ``<base>.<n>`` (``<base>`` for 0) under ``parent``."""
    return parent / (base if n == 0 else f"{base}.{n}")


def _owned_index(parent: Path, base: str, owner: str) -> int | None:
    """The lowest ``n`` whose namespace ``<base>.<n>`` has a ``lock`` file naming
    ``owner`` (not empty: a store letting go empties it); None if none does."""
    if not owner:
        return None
    try:
        names = [e.name for e in os.scandir(parent) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return None
    for n in sorted(i for i in (_sibling_index(name, base) for name in names) if i is not None):
        try:
            held_by = (_sibling(parent, base, n) / LOCK_FILE).read_text().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if held_by == owner:
            return n
    return None


def _lock_fresh(lock_path: Path) -> bool:
    """Whether a ``lock`` file was touched (its namespace taken, let go or used by a
    store: :data:`LOCK_REFRESH_S`) within :data:`STALE_NAMESPACE_S`: False if it is gone
    (removed a moment ago by a reclaim), True if it cannot be read (cannot tell: taken as
    in use)."""
    try:
        mtime = os.stat(lock_path, follow_symlinks=False).st_mtime
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return mtime >= time.time() - STALE_NAMESPACE_S


def _may_be_reclaimed(lock_path: Path) -> bool:
    """Whether a namespace whose ``lock`` is held may be held by a reclaim (which lets it
    go soon): its ``lock`` file not fresh (:func:`_lock_fresh`; a reclaim takes only
    stale ones and touches nothing, a store taking or letting go of it touches it, and
    one holding it touches it again as it reads and writes: :data:`LOCK_REFRESH_S`)."""
    return not _lock_fresh(lock_path)


def _left_in(namespace: Path) -> list[str]:
    """What is in ``namespace`` besides its ``lock`` file (a fan directory's entries as
    ``<fan>/<name>``, or the directory's name if it is empty): the first
    :data:`_LEFT_NAMED`, sorted."""
    left: list[str] = []
    with os.scandir(namespace) as top:
        entries = sorted((e for e in top if e.name != LOCK_FILE), key=lambda e: e.name)
    for entry in entries:
        if entry.is_dir(follow_symlinks=False) and len(entry.name) == FANOUT_HEX_DIGITS:
            try:
                inside = sorted(os.listdir(entry.path))
            except OSError:
                inside = []
            left += [f"{entry.name}/{name}" for name in inside] or [entry.name]
        else:
            left.append(entry.name)
        if len(left) >= _LEFT_NAMED:
            break
    return left[:_LEFT_NAMED]


def _restore_lock(lock_path: Path, mtime: float) -> bool:
    """Make a ``lock`` file again where a reclaim removed one but not its directory,
    dated ``mtime`` (the namespace's last use: it stays as stale as it was, and a later
    scan judges it again); False if one is there already (a store taking the namespace made
    it meanwhile, and holds it or is about to). True also where it cannot be made (the
    caller logs the namespace left)."""
    try:
        fd = os.open(lock_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        return False
    except OSError:
        return True
    try:
        os.utime(fd, (mtime, mtime))
    except (OSError, NotImplementedError):
        pass  # fresh, then: judged again a day later
    finally:
        os.close(fd)
    return True


def _release(fd: int, token: object, key: tuple[str, bytes], namespace: Path) -> None:
    """Let a namespace go: its lock (closing the descriptor) and this process's record;
    nothing in a child forked since (it closed its copy at the fork)."""
    with _held_lock:
        if _lock_fds.get(fd) is not token:
            return  # a forked child's copy: closed then, the number maybe reused since
        held = _held.get(key)
        if held is not None and namespace in held:
            held.remove(namespace)
            if not held:
                del _held[key]
        try:
            os.ftruncate(fd, 0)  # it names no owner any more (still ours: nobody races)
        except OSError:
            pass
        _touch(fd)  # let go now: not stale (see STALE_NAMESPACE_S)
        del _lock_fds[fd]
        try:
            os.close(fd)
        except OSError:
            pass


def _open_lock(path: Path, *, create: bool) -> tuple[int, object]:
    """Open a ``lock`` file (made if missing with ``create``): its descriptor, recorded
    for a forked child to close, and the token that closes it (:func:`_close_lock`).
    ``O_CLOEXEC``: a child that execs closes it too (Python's default; said here)."""
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    token = object()
    with _held_lock:  # a fork waits: no child gets the descriptor unrecorded
        fd = os.open(path, flags, 0o644)
        _lock_fds[fd] = token
    return fd, token


def _close_lock(fd: int, token: object) -> None:
    """Close a descriptor :func:`_open_lock` opened (if still this process's)."""
    with _held_lock:
        if _lock_fds.get(fd) is not token:
            return
        del _lock_fds[fd]
        try:
            os.close(fd)
        except OSError:
            pass


def _is_at(fd: int, path: Path) -> bool:
    """Whether ``fd`` is the file at ``path`` (not one a reclaim unlinked since)."""
    try:
        at = os.stat(path, follow_symlinks=False)
        st = os.fstat(fd)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell: as before reclaims (no reclaim runs where stat fails)
    return (at.st_dev, at.st_ino) == (st.st_dev, st.st_ino)


def _touch(fd: int) -> None:
    """Set a ``lock`` file's mtime to now (when its namespace was taken or let go)."""
    try:
        os.utime(fd)
    except (OSError, NotImplementedError):
        pass  # then only the writes' directories say it is in use


def _before_fork() -> None:
    _held_lock.acquire()


def _after_fork_in_parent() -> None:
    _held_lock.release()


def _after_fork_in_child() -> None:
    """In a child forked without exec: close its copies of the lock descriptors. A
    ``flock`` belongs to the open file description both share: while the child kept one,
    the namespace stayed locked after the parent's store closed or its process died.
    Closing the child's copy leaves the parent's lock as it was. The child holds no
    namespace: its stores read ``locked`` False and their finalizers close nothing."""
    for fd in list(_lock_fds):
        try:
            os.close(fd)
        except OSError:
            pass
    _lock_fds.clear()
    _held.clear()
    _held_lock.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )


def _fan(key: bytes) -> str:
    return f"{xxhash.xxh3_64_intdigest(key) >> (64 - 4 * FANOUT_HEX_DIGITS):0{FANOUT_HEX_DIGITS}x}"
