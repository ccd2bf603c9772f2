"""kvferry.Ferry: the embedding API, on the caller's own loop, over real copy threads."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import anyio
import attrs
import pytest
import torch

from kvferry import ActorCrashed, ActorStopped, HostMemoryError, TransferError
from kvferry._ferry import Ferry
from kvferry.actors._testing import assert_no_task_left, assert_no_thread_left
from kvferry.transfer import CopyJob, HostPool, KVLayout, SubmitJob, new_copy_engine
from kvferry.transfer._testing import ManualCompletion, ManualCopyEngine

pytestmark = pytest.mark.anyio

NUM_BLOCKS = 24


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def kv_caches(seed: int = 0) -> dict[str, torch.Tensor]:
    """Two layers shaped like vLLM's (K/V, blocks, tokens, heads, head dim), seeded."""
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn(2, NUM_BLOCKS, 16, 2, 8, generator=g) for i in range(2)}


def keys(*names: int) -> list[bytes]:
    return [f"key-{n}".encode() for n in names]


def blocks_of(kv: dict[str, torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    return [t[:, ids].clone() for t in kv.values()]


@pytest.fixture
async def ferry_and_kv() -> AsyncIterator[tuple[Ferry, dict[str, torch.Tensor]]]:
    kv = kv_caches()
    async with Ferry(kv, num_blocks=NUM_BLOCKS, cpu_bytes_to_use=1 << 20, copy_threads=2) as f:
        yield f, kv


async def test_a_stored_block_loads_back_byte_for_byte(ferry_and_kv) -> None:  # type: ignore[no-untyped-def]
    ferry, kv = ferry_and_kv
    before = blocks_of(kv, [1, 2, 3])
    assert await ferry.store(keys(1, 2, 3), [1, 2, 3]) == 3
    for t in kv.values():
        t.zero_()  # the engine reuses its blocks
    await ferry.load(keys(1, 2, 3), [7, 5, 6])
    after = blocks_of(kv, [7, 5, 6])
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


async def test_lookup_counts_only_the_leading_stored_keys(ferry_and_kv) -> None:  # type: ignore[no-untyped-def]
    ferry, _ = ferry_and_kv
    await ferry.store(keys(1, 2, 4), [1, 2, 4])
    assert await ferry.lookup(keys(1, 2, 3, 4)) == 2
    assert await ferry.lookup(keys(9)) == 0


async def test_storing_what_is_stored_copies_nothing(ferry_and_kv) -> None:  # type: ignore[no-untyped-def]
    ferry, _ = ferry_and_kv
    assert await ferry.store(keys(1, 2), [1, 2]) == 2
    assert await ferry.store(keys(1, 2, 3), [1, 2, 3]) == 1
    stats = await ferry.statistics()
    assert (stats.stores_completed, stats.stores_skipped_present) == (3, 2)


async def test_loading_a_key_that_is_not_stored_copies_nothing(ferry_and_kv) -> None:  # type: ignore[no-untyped-def]
    ferry, kv = ferry_and_kv
    await ferry.store(keys(1), [1])
    before = blocks_of(kv, [5, 6])
    with pytest.raises(KeyError):
        await ferry.load(keys(1, 2), [5, 6])
    assert all(torch.equal(a, b) for a, b in zip(blocks_of(kv, [5, 6]), before, strict=True))
    assert (await ferry.statistics()).pinned == 0


async def test_keys_and_blocks_must_pair_up(ferry_and_kv) -> None:  # type: ignore[no-untyped-def]
    ferry, _ = ferry_and_kv
    with pytest.raises(ValueError, match="2 keys but 1 block"):
        await ferry.store(keys(1, 2), [1])
    with pytest.raises(ValueError, match="block ids must be in"):
        await ferry.load(keys(1), [NUM_BLOCKS])


async def test_concurrent_stores_and_loads_all_complete_with_the_right_bytes(
    ferry_and_kv,  # type: ignore[no-untyped-def]
) -> None:
    ferry, kv = ferry_and_kv
    expected = {n: blocks_of(kv, [n]) for n in range(12)}
    async with anyio.create_task_group() as tg:
        for n in range(12):
            tg.start_soon(ferry.store, keys(n), [n])
    assert await ferry.lookup(keys(*range(12))) == 12
    for t in kv.values():
        t.zero_()

    async def load_one(n: int) -> None:
        await ferry.load(keys(n), [12 + n])

    async with anyio.create_task_group() as tg:
        for n in range(12):
            tg.start_soon(load_one, n)
    for n in range(12):
        got = blocks_of(kv, [12 + n])
        assert all(torch.equal(a, b) for a, b in zip(got, expected[n], strict=True))


async def test_a_cancelled_store_still_finishes_its_copy(ferry_and_kv) -> None:  # type: ignore[no-untyped-def]
    ferry, _ = ferry_and_kv
    with anyio.CancelScope() as scope:
        scope.cancel()
        await ferry.store(keys(1, 2), [1, 2])
    assert await ferry.lookup(keys(1, 2)) == 2  # whole, not half-written
    assert (await ferry.statistics()).storing == 0


class _BrokenEngine:
    """A copy engine whose every submission fails (a device error, say)."""

    def __init__(self, layout: KVLayout, pool: HostPool) -> None:
        self._real = new_copy_engine(layout, pool, num_threads=1)

    def submit(self, job: CopyJob) -> object:
        raise RuntimeError("device lost")

    def job_bytes(self, job: CopyJob) -> int:
        return self._real.job_bytes(job)

    def close(self) -> None:
        self._real.close()


async def test_a_failed_store_raises_and_its_keys_never_become_visible() -> None:
    kv = kv_caches()
    async with Ferry(
        kv, num_blocks=NUM_BLOCKS, cpu_bytes_to_use=1 << 20, copy_engine=_BrokenEngine
    ) as ferry:
        with pytest.raises(TransferError, match="device lost"):
            await ferry.store(keys(1), [1])
        assert await ferry.lookup(keys(1)) == 0
        assert (await ferry.statistics()).stores_failed == 1


async def test_leaving_the_ferry_stops_its_actors_and_copy_threads() -> None:
    # The watcher waits in the loop's worker pool, which belongs to the loop (its idle
    # workers end by themselves); the Ferry's own copy threads must be gone.
    with assert_no_thread_left(except_names=("AnyIO worker thread",)):
        async with assert_no_task_left():
            async with Ferry(kv_caches(), num_blocks=NUM_BLOCKS, cpu_bytes_to_use=1 << 20) as f:
                await f.store(keys(1), [1])
                assert [s.name for s in f.system.statistics()] == [
                    "directory",
                    "LoadActor",
                    "StoreActor",
                    "StoreActor.watcher",  # waits for the store's completion in a thread
                ]
    assert f.system.shutdown_report is not None and f.system.shutdown_report.clean


async def test_a_host_pool_smaller_than_one_block_is_refused() -> None:
    with pytest.raises(HostMemoryError):
        async with Ferry(kv_caches(), num_blocks=NUM_BLOCKS, cpu_bytes_to_use=100):
            pass


@pytest.mark.parametrize("threads", [-2, -1, 0, True, 2.5])
async def test_a_copy_thread_count_below_one_is_refused(threads: int) -> None:
    # With no copy thread (range(-2) starts none), the first store would never return:
    # its wait is shielded from cancellation. 0 meant "the default" unsaid: None says it.
    with pytest.raises(ValueError, match=f"copy_threads must be a whole number >= 1.*{threads}"):
        Ferry(kv_caches(), num_blocks=NUM_BLOCKS, cpu_bytes_to_use=1 << 20, copy_threads=threads)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("job_timeout_s", 0),  # every job failed at once
        ("job_timeout_s", -1.0),  # the store raised out of the Ferry's task group
        ("job_timeout_s", math.nan),  # no job ever timed out
        ("job_timeout_s", "5"),  # the copy actor crashed on every job
        ("stop_timeout_s", math.nan),  # leaving the Ferry raised TimeoutError
        ("stop_timeout_s", -1),
    ],
)
async def test_a_timeout_that_is_not_a_finite_number_in_range_is_refused(
    name: str, value: Any
) -> None:
    with pytest.raises(ValueError, match=f"{name} must be a finite number"):
        Ferry(kv_caches(), num_blocks=NUM_BLOCKS, cpu_bytes_to_use=1 << 20, **{name: value})


async def test_a_ferry_is_used_inside_async_with() -> None:
    ferry = Ferry(kv_caches(), num_blocks=NUM_BLOCKS, cpu_bytes_to_use=1 << 20)
    with pytest.raises(RuntimeError, match="async with"):
        await ferry.lookup(keys(1))


async def test_a_waiting_caller_is_woken_by_the_completion_not_by_polling() -> None:
    engine = ManualCopyEngine()
    async with Ferry(
        kv_caches(),
        num_blocks=NUM_BLOCKS,
        cpu_bytes_to_use=1 << 20,
        copy_engine=lambda _l, _p: engine,
    ) as ferry:
        stored: list[int] = []

        async def store() -> None:
            stored.append(await ferry.store(keys(1, 2), [1, 2]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(store)
            await anyio.wait_all_tasks_blocked()
            [job] = engine.submitted
            assert stored == []  # waiting: nothing polls the actor meanwhile
            polls_before = ferry.system.statistics()
            engine.completions[job.job_id].fire()  # the "device" ends the job, off the loop
        assert stored == [2]
        # the store actor handled the submission and one wake-up, no PollFinished loop
        store_stats = [s for s in ferry.system.statistics() if s.name == "StoreActor"][0]
        before = [s for s in polls_before if s.name == "StoreActor"][0]
        assert store_stats.messages_handled - before.messages_handled == 1


class _BrokenLoads(_BrokenEngine):
    """Stores copy; every load submission fails."""

    def submit(self, job: CopyJob) -> object:
        if job.direction == "store":
            return self._real.submit(job)
        raise RuntimeError("device lost")


async def test_failed_copies_leave_nothing_behind() -> None:
    """Each failed store or load ends its waiter's entry in the copy actors and its pins:
    a long-running server that keeps failing does not grow."""
    kv = kv_caches()
    async with Ferry(
        kv, num_blocks=NUM_BLOCKS, cpu_bytes_to_use=1 << 20, copy_engine=_BrokenLoads
    ) as ferry:
        assert await ferry.store(keys(1, 2), [1, 2]) == 2
        for _ in range(3):
            with pytest.raises(TransferError, match="device lost"):
                await ferry.load(keys(1, 2), [3, 4])
        for ref in (ferry._store, ferry._load):
            assert ref is not None
            actor = ref._cell.actor
            assert actor._notify == {} and actor._ended == [] and actor.in_flight == 0
        stats = await ferry.statistics()
        assert stats.pinned == 0 and stats.loads_completed == 6


async def test_a_copy_past_job_timeout_is_cancelled_and_the_store_fails() -> None:
    # Nothing polls a Ferry's jobs: the deadline itself must end the wait.
    engine = ManualCopyEngine(cancel_ends=True)  # cancellable: nothing of the job started
    async with Ferry(
        kv_caches(),
        num_blocks=NUM_BLOCKS,
        cpu_bytes_to_use=1 << 20,
        job_timeout_s=0.01,
        copy_engine=lambda _l, _p: engine,
    ) as ferry:
        outcome: list[int | BaseException] = []
        ended = anyio.Event()

        async def store() -> None:
            try:
                outcome.append(await ferry.store(keys(1), [1]))
            except Exception as exc:
                outcome.append(exc)
            ended.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(store)
            with anyio.move_on_after(5):
                await ended.wait()
            [job] = engine.submitted
            completion = engine.completions[job.job_id]
            cancelled = completion.cancelled
            completion.fire()  # (only if the test failed) ends the shielded store
        assert cancelled, "the job past its deadline was never cancelled"
        [error] = outcome
        assert isinstance(error, TransferError) and "past its deadline" in str(error)
        assert await ferry.lookup(keys(1)) == 0
        assert (await ferry.statistics()).stores_failed == 1


@attrs.define(eq=False)
class _EndsOnCue(ManualCopyEngine):
    """Copies end when the test says so: those submitted so far, and every later one."""

    ending: bool = False

    def submit(self, job: CopyJob) -> ManualCompletion:
        completion = super().submit(job)
        if self.ending:
            completion.fire()
        return completion

    def end_all(self) -> None:
        self.ending = True
        for completion in self.completions.values():
            completion.fire()


def _release_stores(ferry: Ferry, engine: ManualCopyEngine) -> None:
    """Only when a test has failed: end the stores still waiting (shielded, they would
    hang the test), so that the failure is reported."""
    for completion in engine.completions.values():
        completion.fire()
    assert ferry._store is not None
    cell = ferry._store._cell
    queued = [m for m, _, _ in cell.mailbox._items] + [p.item[0] for p in cell.mailbox._parked]
    notifies = list(cell.actor._notify.values())  # type: ignore[attr-defined]
    notifies += [m.notify for m in queued if isinstance(m, SubmitJob) and m.notify is not None]
    for notify in notifies:
        notify.fail(RuntimeError("released by the test"))
    for other in ferry.system._cells:
        other.close(drain=False)


async def test_many_concurrent_stores_all_end_once_their_copies_end() -> None:
    # More than the watcher's mailbox (64) and the store actor's (1024) hold together:
    # neither may wait for room in the other's.
    stores = 1200
    engine = _EndsOnCue()
    ended: list[int | BaseException] = []
    all_ended = anyio.Event()
    released = False
    try:
        async with Ferry(
            kv_caches(),
            num_blocks=NUM_BLOCKS,
            cpu_bytes_to_use=stores * 4096 * 2,
            copy_engine=lambda _l, _p: engine,
        ) as ferry:
            assert ferry.num_slots >= stores

            async def store(n: int) -> None:
                try:
                    ended.append(await ferry.store(keys(n), [n % NUM_BLOCKS]))
                except Exception as exc:
                    ended.append(exc)
                if len(ended) == stores:
                    all_ended.set()

            async with anyio.create_task_group() as tg:
                for n in range(stores):
                    tg.start_soon(store, n)
                await anyio.wait_all_tasks_blocked()  # both mailboxes full
                engine.end_all()
                with anyio.move_on_after(10):
                    await all_ended.wait()
                if not all_ended.is_set():
                    released = True
                    _release_stores(ferry, engine)
    except ActorCrashed:
        if not released:
            raise
    assert not released, f"{stores - len(ended)} of {stores} stores never returned"
    assert ended == [1] * stores


async def test_stores_waiting_when_the_ferry_is_left_end_with_actor_stopped() -> None:
    stores = 80  # more than the watcher's mailbox holds
    engine = ManualCopyEngine()  # copies that never end
    outcomes: list[int | BaseException] = []
    all_ended = anyio.Event()
    released = False
    async with anyio.create_task_group() as server:  # the server's request handlers
        async with Ferry(
            kv_caches(),
            num_blocks=NUM_BLOCKS,
            cpu_bytes_to_use=stores * 4096 * 2,
            copy_engine=lambda _l, _p: engine,
            stop_timeout_s=0.1,
        ) as ferry:

            async def store(n: int) -> None:
                try:
                    outcomes.append(await ferry.store(keys(n), [n % NUM_BLOCKS]))
                except Exception as exc:
                    outcomes.append(exc)
                if len(outcomes) == stores:
                    all_ended.set()

            for n in range(stores):
                server.start_soon(store, n)
            await anyio.wait_all_tasks_blocked()  # every store waits for its copy
        # Left without an ActorCrashed: the watcher's stop did not break its owner.
        with anyio.move_on_after(5):
            await all_ended.wait()
        if not all_ended.is_set():
            released = True
            _release_stores(ferry, engine)
        for completion in engine.completions.values():
            completion.fire()  # lets the abandoned waiter thread end
    assert not released, f"{stores - len(outcomes)} of {stores} stores never ended"
    assert all(isinstance(o, ActorStopped) for o in outcomes), outcomes


class _SaysWhenLoading(ManualCopyEngine):
    def __init__(self) -> None:
        super().__init__()
        self.loading = anyio.Event()

    def submit(self, job: CopyJob) -> ManualCompletion:
        completion = super().submit(job)
        if job.direction == "load":
            self.loading.set()  # on the loop's thread: the load actor's
        return completion


async def test_a_load_in_flight_when_the_ferry_is_left_ends_with_its_copy() -> None:
    """A graceful exit lets the copies of the stores and loads waited on end: a load
    returns (or raises) only once its copy no longer writes the caller's blocks."""
    engine = _SaysWhenLoading()
    outcome: list[object] = []
    async with anyio.create_task_group() as server:  # the server's request handlers
        async with Ferry(
            kv_caches(),
            num_blocks=NUM_BLOCKS,
            cpu_bytes_to_use=1 << 20,
            copy_engine=lambda _l, _p: engine,
        ) as ferry:

            async def store_then_load() -> None:
                await ferry.store(keys(1), [1])
                try:
                    await ferry.load(keys(1), [2])
                    outcome.append("loaded")
                except Exception as exc:
                    outcome.append(exc)

            server.start_soon(store_then_load)
            await anyio.wait_all_tasks_blocked()
            [store] = engine.submitted
            engine.completions[store.job_id].fire()
            await engine.loading.wait()
            [_, load] = engine.submitted

            async def watch_the_exit() -> None:
                await anyio.wait_all_tasks_blocked()  # the Ferry is stopping, the copy runs
                outcome.append("copy ended")
                engine.completions[load.job_id].fire()

            server.start_soon(watch_the_exit)
        # Left while the load's copy still writes block 2.
    assert outcome == ["copy ended", "loaded"]
