"""Both halves of the disk tier on one temporary directory, without an engine: the
scheduler half's metadata goes to a real worker half (CPU copy engine, real files), the
worker's reports come back, step by step as vLLM passes them. A prompt stored by one
request, written down, evicted from host memory, is loaded from disk by the next
request, bit for bit; a file damaged in between makes that load fail on the worker, and
the scheduler drops the chunk; a restart finds the files again."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvferry.cache import ClearAll, GetStatistics, LookupEach
from kvferry.tiers import HEADER_SIZE, FileOps
from kvferry.tiers._format import file_size

from ._halves import LAYERS, SLOT_BYTES, Halves
from ._steps import BLOCK, allocated, key, request


class Engine(Halves):
    """Both halves with a disk tier under ``path``."""

    def __init__(
        self,
        make_vllm_config: Any,
        kv_cache_config: Any,
        path: Path,
        runtime: str,
        host_slots: int = 8,
        clock: Callable[[], float] = time.monotonic,
        **disk: Any,
    ):
        extra = {
            "cpu_bytes_to_use": host_slots * SLOT_BYTES,
            "runtime": runtime,
            "tiers": [
                {
                    "kind": "disk",
                    "path": str(path),
                    "bytes_to_use": 16 * file_size(SLOT_BYTES),
                    **disk,
                }
            ],
        }
        super().__init__(make_vllm_config, kv_cache_config, extra, clock=clock)


@pytest.fixture
def make_engine(
    make_vllm_config: Any, kv_cache_config: Any, tmp_path: Path
) -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(runtime: str = "stepped", **kw: Any) -> Engine:
        made.append(Engine(make_vllm_config, kv_cache_config, tmp_path / "disk", runtime, **kw))
        return made[-1]

    yield make
    for e in made:
        if e.worker.runtime is not None:
            e.close()


def store_and_write_down(e: Engine, req: Any, blocks: list[int]) -> list[bytes]:
    """Run ``req``'s prompt (its chunks stored, then written down), then evict host memory."""
    e.sched.on_new_request(req)
    e.step({req.request_id: (blocks,)}, {req.request_id: req.num_tokens})
    chunks = req.num_tokens // BLOCK
    keys = [key(req, c) for c in range(chunks)]
    e.run_until(lambda: bool(e.sched.disk.ready(keys).all()))
    e.sched._ask(ClearAll)
    assert e.sched._ask(GetStatistics).used == 0
    return keys


def load(e: Engine, req: Any, blocks: list[int], hit: int) -> None:
    e.sched.on_new_request(req)
    assert e.sched.get_num_new_matched_tokens(req, 0) == (hit, True)
    e.sched.update_state_after_alloc(req, allocated(blocks), hit)
    e.run_until(lambda: req.request_id in e.recving)


@pytest.mark.parametrize("runtime", ["stepped", "thread"])
def test_a_prompt_written_down_and_evicted_is_loaded_from_disk(
    make_engine: Callable[..., Engine], runtime: str
) -> None:
    e = make_engine(runtime)
    a, b = request("a", 3 * BLOCK + 8), request("b", 3 * BLOCK + 8)  # the same prompt
    store_and_write_down(e, a, [1, 2, 3, 4])
    for n in LAYERS:
        e.kv[n][:, [9, 10, 11]] = 0
    load(e, b, [9, 10, 11, 12], 3 * BLOCK)
    assert e.load_errors == set()
    assert [e.block(x) for x in (9, 10, 11)] == [e.block(x) for x in (1, 2, 3)]
    stats = e.sched.statistics()
    assert stats.loads_done == 1 and stats.disk_chunks_written == 3
    assert stats.disk_read_bytes == 3 * SLOT_BYTES and stats.disk_reads_failed == 0
    assert e.sched._ask(GetStatistics).ready == 3  # the chunks read are host hits again


def test_a_chunk_damaged_on_disk_fails_the_load_and_leaves_the_tier(
    make_engine: Callable[..., Engine],
) -> None:
    e = make_engine()
    a, b = request("a", 3 * BLOCK + 8), request("b", 3 * BLOCK + 8)
    keys = store_and_write_down(e, a, [1, 2, 3, 4])
    path = e.worker.disk.path_of(keys[1])
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + 7)
        f.write(b"\x00\xff")
    before = [e.block(x) for x in (9, 10, 11)]
    load(e, b, [9, 10, 11, 12], 3 * BLOCK)
    assert e.load_errors == {9, 10, 11}  # recomputed by vLLM
    assert [e.block(x) for x in (9, 10, 11)] == before  # nothing copied
    stats = e.sched.statistics()
    assert stats.loads_failed == 1 and stats.disk_chunks_corrupt == 1
    assert (stats.disk_loads_failed, stats.loads_failed_copy) == (1, 0)  # no copy started
    assert e.sched.disk.ready(keys).tolist() == [True, False, True]
    assert not os.path.exists(path)


class OutOfDescriptorsOnce(FileOps):
    """The next chunk file opened for a read fails with EMFILE (every descriptor of the
    process taken, for a moment), once."""

    def __init__(self) -> None:
        self.failed = False

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        if not self.failed and path.endswith(".kvc") and flags & os.O_ACCMODE == os.O_RDONLY:
            self.failed = True
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return super().open(path, flags, mode)


def test_a_transient_read_error_fails_the_load_and_keeps_the_chunk(
    make_engine: Callable[..., Engine],
) -> None:
    """EMFILE on a chunk's open: the load fails (vLLM recomputes), but nothing is wrong
    with the chunk, which stays on disk and a hit for the next request."""
    e = make_engine()
    a, b, c = (request(n, 3 * BLOCK + 8) for n in "abc")  # the same prompt
    keys = store_and_write_down(e, a, [1, 2, 3, 4])
    assert e.worker.disk is not None
    e.worker.disk._ops = OutOfDescriptorsOnce()
    load(e, b, [9, 10, 11, 12], 3 * BLOCK)
    assert e.load_errors == {9, 10, 11}  # recomputed by vLLM
    e.step()  # the deletes a failed read leads to, if any, are done now
    assert all(e.worker.disk.path_of(k).exists() for k in keys)
    assert e.sched.disk.ready(keys).all()
    e.load_errors.clear()
    load(e, c, [5, 6, 7, 8], 3 * BLOCK)
    assert e.load_errors == set()


def test_after_a_restart_the_files_are_hits_again(make_engine: Callable[..., Engine]) -> None:
    first = make_engine()
    a = request("a", 2 * BLOCK + 8)
    store_and_write_down(first, a, [1, 2, 3])
    written = [first.block(x) for x in (1, 2)]
    first.close()

    again = make_engine("thread")
    assert again.worker.disk_scan.chunks == 2
    b = request("b", 2 * BLOCK + 8)
    load(again, b, [5, 6, 7], 2 * BLOCK)
    assert again.load_errors == set()
    assert [again.block(x) for x in (5, 6)] == written


def test_two_engines_of_one_model_on_one_path_keep_to_their_own_chunks(
    make_engine: Callable[..., Engine],
) -> None:
    """Two engines of one fingerprint on one ``path`` at once: each worker takes a
    namespace of its own and its scheduler half scans that one, so one never counts,
    evicts or reads the other's chunks. Restarted, an engine takes the first free
    namespace, a previous engine's, and its chunks are hits."""
    first = make_engine()
    a = request("a", 2 * BLOCK + 8)
    keys = store_and_write_down(first, a, [1, 2, 3])
    written = [first.block(x) for x in (1, 2)]
    second = make_engine()
    assert first.worker.disk is not None and second.worker.disk is not None
    assert second.worker.disk.namespace != first.worker.disk.namespace
    assert second.worker.disk_scan is not None and second.worker.disk_scan.chunks == 0
    assert second.sched.disk.restored == 0 and not second.sched.disk.ready(keys).any()
    b = request("b", 2 * BLOCK + 8, seed=3)
    store_and_write_down(second, b, [4, 5, 6])
    assert first.worker.disk.keys() == keys  # untouched by the other engine
    first.close()

    again = make_engine("thread")  # the first engine restarted, the second still running
    assert again.worker.disk is not None
    assert again.worker.disk.namespace == first.worker.disk.namespace
    assert again.sched.disk.restored == 2 and again.sched.disk.ready(keys).all()
    c = request("c", 2 * BLOCK + 8)  # a's prompt
    load(again, c, [7, 8, 9], 2 * BLOCK)
    assert again.load_errors == set()
    assert [again.block(x) for x in (7, 8)] == written


def test_on_evict_writes_a_block_down_only_when_host_memory_evicts_it(
    make_engine: Callable[..., Engine],
) -> None:
    # 12 host slots; the evictor (watermarks 0.9 / 0.95 with on_evict) brings 12 down to 10.
    e = make_engine(write="on_evict", host_slots=12)
    names = "abcd"
    prompts = {n: request(n, 3 * BLOCK + 8, seed=s) for s, n in enumerate(names, 1)}
    blocks = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8], "c": [9, 10, 11, 12], "d": [13, 14, 15, 4]}
    keys = [key(r, c) for r in prompts.values() for c in range(3)]

    def store(n: str) -> None:
        e.sched.on_new_request(prompts[n])
        e.step({n: (blocks[n],)}, {n: prompts[n].num_tokens})
        settle(e)

    for n in "abc":  # 9 of 12 slots: nothing evicted, nothing written
        store(n)
    assert e.sched.statistics().disk_chunks_written == 0 and disk_files(e) == 0
    assert not e.sched.disk.ready(keys).any()
    written = {n: [e.block(x) for x in blocks[n][:3]] for n in names}

    store("d")  # 12 of 12: the evictor's victims are written down, then their slots freed
    stats = e.sched.statistics()
    demoted = stats.host_blocks_demoted
    assert demoted == 2 and stats.disk_chunks_written == demoted == disk_files(e)
    assert stats.directory.demoting == 0 and stats.directory.used == 12 - demoted
    host = e.sched._ask(lambda r: LookupEach(keys=tuple(keys), reply=r))
    on_disk = e.sched.disk.ready(keys)
    assert (host ^ on_disk).all()  # every block stored is in exactly one tier
    assert int(on_disk.sum()) == demoted

    # The prompts with blocks on disk load whole again (host and disk), bit for bit.
    from_disk = {n for n, d in zip(names, on_disk.reshape(4, 3).any(axis=1), strict=True) if d}
    assert from_disk
    for n in sorted(from_disk):
        for layer in LAYERS:
            e.kv[layer][:, [1, 2, 3]] = 0
        again = request(n + "2", 3 * BLOCK + 8, seed=names.index(n) + 1)
        load(e, again, [1, 2, 3, 4], 3 * BLOCK)
        assert [e.block(x) for x in (1, 2, 3)] == written[n], n
        settle(e)
    assert e.load_errors == set()


def settle(e: Engine) -> None:
    """Steps until no job is in flight, no eviction is being written down, and the
    evictor has nothing left to do (occupancy at most its high watermark)."""

    def settled() -> bool:
        d = e.sched._ask(GetStatistics)
        return not e.sched._jobs and d.demoting == 0 and d.used <= 0.95 * d.capacity

    e.run_until(settled)


def disk_files(e: Engine) -> int:
    return sum(1 for _ in e.worker.disk.namespace.glob("*/*.kvc"))


def write_pending_at_a_reset(e: Engine) -> list[bytes]:
    """Run a prompt of 3 chunks; reset once its store ended and its disk writes are
    prepared for the next step; step until they ended (unseen). Its keys."""
    a = request("a", 3 * BLOCK + 8, seed=1)
    e.sched.on_new_request(a)
    e.step({"a": ([1, 2, 3, 4],)}, {"a": a.num_tokens})
    e.run_until(lambda: bool(e.sched._writes.disk_writes))
    assert e.sched.reset()
    e.run_until(lambda: not e.sched._jobs)
    return [key(a, c) for c in range(3)]


def test_a_reset_with_a_disk_write_pending_leaves_no_file_behind(
    make_engine: Callable[..., Engine],
) -> None:
    e = make_engine(bytes_to_use=3 * file_size(SLOT_BYTES))
    keys = write_pending_at_a_reset(e)
    e.step()  # the files of the writes the reset dropped are deleted
    assert not e.sched.disk.ready(keys).any()
    assert disk_files(e) == 0 and e.worker.disk is not None and e.worker.disk.used_bytes == 0


def test_after_that_reset_the_disk_tier_holds_its_capacity_again(
    make_engine: Callable[..., Engine],
) -> None:
    """The worker's files and the scheduler's tier agree: writes the tier admits fit."""
    e = make_engine(bytes_to_use=3 * file_size(SLOT_BYTES))
    write_pending_at_a_reset(e)
    b = request("b", 3 * BLOCK + 8, seed=2)  # another prompt of 3 chunks: the whole tier
    e.sched.on_new_request(b)
    e.step({"b": ([5, 6, 7, 8],)}, {"b": b.num_tokens})
    e.run_until(lambda: not e.sched._jobs and not e.sched._writes.disk_writes)
    assert e.sched.disk.ready([key(b, c) for c in range(3)]).all()
    assert e.sched.statistics().disk_writes_failed == 0


class HeldReads(FileOps):
    """A chunk's read opens its file only once ``released``: as late as a read queued
    behind busy runners may."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        if path.endswith(".kvc") and flags & os.O_ACCMODE == os.O_RDONLY:
            self.released.wait(60.0)  # bounded: a test that failed before it released
        return super().open(path, flags, mode)


def test_a_reset_leaves_the_files_of_a_load_in_flight_until_it_ended(
    make_engine: Callable[..., Engine],
) -> None:
    """vLLM resets while a request waits for its KV from disk: the load still finds its
    files, however late its reads open them, and they are deleted once it ended."""
    e = make_engine()
    a, b = request("a", 3 * BLOCK + 8), request("b", 3 * BLOCK + 8)  # the same prompt
    store_and_write_down(e, a, [1, 2, 3, 4])
    for n in LAYERS:
        e.kv[n][:, [9, 10, 11]] = 0
    e.sched.on_new_request(b)
    assert e.sched.get_num_new_matched_tokens(b, 0) == (3 * BLOCK, True)
    e.sched.update_state_after_alloc(b, allocated([9, 10, 11, 12]), 3 * BLOCK)
    assert e.worker.disk is not None
    reads = HeldReads()
    e.worker.disk._ops = reads
    try:
        assert e.sched.reset()
        e.step()  # the load's reads are held; this step's deletes are done on the worker
    finally:
        reads.released.set()
    e.run_until(lambda: "b" in e.recving)
    assert e.load_errors == set()
    assert [e.block(x) for x in (9, 10, 11)] == [e.block(x) for x in (1, 2, 3)]
    e.step()  # the files of the chunks it read are deleted now
    assert disk_files(e) == 0 and e.worker.disk.used_bytes == 0


@pytest.mark.parametrize("runtime", ["stepped", "thread"])
def test_a_load_whose_read_does_not_return_is_recomputed_at_its_deadline(
    make_engine: Callable[..., Engine], runtime: str
) -> None:
    """A disk that stops answering holds a load's read: the scheduler ends the load at its
    deadline, and vLLM, which waits for the worker's finished_recving, had the request
    held as long as the read (forever, on a hung mount). Now the worker answers at once,
    its blocks recomputed (give_up_b), and never copies it; the host slots it read into
    stay reserved until the read returned."""
    now = [0.0]
    e = make_engine(runtime, clock=lambda: now[0])
    _, reads, _ = give_up_b(e, now)
    reads.released.set()
    e.recving.clear()
    e.run_until(lambda: not e.sched._expired)  # the read returned, and was acknowledged
    e.step()
    assert "b" not in e.recving  # answered once
    assert all(not any(e.block(x)) for x in (9, 10, 11))  # still zero: never copied
    stats = e.sched.statistics()
    assert (stats.loads_failed, stats.loads_failed_deadline) == (1, 1)
    host = e.sched._ask(GetStatistics)
    assert host.storing == 0 and host.pinned == 0  # its reserved slots were let go


# -- a load given up at its deadline while its read hangs ---------------------------------
# vLLM has the request's finished_recving before the scheduler half has the job's
# acknowledgement, which comes only once the read ends. The request must not stay tied to
# that load meanwhile: one that finishes has its blocks freed, and is forgotten.


def give_up_b(e: Engine, now: list[float]) -> tuple[Any, HeldReads, set[str]]:
    """``a`` written down and evicted; ``b`` (the same prompt) loads it from disk, its
    reads held; its deadline passes and the worker answers vLLM. The finished_sending
    every step reports is collected in the set returned."""
    sending: set[str] = set()
    get_finished = e.worker.get_finished

    def recorded() -> tuple[set[str] | None, set[str] | None]:
        s, r = get_finished()
        sending.update(s or ())
        return s, r

    e.worker.get_finished = recorded  # type: ignore[method-assign]
    a, b = request("a", 3 * BLOCK + 8), request("b", 3 * BLOCK + 8)
    store_and_write_down(e, a, [1, 2, 3, 4])
    for n in LAYERS:
        e.kv[n][:, [9, 10, 11]] = 0
    reads = HeldReads()
    assert e.worker.disk is not None
    e.worker.disk._ops = reads
    e.sched.on_new_request(b)
    assert e.sched.get_num_new_matched_tokens(b, 0) == (3 * BLOCK, True)
    e.sched.update_state_after_alloc(b, allocated([9, 10, 11, 12]), 3 * BLOCK)
    e.step()  # the reads start, and are held
    assert "b" not in e.recving
    now[0] += e.sched.cfg.job_timeout_s + 1
    e.step()  # the scheduler ends the load; the worker answers vLLM in the same step
    assert "b" in e.recving and e.load_errors == {9, 10, 11}
    assert e.sched._expired  # its ack waits for the read's end
    return b, reads, sending


@pytest.mark.parametrize("runtime", ["stepped", "thread"])
def test_a_request_given_up_and_recomputed_that_finishes_has_its_blocks_freed(
    make_engine: Callable[..., Engine], runtime: str
) -> None:
    """vLLM recomputes b (every block invalid: num_computed_tokens 0, blocks freed and
    allocated again) and b finishes while the hung read still runs. request_finished
    answered True (delay the free: "aborted while its load runs") while the load was
    still b's, yet no worker would report b in finished_sending: vLLM kept b and its
    blocks forever (finished_recving, the other way vLLM frees a delayed request, was
    spent by the give-up)."""
    now = [0.0]
    e = make_engine(runtime, clock=lambda: now[0])
    b, reads, sending = give_up_b(e, now)
    try:
        # vLLM schedules b again from nothing: no hit (its load failed), recomputed.
        assert e.sched.get_num_new_matched_tokens(b, 0) == (0, False)
        e.sched.update_state_after_alloc(b, allocated([13, 14, 15, 5]), 0)
        e.step({"b": ([13, 14, 15, 5],)}, {"b": b.num_tokens})
        b.num_computed_tokens = b.num_tokens
        delay, _ = e.sched.request_finished(b, ([13, 14, 15, 5],))
    finally:
        reads.released.set()
    e.run_until(lambda: not e.sched._expired and not e.sched._jobs)  # everything ended
    e.step()
    # Either its blocks are free at once, or vLLM is told (finished_sending) later.
    assert not delay or "b" in sending, "vLLM holds b's blocks for a finished_sending never sent"


@pytest.mark.parametrize("runtime", ["stepped", "thread"])
def test_a_request_aborted_while_its_load_is_given_up_is_forgotten(
    make_engine: Callable[..., Engine], runtime: str
) -> None:
    """b is aborted after the give-up's finished_recving: the scheduler half kept b tied
    to its load until the read ended, and then let it go without dropping b: its state
    stayed for the life of the engine."""
    now = [0.0]
    e = make_engine(runtime, clock=lambda: now[0])
    b, reads, _ = give_up_b(e, now)
    try:
        e.sched.request_finished(b, ([9, 10, 11, 12],))  # aborted after the give-up
    finally:
        reads.released.set()
    e.run_until(lambda: not e.sched._expired and not e.sched._jobs)
    e.step()
    assert "b" not in set(e.sched._reqs), "the finished request's state is kept forever"


def test_control_the_same_request_finishing_after_the_read_ended_is_freed(
    make_engine: Callable[..., Engine],
) -> None:
    """b finishes only once the read ended and was acknowledged: nothing holds its
    blocks, and its state is dropped (the two tests above finish it while the read
    still runs)."""
    now = [0.0]
    e = make_engine("stepped", clock=lambda: now[0])
    b, reads, sending = give_up_b(e, now)
    reads.released.set()
    e.run_until(lambda: not e.sched._expired and not e.sched._jobs)
    delay, _ = e.sched.request_finished(b, ([9, 10, 11, 12],))
    e.run_until(lambda: not e.sched._jobs)
    e.step()
    assert not delay or "b" in sending
    assert "b" not in set(e.sched._reqs)


@pytest.mark.parametrize("runtime", ["stepped", "thread"])
def test_a_request_aborted_while_it_loads_is_let_go_when_its_load_is_given_up(
    make_engine: Callable[..., Engine], runtime: str
) -> None:
    """b is aborted while its read is held: vLLM delays freeing its blocks until
    finished_recving, which the give-up sends at the deadline; the scheduler half then
    forgets b, though the read has not ended."""
    now = [0.0]
    e = make_engine(runtime, clock=lambda: now[0])
    a, b = request("a", 3 * BLOCK + 8), request("b", 3 * BLOCK + 8)
    store_and_write_down(e, a, [1, 2, 3, 4])
    reads = HeldReads()
    assert e.worker.disk is not None
    e.worker.disk._ops = reads
    try:
        e.sched.on_new_request(b)
        assert e.sched.get_num_new_matched_tokens(b, 0) == (3 * BLOCK, True)
        e.sched.update_state_after_alloc(b, allocated([9, 10, 11, 12]), 3 * BLOCK)
        e.step()  # the reads start, and are held
        assert e.sched.request_finished(b, ([9, 10, 11, 12],))[0] is True  # loading: delay
        now[0] += e.sched.cfg.job_timeout_s + 1
        e.step()  # ended at its deadline, given up: finished_recving
        assert "b" in e.recving
        assert "b" not in e.sched._reqs
        assert e.sched._expired  # its host slots still wait for the read
    finally:
        reads.released.set()
    e.run_until(lambda: not e.sched._expired)
