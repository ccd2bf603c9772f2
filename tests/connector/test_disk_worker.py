"""The worker half's disk tier, on a real temporary directory and the CPU copy engine:
host slots written down and read back into device blocks bit for bit, a load whose
chunks fail verification failing on the worker (never copied), write failures reported
per chunk, deletes, the layout record beside the files, and a restart that finds them.

Every disk job ends in a worker thread; :func:`drive` polls the worker as vLLM does,
once per step, until what the test waits for was reported (bounded in time; it checks
the outcome, never a timing), and checks on every report that a job's per-chunk disk
outcomes travel with its ack.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch

from kvferry import ConfigError, FerryConfig
from kvferry.testing import assert_no_thread_left
from kvferry.tiers import HEADER_SIZE, FileOps
from kvferry.transfer import CopyJob, GetStatistics, GroupBlocks

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
NUM_BLOCKS = 16
RUNTIMES = ["stepped", "thread"]


def key(i: int) -> bytes:
    """A key shaped like the scheduler's: 32 bytes of block hash, 4 of group index."""
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def new_kv(seed: int = 0, *, hnd: bool = False) -> dict[str, torch.Tensor]:
    """Per-layer KV tensors ``(2, num_blocks, 128 tokens, 2 heads, 64)``; ``hnd``: the
    same shape over heads-outer memory (another backend's layout, same row bytes)."""
    g = torch.Generator().manual_seed(seed)
    if hnd:
        return {
            n: torch.randn(2, NUM_BLOCKS, 2, 128, 64, generator=g).bfloat16().permute(0, 1, 3, 2, 4)
            for n in LAYERS
        }
    return {n: torch.randn(2, NUM_BLOCKS, 128, 2, 64, generator=g).bfloat16() for n in LAYERS}


def block_bytes(kv: dict[str, torch.Tensor], block: int) -> list[bytes]:
    return [kv[n][:, block].contiguous().view(torch.uint8).numpy().tobytes() for n in LAYERS]


@attrs.define
class Worker:
    side: Any
    kv: dict[str, torch.Tensor]

    @property
    def bpc(self) -> int:
        return int(self.side.geometry.blocks_per_chunk)

    def rows(self, slot: int) -> list[int]:
        return [slot * self.bpc + i for i in range(self.bpc)]


@attrs.define
class Seen:
    """Everything the worker reported while :func:`drive` polled it."""

    sending: set[str] = attrs.field(factory=set)
    recving: set[str] = attrs.field(factory=set)
    acks: dict[int, list[int]] = attrs.field(factory=dict)
    disk_failed: dict[int, list[int]] = attrs.field(factory=dict)
    stats: dict[str, float] = attrs.field(factory=dict)
    load_errors: set[int] = attrs.field(factory=set)


def drive(side: Any, until: Callable[[Seen], bool], seen: Seen | None = None) -> Seen:
    """Poll ``side`` once per (empty) engine step until ``until(seen)``, within 60 s."""
    seen = seen or Seen()
    deadline = time.monotonic() + 60.0
    while True:
        sending, recving = side.get_finished()
        seen.sending |= sending or set()
        seen.recving |= recving or set()
        seen.load_errors |= side.get_block_ids_with_load_errors()
        meta = side.build_worker_meta()
        if meta is not None:
            # The scheduler settles a disk job's chunks when it counts the job's acks.
            assert set(meta.disk_failed) <= set(meta.acks), meta
            for job_id, (done, failed) in meta.acks.items():
                mine = seen.acks.setdefault(job_id, [0, 0])
                mine[0] += done
                mine[1] += failed
            for job_id, counts in meta.disk_failed.items():
                assert job_id not in seen.disk_failed, f"disk outcomes of {job_id} twice"
                seen.disk_failed[job_id] = counts
            for k, v in meta.stats.items():
                seen.stats[k] = seen.stats.get(k, 0.0) + v
        if until(seen):
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(f"not reported within 60 s: {seen}")
        time.sleep(0.001)  # a back-off between polls; the condition decides, not the time


def acked(*job_ids: int) -> Callable[[Seen], bool]:
    return lambda seen: all(j in seen.acks for j in job_ids)


@pytest.fixture
def make_worker(
    make_vllm_config: Callable[..., Any], kv_cache_config: Any, tmp_path: Path
) -> Iterator[Callable[..., Worker]]:
    from kvferry.connector._worker import WorkerSide

    made: list[Any] = []

    def make(
        runtime: str = "stepped",
        *,
        ops: FileOps | None = None,
        kv: dict[str, torch.Tensor] | None = None,
        block_size: int | None = None,
        tiers: list[dict[str, Any]] | None = None,
        **tier: Any,
    ) -> Worker:
        if tiers is None:
            tier.setdefault("path", str(tmp_path / "disk"))
            tier.setdefault("bytes_to_use", 64 << 20)
            tiers = [{"kind": "disk", **tier}]
        extra: dict[str, Any] = {"cpu_bytes_to_use": 8 << 20, "runtime": runtime, "tiers": tiers}
        if block_size is not None:
            extra["block_size"] = block_size
        side = WorkerSide(
            make_vllm_config(extra), kv_cache_config, FerryConfig.from_dict(extra), disk_ops=ops
        )
        made.append(side)
        kv = kv if kv is not None else new_kv()
        side.register_kv_caches(kv)
        return Worker(side=side, kv=kv)

    yield make
    for side in made:
        if side.runtime is not None:
            side.shutdown()


def store_meta(job_id: int, blocks: list[int], rows: list[int]) -> Any:
    from kvferry.connector._metadata import JobSpec, KVFerryMetadata

    part = GroupBlocks(group=0, device_blocks=blocks, host_rows=rows)
    copy = CopyJob(job_id=job_id, direction="store", parts=(part,))
    return KVFerryMetadata(stores=[JobSpec(req_id=f"s{job_id}", copy=copy)])


def write_meta(job_id: int, keys: list[bytes], slots: list[int], deletes: list[bytes] = []) -> Any:  # noqa: B006
    from kvferry.connector._metadata import DiskChunks, DiskWriteSpec, KVFerryMetadata

    chunks = DiskChunks(keys=keys, slots=np.array(slots, dtype=np.int64))
    return KVFerryMetadata(
        disk_writes=[DiskWriteSpec(job_id=job_id, chunks=chunks)], disk_deletes=list(deletes)
    )


def load_meta(
    job_id: int,
    req_id: str,
    blocks: list[int],
    rows: list[int],
    keys: list[bytes],
    slots: list[int],
) -> Any:
    from kvferry.connector._metadata import DiskChunks, JobSpec, KVFerryMetadata

    part = GroupBlocks(group=0, device_blocks=blocks, host_rows=rows)
    copy = CopyJob(job_id=job_id, direction="load", parts=(part,))
    reads = DiskChunks(keys=keys, slots=np.array(slots, dtype=np.int64))
    return KVFerryMetadata(loads=[JobSpec(req_id=req_id, copy=copy, disk_reads=reads)])


def write_down(w: Worker, job_id: int, keys: list[bytes], slots: list[int]) -> Seen:
    """Fill ``slots`` with random bytes and write them to disk; the write's report."""
    rows = w.side.pool.rows
    g = torch.Generator().manual_seed(job_id)
    for s in slots:
        r = w.rows(s)
        rows[r[0] : r[-1] + 1] = torch.randint(0, 256, (len(r), rows.shape[1]), generator=g).to(
            torch.uint8
        )
    w.side.wait_for_save(write_meta(job_id, keys, slots))
    return drive(w.side, acked(job_id))


def slot_bytes(w: Worker, slot: int) -> bytes:
    r = w.rows(slot)
    return bytes(w.side.pool.rows[r[0] : r[-1] + 1].numpy().tobytes())


def loads_copied(w: Worker) -> int:
    """Loads submitted to the copy engine so far (in flight or ended)."""
    stats = w.side.runtime.call(w.side._refs.load.ask, GetStatistics)
    return int(stats.in_flight + stats.done + stats.failed)


# -- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("block_size", [None, 256], ids=["chunk=1 block", "chunk=2 blocks"])
def test_device_blocks_go_to_disk_and_come_back_bit_for_bit(
    make_worker: Callable[..., Worker], runtime: str, block_size: int | None
) -> None:
    w = make_worker(runtime, block_size=block_size)
    side, bpc = w.side, w.bpc
    src = [3, 4, 5, 6][: 2 * bpc]  # two chunks' worth of engine blocks
    side.wait_for_save(store_meta(1, src, w.rows(0) + w.rows(1)))
    drive(side, acked(1))
    side.wait_for_save(write_meta(2, [key(0), key(1)], [0, 1]))
    wrote = drive(side, acked(2))
    assert wrote.acks[2] == [1, 0] and wrote.disk_failed[2] == [0, 0]
    assert wrote.stats["disk_write_bytes"] == 2 * bpc * side.pool.row_bytes
    assert wrote.stats["disk_writes_failed"] == 0
    assert side.disk.path_of(key(0)).exists() and side.disk.path_of(key(1)).exists()

    dst = [10, 11, 12, 13][: 2 * bpc]
    for n in LAYERS:
        w.kv[n][:, dst] = 0
    # Read into two other slots (zeros now), so only the disk can fill them.
    side.start_load_kv(load_meta(3, "r", dst, w.rows(2) + w.rows(3), [key(0), key(1)], [2, 3]))
    seen = drive(side, lambda s: "r" in s.recving)
    assert seen.acks == {3: [1, 0]}
    assert seen.disk_failed == {3: [0, 0]}
    assert seen.load_errors == set()
    assert seen.stats["disk_read_bytes"] == 2 * bpc * side.pool.row_bytes
    assert seen.stats["disk_reads_failed"] == seen.stats["disk_chunks_corrupt"] == 0
    assert seen.stats["load_bytes"] == 2 * bpc * side.pool.row_bytes
    for a, b in zip(src, dst, strict=True):
        assert block_bytes(w.kv, b) == block_bytes(w.kv, a)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_read_runs_across_engine_steps_and_the_load_ends_only_after_its_copy(
    make_worker: Callable[..., Worker], runtime: str
) -> None:
    """The engine never waits for the disk: while a read is held in its thread, steps
    go on and report nothing; once it is let go, the load is copied, then reported."""
    ops = GatedReads(key(0))
    w = make_worker(runtime, ops=ops)
    side = w.side
    write_down(w, 1, [key(0)], [0])
    expected = slot_bytes(w, 0)
    side.start_load_kv(load_meta(2, "r", [9], w.rows(5), [key(0)], [5]))
    steps = 0
    while not ops.blocked.is_set() or steps < 3:  # steps until the read is held, and more
        assert side.get_finished() == (None, None)
        assert side.build_worker_meta() is None
        steps += 1
        assert steps < 10_000, "the read never started"
        ops.blocked.wait(timeout=0.001)
    assert loads_copied(w) == 0  # the copy waits for the read
    ops.gate.set()
    seen = drive(side, lambda s: "r" in s.recving)
    assert seen.acks == {2: [1, 0]} and seen.disk_failed == {2: [0]}
    assert slot_bytes(w, 5) == expected
    assert b"".join(block_bytes(w.kv, 9)) == expected  # rows are layer after layer


def test_on_the_loop_thread_the_copy_starts_when_the_read_ends_without_an_engine_call(
    make_worker: Callable[..., Worker],
) -> None:
    ops = GatedReads(key(0))
    w = make_worker("thread", ops=ops)
    write_down(w, 1, [key(0)], [0])
    w.side.start_load_kv(load_meta(2, "r", [9], w.rows(5), [key(0)], [5]))
    assert ops.blocked.wait(timeout=30)
    assert loads_copied(w) == 0
    ops.gate.set()
    deadline = time.monotonic() + 60
    while loads_copied(w) == 0:  # asks to the load actor only: no poll, no engine step
        assert time.monotonic() < deadline, "the copy never started"
        time.sleep(0.001)
    seen = drive(w.side, lambda s: "r" in s.recving)
    assert seen.acks == {2: [1, 0]} and seen.disk_failed == {2: [0]}


def test_a_disk_load_the_scheduler_failed_meanwhile_is_answered_at_once_and_acked_when_it_ends(
    make_worker: Callable[..., Worker],
) -> None:
    """Its read still running, its copy not started: vLLM has its answer at once (the
    blocks recomputed), not when the read ends; the job's acknowledgement, which lets the
    scheduler free the host slot it reads into, waits for the read's end; no copy."""
    from kvferry.connector._metadata import KVFerryMetadata

    ops = GatedReads(key(0))
    w = make_worker(ops=ops)
    write_down(w, 1, [key(0)], [0])
    side = w.side
    side.start_load_kv(load_meta(2, "r", [9], w.rows(5), [key(0)], [5]))
    side.start_load_kv(KVFerryMetadata(failed_load_job_ids=[2]))  # its deadline passed
    assert side.get_finished() == (None, {"r"})  # still reading: answered all the same
    assert side.get_block_ids_with_load_errors() == {9}
    meta = side.build_worker_meta()
    assert meta is None or 2 not in meta.acks  # the read has not ended
    ops.gate.set()
    seen = drive(side, acked(2))
    assert seen.acks == {2: [1, 1]} and seen.disk_failed == {2: [0]}
    assert seen.recving == set() and seen.load_errors == set()  # answered once
    assert seen.stats.get("load_bytes", 0.0) == 0.0  # never copied


# -- failures -----------------------------------------------------------------------------


def flip_payload_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + 100)
        byte = f.read(1)
        f.seek(HEADER_SIZE + 100)
        f.write(bytes([byte[0] ^ 0xFF]))


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


CORRUPTIONS: dict[str, tuple[Callable[[Any], None], list[int]]] = {
    # how the files are damaged, and which of the two chunks fail then
    "payload byte flipped": (lambda store: flip_payload_byte(store.path_of(key(1))), [0, 1]),
    "file truncated": (lambda store: truncate(store.path_of(key(1))), [0, 1]),
    "files swapped": (
        lambda store: swap(store.path_of(key(0)), store.path_of(key(1))),
        [1, 1],
    ),
}


def swap(a: Path, b: Path) -> None:
    tmp = a.with_suffix(".swap")
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("damage", sorted(CORRUPTIONS))
def test_a_load_of_a_damaged_chunk_fails_on_the_worker_and_copies_nothing(
    make_worker: Callable[..., Worker], runtime: str, damage: str
) -> None:
    w = make_worker(runtime)
    side = w.side
    write_down(w, 1, [key(0), key(1)], [0, 1])
    corrupt, failed = CORRUPTIONS[damage]
    corrupt(side.disk)
    for n in LAYERS:
        w.kv[n][:, [7, 8]] = 0
    before = [block_bytes(w.kv, b) for b in (7, 8)]
    side.start_load_kv(load_meta(2, "r", [7, 8], w.rows(2) + w.rows(3), [key(0), key(1)], [2, 3]))
    seen = drive(side, lambda s: "r" in s.recving)
    assert seen.acks == {2: [1, 1]}  # failed on this worker
    assert seen.disk_failed == {2: failed}
    assert seen.load_errors == {7, 8}  # vLLM recomputes them
    assert seen.stats["disk_reads_failed"] == sum(failed)
    assert seen.stats["disk_chunks_corrupt"] == sum(failed)
    assert seen.stats.get("load_bytes", 0) == 0
    assert loads_copied(w) == 0  # never submitted
    assert [block_bytes(w.kv, b) for b in (7, 8)] == before
    # A chunk that failed verification was deleted, and is a miss from now on.
    for k, bad in zip([key(0), key(1)], failed, strict=True):
        assert side.disk.path_of(k).exists() is not bool(bad)


def test_a_read_of_a_chunk_not_on_disk_fails_the_load(make_worker: Callable[..., Worker]) -> None:
    w = make_worker()
    write_down(w, 1, [key(0)], [0])
    w.side.start_load_kv(load_meta(2, "r", [7, 8], [2, 3], [key(0), key(5)], [2, 3]))
    seen = drive(w.side, lambda s: "r" in s.recving)
    assert seen.acks == {2: [1, 1]} and seen.disk_failed == {2: [0, 1]}
    assert seen.stats["disk_reads_failed"] == 1 and seen.stats["disk_chunks_corrupt"] == 0


class ReadOpenFails(FileOps):
    """The next open of ``name``'s chunk file for a read fails with ``error``, once."""

    def __init__(self, gated: bytes, error: int) -> None:
        self.name = gated.hex() + ".kvc"
        self.error = error
        self.armed = False

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        if self.armed and os.path.basename(path) == self.name and not flags & os.O_CREAT:
            self.armed = False
            raise OSError(self.error, os.strerror(self.error), path)
        return super().open(path, flags, mode)


@pytest.mark.parametrize(
    ("error", "kept"),
    [(errno.EMFILE, True), (errno.ENOMEM, True), (errno.EIO, False)],
    ids=["EMFILE", "ENOMEM", "EIO"],
)
def test_a_failed_read_says_whether_this_rank_still_holds_the_chunk(
    make_worker: Callable[..., Worker], error: int, kept: bool
) -> None:
    """Every failed read fails the load; the report says whether the chunk is gone on
    this rank (1: EIO deleted it, as a corrupt or absent one is) or kept (KEPT: a
    transient error), so the scheduler drops only what is gone."""
    from kvferry.connector._metadata import KEPT

    ops = ReadOpenFails(key(1), error)
    w = make_worker(ops=ops)
    write_down(w, 1, [key(0), key(1)], [0, 1])
    ops.armed = True
    w.side.start_load_kv(load_meta(2, "r", [7, 8], w.rows(2) + w.rows(3), [key(0), key(1)], [2, 3]))
    seen = drive(w.side, lambda s: "r" in s.recving)
    assert seen.acks == {2: [1, 1]} and seen.load_errors == {7, 8}
    assert seen.disk_failed == {2: [0, KEPT if kept else 1]}
    assert seen.stats["disk_reads_failed"] == 1 and seen.stats["disk_chunks_corrupt"] == 0
    assert w.side.disk.path_of(key(1)).exists() is kept and (key(1) in w.side.disk) is kept


class GatedReads(FileOps):
    """Holds the read of one key's chunk until ``gate`` is set."""

    def __init__(self, gated: bytes) -> None:
        self.name = gated.hex() + ".kvc"
        self.gate = threading.Event()
        self.blocked = threading.Event()

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        if os.path.basename(path) == self.name and not flags & os.O_CREAT:
            self.blocked.set()
            if not self.gate.wait(timeout=60):
                raise TimeoutError("the test never opened the gate")
        return super().open(path, flags, mode)


class NoSpaceFor(FileOps):
    """The file system is full for the chunks of ``keys``."""

    def __init__(self, *keys: bytes) -> None:
        self.names = tuple(k.hex() + "." for k in keys)

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        if flags & os.O_CREAT and os.path.basename(path).startswith(self.names):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return super().open(path, flags, mode)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_write_failures_are_reported_per_chunk(
    make_worker: Callable[..., Worker], runtime: str
) -> None:
    w = make_worker(runtime, ops=NoSpaceFor(key(1)))
    seen = write_down(w, 1, [key(0), key(1), key(2)], [0, 1, 2])
    assert seen.acks == {1: [1, 1]}
    assert seen.disk_failed == {1: [0, 1, 0]}
    assert seen.stats["disk_writes_failed"] == 1
    assert seen.stats["disk_write_bytes"] == 2 * w.side.pool.row_bytes
    store = w.side.disk
    assert [store.path_of(key(i)).exists() for i in range(3)] == [True, False, True]


def test_a_write_beyond_bytes_to_use_is_reported_full(
    make_worker: Callable[..., Worker], kv_cache_config: Any
) -> None:
    from kvferry.tiers._format import file_size

    chunk = file_size(2 * 128 * 2 * 64 * 2 * len(LAYERS))  # one block of both layers
    w = make_worker(bytes_to_use=2 * chunk)
    seen = write_down(w, 1, [key(i) for i in range(3)], [0, 1, 2])
    assert seen.acks == {1: [1, 1]} and seen.disk_failed == {1: [0, 0, 1]}
    assert seen.stats["disk_writes_failed"] == 1


def test_deletes_remove_files_before_the_steps_writes(make_worker: Callable[..., Worker]) -> None:
    w = make_worker()
    side = w.side
    write_down(w, 1, [key(0), key(1), key(2)], [0, 1, 2])
    side.wait_for_save(write_meta(2, [], [], deletes=[key(0), key(1)]))
    side.get_finished()  # a poll: the disk actor handled the deletes before it
    store = side.disk
    assert [store.path_of(key(i)).exists() for i in range(3)] == [False, False, True]
    assert key(0) not in store and key(2) in store
    # Deleted, then written again in the same step: the write lands after the delete.
    side.wait_for_save(write_meta(3, [key(2)], [0], deletes=[key(2)]))
    seen = drive(side, acked(3))
    assert seen.disk_failed[3] == [0] and store.path_of(key(2)).exists()


def test_disk_work_for_a_worker_without_a_disk_tier_fails_there(
    make_worker: Callable[..., Worker],
) -> None:
    """Configs that differ between the halves: every disk chunk fails, nothing hangs."""
    w = make_worker(tiers=[])
    side = w.side
    side.wait_for_save(write_meta(1, [key(0), key(1)], [0, 1]))
    side.start_load_kv(load_meta(2, "r", [7], [2], [key(0)], [2]))
    seen = drive(side, lambda s: "r" in s.recving and 1 in s.acks)
    assert seen.acks == {1: [1, 1], 2: [1, 1]}
    assert seen.disk_failed == {1: [1, 1], 2: [1]}
    assert seen.load_errors == {7}


# -- start, restart, layout ---------------------------------------------------------------


def test_a_new_worker_on_the_same_path_finds_the_chunks_and_loads_them(
    make_worker: Callable[..., Worker],
) -> None:
    first = make_worker()
    write_down(first, 1, [key(0), key(1)], [0, 1])
    written = [slot_bytes(first, 0), slot_bytes(first, 1)]
    first.side.shutdown()

    again = make_worker("thread", kv=new_kv(seed=1))  # another runtime, the same files
    side = again.side
    assert side.disk_scan is not None and side.disk_scan.chunks == 2
    assert len(side.disk) == 2
    side.start_load_kv(load_meta(1, "r", [4, 5], [6, 7], [key(0), key(1)], [6, 7]))
    seen = drive(side, lambda s: "r" in s.recving)
    assert seen.acks == {1: [1, 0]} and seen.disk_failed == {1: [0, 0]}
    assert [b"".join(block_bytes(again.kv, b)) for b in (4, 5)] == written


def test_a_changed_layout_deletes_the_namespaces_chunks_before_the_scan(
    make_worker: Callable[..., Worker], caplog: pytest.LogCaptureFixture
) -> None:
    first = make_worker()
    write_down(first, 1, [key(0), key(1)], [0, 1])
    namespace = first.side.disk.namespace
    recorded = json.loads((namespace / "layout.json").read_text())
    first.side.shutdown()
    assert "disk_layout_changed" not in caplog.text

    # The same model and config (the same fingerprint, the same namespace), but the
    # tensors lie heads-outer: the same bytes per row, meaning something else.
    second = make_worker(kv=new_kv(hnd=True))
    side = second.side
    assert side.disk.namespace == namespace
    assert "disk_layout_changed" in caplog.text
    assert side.disk_scan is not None and side.disk_scan.chunks == 0
    assert not list(namespace.glob("*/*.kvc"))
    now = json.loads((namespace / "layout.json").read_text())
    assert now != recorded and now["row_bytes"] == recorded["row_bytes"]
    assert not list(namespace.glob("*.tmp"))
    side.start_load_kv(load_meta(1, "r", [4], [6], [key(0)], [6]))
    seen = drive(side, lambda s: "r" in s.recving)
    assert seen.disk_failed == {1: [1]} and seen.load_errors == {4}  # a miss, never a load


@pytest.mark.parametrize("locked", [True, False])
def test_clearing_a_namespace_leaves_temporary_files_alone_unless_it_is_held_locked(
    tmp_path: Path, locked: bool
) -> None:
    """Held locked (``flock``), nobody else writes there: a ``.tmp`` is a dead writer's.
    Without a lock, the namespace is shared and a ``.tmp`` may be another engine's write
    in flight (the scan deletes it once stale)."""
    from kvferry.connector._worker import clear_chunk_files

    fan = tmp_path / "00"
    fan.mkdir()
    chunk, tmp = fan / (key(1).hex() + ".kvc"), fan / (key(2).hex() + ".1.0.tmp")
    for f in (chunk, tmp):
        f.write_bytes(b"x")
    assert clear_chunk_files(tmp_path, temp=locked) == (2 if locked else 1)
    assert not chunk.exists() and tmp.exists() is not locked


def test_the_same_layout_keeps_the_chunks(
    make_worker: Callable[..., Worker], caplog: pytest.LogCaptureFixture
) -> None:
    first = make_worker()
    write_down(first, 1, [key(0)], [0])
    first.side.shutdown()
    second = make_worker(kv=new_kv(seed=3))  # other values, the same layout
    assert second.side.disk_scan.chunks == 1
    assert "disk_layout_changed" not in caplog.text


def test_chunk_files_without_a_layout_record_are_deleted(
    make_worker: Callable[..., Worker], caplog: pytest.LogCaptureFixture
) -> None:
    first = make_worker()
    write_down(first, 1, [key(0)], [0])
    namespace = first.side.disk.namespace
    first.side.shutdown()
    (namespace / "layout.json").unlink()
    second = make_worker()
    assert second.side.disk_scan.chunks == 0
    assert "disk_layout_changed" in caplog.text
    assert (namespace / "layout.json").exists()


@pytest.mark.parametrize(
    ("tier", "named"),
    [
        ({"path": "/proc/kvferry-cannot-be-here"}, "tiers[0].path"),
        ({"bytes_to_use": 1000}, "tiers[0].bytes_to_use"),
    ],
)
def test_a_bad_path_or_size_fails_the_start_naming_the_key(
    make_worker: Callable[..., Worker], tier: dict[str, Any], named: str
) -> None:
    with pytest.raises(ConfigError) as info:
        make_worker(**tier)
    assert info.value.key == named


# -- shutdown -----------------------------------------------------------------------------


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_shutdown_with_disk_jobs_in_flight_ends_cleanly(
    make_worker: Callable[..., Worker], runtime: str
) -> None:
    with assert_no_thread_left(except_names=("AnyIO worker thread",)):
        w = make_worker(runtime)
        side = w.side
        write_down(w, 1, [key(0)], [0])
        side.wait_for_save(write_meta(2, [key(i) for i in range(1, 9)], list(range(1, 9))))
        side.start_load_kv(load_meta(3, "r", [7], [12], [key(0)], [12]))
        report = side.runtime.close()
        side.shutdown()
    assert report.clean, report


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_shutdown_right_after_the_first_disk_jobs_ends_cleanly(
    make_worker: Callable[..., Worker], runtime: str, caplog: pytest.LogCaptureFixture
) -> None:
    w = make_worker(runtime)
    side = w.side
    side.wait_for_save(write_meta(1, [key(0), key(1)], [0, 1]))
    side.start_load_kv(load_meta(2, "r", [7], [12], [key(0)], [12]))
    report = side.runtime.close()
    side.shutdown()
    assert report.clean, report
    assert "tell_handler_failed" not in caplog.text


# -- tensor parallelism ------------------------------------------------------------------


def test_the_ranks_of_a_tensor_parallel_engine_take_one_namespace_index(
    make_vllm_config: Callable[..., Any],
    kv_cache_config: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Engine X's rank 0 holds ``<d0>``, its rank 1 not started yet; engine A starts: its
    rank 0 takes ``<d0>.1``, and its rank 1 the same index of its own family, ``<d1>.1``,
    not the first free ``<d1>`` (which X's rank 1 then takes): the scheduler keeps only
    the chunks every rank holds, so each engine's ranks must hold one earlier engine's."""
    from kvferry.connector._worker import WorkerSide
    from kvferry.tiers import _disk as disk_module

    # A bound, were rank 0 not found (no such constant before ranks followed it).
    monkeypatch.setattr(disk_module, "FOLLOW_WAIT_S", 5.0, raising=False)
    tier = {"kind": "disk", "path": str(tmp_path / "disk"), "bytes_to_use": 64 << 20}
    extra: dict[str, Any] = {"cpu_bytes_to_use": 8 << 20, "runtime": "stepped", "tiers": [tier]}
    sides: list[Any] = []

    def start(engine: str, rank: int) -> Any:
        config = make_vllm_config(extra)
        config.instance_id = engine
        parallel = config.parallel_config
        parallel.tensor_parallel_size = parallel.world_size = 2
        parallel.rank = rank
        side = WorkerSide(config, kv_cache_config, FerryConfig.from_dict(extra))
        sides.append(side)
        side.register_kv_caches(new_kv())
        return side.disk

    try:
        x0, a0, a1, x1 = start("x", 0), start("a", 0), start("a", 1), start("x", 1)
        d0, d1 = (store.fingerprint.digest.hex() for store in (x0, x1))
        assert d0 != d1 and a1.fingerprint == x1.fingerprint
        assert [s.namespace.name for s in (x0, x1)] == [d0, d1]
        assert [s.namespace.name for s in (a0, a1)] == [f"{d0}.1", f"{d1}.1"]
    finally:
        for side in sides:
            side.shutdown()
