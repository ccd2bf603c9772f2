"""A Redis server killed under traffic and restarted: every operation ends within its
timeout as a miss or a dropped store, the breaker opens, and service comes back by
itself once the server is back (the breaker's clock is stepped, not slept on). A server
that answers the breaker's probe late, then holds the operation: the probe's time is the
operation's, so the operation, and its job, still end in time (the event loop's clock
moved by hand)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from kvferry.actors import ActorSystem, Reply
from kvferry.tiers import (
    CircuitBreaker,
    DiskJobResult,
    Outcome,
    RedisIOActor,
    RedisStore,
    WriteChunks,
    keys_array,
)
from kvferry.tiers._breaker import Admission

from .conftest import FP, key, payload
from .redis_servers import RedisServer

OP_TIMEOUT_S = 0.5
SLACK_S = 0.5  # scheduling on a loaded machine, beyond the timeout
MISSES = {Outcome.IO_ERROR, Outcome.TIMEOUT, Outcome.UNAVAILABLE}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.anyio
async def test_a_server_killed_under_traffic_opens_the_breaker_and_recovers(
    tmp_path: Path,
) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start()
    clock = Clock()
    breaker = CircuitBreaker(threshold=3, cooldown_s=10, clock=clock)
    store = RedisStore(
        url=server.url,
        fingerprint=FP,
        op_timeout_s=OP_TIMEOUT_S,
        connect_timeout_s=OP_TIMEOUT_S,
        breaker=breaker,
    )
    await store.connect()
    n = 32 << 10
    ops_before_kill = anyio.Event()
    killed = anyio.Event()
    after_kill: list[tuple[float, set[int]]] = []
    done_before = 0

    async def traffic(worker: int) -> None:
        nonlocal done_before
        i = 0
        while True:
            k = [key(1000 * worker + i)]
            start = anyio.current_time()
            wrote = await store.write(k, [payload(i, n)])
            read = await store.read(k, [np.zeros(n, np.uint8)])
            seen = set(wrote.tolist()) | set(read.tolist())
            if killed.is_set():
                after_kill.append((anyio.current_time() - start, seen))
                if seen == {Outcome.UNAVAILABLE}:
                    return  # the breaker is open: nothing is sent any more
            else:
                assert seen == {Outcome.OK}
                done_before += 1
                if done_before >= 8:
                    ops_before_kill.set()
            i += 1
            await anyio.lowlevel.checkpoint()  # let the other workers interleave

    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for w in range(4):
                    tg.start_soon(traffic, w)
                await ops_before_kill.wait()
                server.kill()
                killed.set()
        assert after_kill and all(seen <= MISSES | {Outcome.OK} for _, seen in after_kill)
        # a write and a read, each ends within its timeout
        assert max(t for t, _ in after_kill) < 2 * OP_TIMEOUT_S + SLACK_S
        stats = store.statistics()
        assert breaker.state == "open" and stats.breaker.opens == 1
        assert stats.errors + stats.timeouts >= 3 and stats.breaker.rejected > 0
        assert dict(stats.writes_skipped_by_outcome).get("UNAVAILABLE", 0) > 0

        server.start()  # back on the same port, empty (nothing persisted)
        assert list(await store.write([key(1)], [payload(1, n)])) == [Outcome.UNAVAILABLE]
        clock.now += 10  # the cool-down is over: the next operation probes first
        assert list(await store.write([key(1)], [payload(1, n)])) == [Outcome.OK]
        assert breaker.state == "closed"
        into = np.zeros(n, np.uint8)
        assert list(await store.read([key(1)], [into])) == [Outcome.OK]
        assert np.array_equal(into, payload(1, n))
    finally:
        await store.aclose()
        server.kill()


@pytest.mark.anyio
async def test_a_failed_probe_keeps_the_breaker_open(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start()
    clock = Clock()
    breaker = CircuitBreaker(threshold=1, cooldown_s=5, clock=clock)
    store = RedisStore(url=server.url, fingerprint=FP, op_timeout_s=OP_TIMEOUT_S, breaker=breaker)
    await store.connect()
    try:
        server.kill()
        assert list(await store.exists([key(1)])) == [False]
        assert breaker.state == "open"
        clock.now += 5
        assert list(await store.read([key(1)], [np.zeros(8, np.uint8)])) == [Outcome.UNAVAILABLE]
        assert breaker.state == "open" and breaker.statistics().opens == 2
    finally:
        await store.aclose()


@pytest.mark.anyio
async def test_a_probe_its_caller_gave_up_on_counts_as_failed(tmp_path: Path) -> None:
    """A caller that gives up (its own deadline, a task group cancelled) while its
    operation probes the server: the breaker opens for another cool-down, then probes
    again. Left half-open, it would reject every operation for good."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    assert server.proc is not None
    clock = Clock()
    breaker = CircuitBreaker(threshold=1, cooldown_s=5, clock=clock)
    store = RedisStore(url=server.url, fingerprint=FP, op_timeout_s=30, breaker=breaker)
    await store.connect()
    try:
        breaker.failed()  # an earlier outage opened it
        clock.now += 5  # the cool-down is over: the next operation probes first
        os.kill(server.proc.pid, signal.SIGSTOP)  # alive, answers nothing: the probe waits
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(store.read, [key(1)], [np.zeros(8, np.uint8)])
                await anyio.wait_all_tasks_blocked()
                assert breaker.state == "half_open"  # its probe is out
                tg.cancel_scope.cancel()  # the caller gives up
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert breaker.state == "open" and breaker.statistics().opens == 2
        clock.now += 5
        assert list(await store.write([key(1)], [payload(1)])) == [Outcome.OK]
        assert breaker.state == "closed"
    finally:
        await store.aclose()
        server.kill()


# -- the probe after a cool-down shares its operation's time ------------------------------

SLOW_T = 8.0
"""The job's and the operation's timeout in the tests below, in seconds of the loop's
clock, which they move ahead by hand: only the margins left to scheduling are real."""


@contextlib.contextmanager
def _loop_clock_moved_by_hand() -> Iterator[Callable[[float], None]]:
    """The running event loop's clock (anyio's and asyncio's: cancel scopes, the actors'
    timers and deadlines, the client's socket timeouts) made ``real + skew``; yields
    ``advance(s)``, which adds ``s`` to the skew. Restored on exit: leave nothing waiting
    on that clock by then."""
    loop = asyncio.get_running_loop()
    real = loop.time
    skew = [0.0]

    def advance(seconds: float) -> None:
        skew[0] += seconds

    loop.time = lambda: real() + skew[0]  # type: ignore[method-assign]
    try:
        yield advance
    finally:
        del loop.time  # the class's again


class _ReportsProbes(CircuitBreaker):
    """A breaker that says when it asked for a probe (``probing``) and when the probe's
    outcome was reported (``answered``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.probing = anyio.Event()
        self.answered = anyio.Event()

    def begin(self) -> Admission:
        admission = super().begin()
        if admission == "probe":
            self.probing.set()
        return admission

    def probed(self, ok: bool) -> None:
        super().probed(ok)
        self.answered.set()


async def _slow_probe_then_hang(
    server: RedisServer,
    breaker: _ReportsProbes,
    clock: Clock,
    advance: Callable[[float], None],
    send: Callable[[], Awaitable[None]],
) -> None:
    """An outage opened ``breaker`` and its cool-down is over; ``send()`` starts an
    operation of writes, which probes first. The server answers the probe's PING half of
    ``SLOW_T`` later (stopped meanwhile), then holds the writes (``CLIENT PAUSE WRITE``:
    alive, reads answered, writes never): the loop's clock is then ``SLOW_T`` and a
    tenth past the operation's start."""
    assert server.proc is not None
    breaker.failed()  # an outage opened it
    clock.now += breaker.cooldown_s  # its cool-down is over: the next operation probes
    server.cli("client", "pause", "600000", "write")
    os.kill(server.proc.pid, signal.SIGSTOP)  # alive, answers nothing
    try:
        await send()
        with anyio.fail_after(SLOW_T):
            await breaker.probing.wait()  # its PING goes to a server that answers nothing
        advance(SLOW_T / 2)  # which answers it half the operation's time later
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    with anyio.fail_after(SLOW_T):
        await breaker.answered.wait()
    assert breaker.state == "closed"  # the probe was answered: the writes are sent
    advance(SLOW_T / 2 + SLOW_T / 10)


@pytest.mark.anyio
async def test_a_write_after_the_cooldown_ends_within_op_timeout_when_the_probe_was_slow(
    tmp_path: Path,
) -> None:
    """``op_timeout_s`` bounds the whole operation, the breaker's probe included: a probe
    answered late leaves its writes what remains, not another ``op_timeout_s``."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    clock = Clock()
    breaker = _ReportsProbes(threshold=1, cooldown_s=5, clock=clock)
    store = RedisStore(url=server.url, fingerprint=FP, op_timeout_s=SLOW_T, breaker=breaker)
    await store.connect()
    wrote: list[list[int]] = []
    ended = anyio.Event()
    try:
        with _loop_clock_moved_by_hand() as advance:
            try:
                async with anyio.create_task_group() as tg:

                    async def write() -> None:
                        wrote.append((await store.write([key(1)], [payload(1)])).tolist())
                        ended.set()

                    async def send() -> None:
                        tg.start_soon(write)

                    start = anyio.current_time()
                    await _slow_probe_then_hang(server, breaker, clock, advance, send)
                    with anyio.move_on_after(SLOW_T):  # the bug ends it at 1.5 x SLOW_T
                        await ended.wait()
                    took = anyio.current_time() - start
                    tg.cancel_scope.cancel()
            finally:
                await store.aclose()
    finally:
        server.kill()
    assert wrote == [[Outcome.TIMEOUT]]
    assert took < 1.3 * SLOW_T  # SLOW_T and a tenth on the loop's clock, then scheduling


@pytest.mark.anyio
async def test_a_job_sent_after_the_cooldown_ends_by_its_deadline_when_the_probe_was_slow(
    tmp_path: Path,
) -> None:
    """A Redis job ends within ``job_timeout_s`` of its arrival, whoever sends its
    batch's probe: one answered late leaves the batch what remains of the job's time."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    clock = Clock()
    breaker = _ReportsProbes(threshold=1, cooldown_s=5, clock=clock)
    store = RedisStore(url=server.url, fingerprint=FP, op_timeout_s=60, breaker=breaker)
    await store.connect()
    slots = np.random.default_rng(5).integers(0, 256, (4, 4096), dtype=np.uint8)
    done: Reply[DiskJobResult] = Reply()
    result: DiskJobResult | None = None
    try:
        with _loop_clock_moved_by_hand() as advance:
            try:
                async with ActorSystem() as system:
                    ref = await system.spawn(
                        RedisIOActor(store, slots, io_depth=1, job_timeout_s=SLOW_T)
                    )
                    keys = keys_array([key(1), key(2)])

                    async def send() -> None:
                        await ref.tell(WriteChunks(job_id=1, keys=keys, slots=[0, 1], notify=done))

                    start = anyio.current_time()
                    await _slow_probe_then_hang(server, breaker, clock, advance, send)
                    with anyio.move_on_after(SLOW_T):  # the bug ends it at 1.5 x SLOW_T
                        result = await done.wait()
                    took = anyio.current_time() - start
            finally:
                await store.aclose()
    finally:
        server.kill()
    assert result is not None and result.outcomes.tolist() == [Outcome.TIMEOUT] * 2
    assert took < 1.3 * SLOW_T  # its deadline, SLOW_T, passed by a tenth; then scheduling
