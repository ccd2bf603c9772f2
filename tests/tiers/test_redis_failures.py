"""A Redis server killed under traffic and restarted: every operation ends within its
timeout as a miss or a dropped store, the breaker opens, and service comes back by
itself once the server is back (the breaker's clock is stepped, not slept on)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from kvferry.tiers import CircuitBreaker, Outcome, RedisStore

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
