"""What an actor hop costs, against the bare anyio primitive it is built on.

Run with the project's venv: ``.venv/bin/python benchmarks/actors.py [--quick]``.
Prints a table, then (last line) one JSON object:

- ``tell_vs_raw_stream``: messages/s through an actor ÷ messages/s through a bare anyio
  memory-object stream pair doing the same work (target ≥ 0.5);
- ``ask_vs_raw_roundtrip``: ask round trip ÷ a bare request/response over two anyio
  streams (target ≤ 2.0);
- ``sync_call_us_stepped`` / ``sync_call_us_thread``: median µs of one sync-facade call
  (``runtime.call(ref.ask, Get)``) to an actor that replies at once (targets ≤ 20 / ≤ 40),
  the median over trials of each trial's median; the spread over trials (min / median /
  max) is printed below the table and given as ``*_spread``;
- ``sync_call_us_stepped_now``: the same stepped call to an actor that names ``Get``
  ``immediate`` (handled on the calling thread, without a loop iteration), against the
  stepped call above;
- ``sync_call_us_thread_now``: the same thread-runtime call to that actor (handled in the
  loop thread's callback that receives it, without a turn of the actor's task), against
  the thread call above;
- the floors under any thread runtime, measured the same way: ``thread_wake_floor_us``,
  one round trip between two bare threads (the caller releases a lock the other waits
  on, and waits on a lock the other releases: two thread wake-ups, nothing else), and
  ``loop_roundtrip_us``, one round trip to a bare asyncio loop thread
  (``loop.call_soon_threadsafe`` of a lock's release: the wake-up every call to an
  asyncio loop on another thread takes). ``sync_call_thread_vs_loop_roundtrip`` is the
  thread call against the second.

Every figure is measured in this run, each against its baseline in the same process;
trials alternate between the two sides so that a noisy neighbour hits both alike.
"""

from __future__ import annotations

import asyncio
import gc
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeAlias

import anyio
import anyio.from_thread
import attrs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvferry.actors import Actor, ActorSystem, Reply, SteppedRuntime, ThreadRuntime  # noqa: E402

QUICK = "--quick" in sys.argv
TRIALS = 3 if QUICK else 7
N_TELL = 5_000 if QUICK else 20_000
N_ASK = 2_000 if QUICK else 5_000
N_CALL = 1_000 if QUICK else 4_000


@attrs.frozen(kw_only=True)
class Add:
    n: int


@attrs.frozen(kw_only=True)
class Get:
    reply: Reply[int] = attrs.field(eq=False, repr=False)


Msg: TypeAlias = Add | Get


class Counter(Actor[Msg]):
    mailbox_size = 64

    def __init__(self) -> None:
        self.total = 0

    async def handle(self, msg: Msg) -> None:
        match msg:
            case Add(n=n):
                self.total += n
            case Get(reply=reply):
                reply.set(self.total)


class NowCounter(Counter):
    """Counter whose messages never await: the stepped runtime may handle them now."""

    immediate = frozenset({Add, Get})

    async def handle(self, msg: Msg) -> None:
        self.handle_now(msg)

    def handle_now(self, msg: Msg) -> None:
        match msg:
            case Add(n=n):
                self.total += n
            case Get(reply=reply):
                reply.set(self.total)


# -- async figures ---------------------------------------------------------------------


async def raw_stream_rate(n: int) -> float:
    send, recv = anyio.create_memory_object_stream[Add](64)
    total = 0

    async def consumer() -> None:
        nonlocal total
        async with recv:
            async for msg in recv:
                total += msg.n

    gc.collect()
    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(consumer)
        async with send:
            for _ in range(n):
                await send.send(Add(n=1))
    dt = time.perf_counter() - t0
    assert total == n
    return n / dt


async def actor_tell_rate(n: int) -> float:
    async with ActorSystem() as system:
        ref = await system.spawn(Counter())
        gc.collect()
        t0 = time.perf_counter()
        for _ in range(n):
            await ref.tell(Add(n=1))
        total = await ref.ask(Get)  # the last tell has been handled
        dt = time.perf_counter() - t0
    assert total == n
    return n / dt


async def raw_roundtrip_us(n: int) -> float:
    req_send, req_recv = anyio.create_memory_object_stream[int](1)
    resp_send, resp_recv = anyio.create_memory_object_stream[int](1)
    total = 0

    async def server() -> None:
        async with req_recv, resp_send:
            async for value in req_recv:
                await resp_send.send(total + value)

    async with anyio.create_task_group() as tg:
        tg.start_soon(server)
        gc.collect()
        t0 = time.perf_counter()
        for _ in range(n):
            await req_send.send(0)
            await resp_recv.receive()
        dt = time.perf_counter() - t0
        await req_send.aclose()
    return dt / n * 1e6


async def actor_ask_us(n: int) -> float:
    async with ActorSystem() as system:
        ref = await system.spawn(Counter())
        gc.collect()
        t0 = time.perf_counter()
        for _ in range(n):
            await ref.ask(Get)
        dt = time.perf_counter() - t0
    return dt / n * 1e6


# -- sync facade figures ---------------------------------------------------------------


async def _spawn_counter(system: ActorSystem):  # type: ignore[no-untyped-def]
    return await system.spawn(Counter())


def _median_call_us(call: Callable[[], object], n: int) -> float:
    for _ in range(50):
        call()
    gc.collect()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        call()
        samples.append(clock() - t0)
    return statistics.median(samples) / 1e3


def stepped_call_us(n: int) -> float:
    runtime = SteppedRuntime()
    ref = runtime.start(_spawn_counter)
    try:
        return _median_call_us(lambda: runtime.call(ref.ask, Get), n)
    finally:
        runtime.close()


async def _spawn_now_counter(system: ActorSystem):  # type: ignore[no-untyped-def]
    return await system.spawn(NowCounter())


def now_call_us(runtime: SteppedRuntime | ThreadRuntime, n: int) -> float:
    """The sync call to an actor that names ``Get`` immediate, on ``runtime``."""
    ref = runtime.start(_spawn_now_counter)
    try:
        us = _median_call_us(lambda: runtime.call(ref.ask, Get), n)
        if runtime.handled_now < n:
            raise SystemExit(f"only {runtime.handled_now} of {n} calls were handled now")
        return us
    finally:
        runtime.close()


def run_until_complete_call_us(n: int) -> float:
    """Baseline: the previous stepped runtime, ``loop.run_until_complete`` per call."""
    loop = asyncio.new_event_loop()
    box: dict[str, object] = {}

    async def host() -> None:
        box["stop"] = stop = asyncio.Event()
        async with ActorSystem() as system:
            box["ref"] = await system.spawn(Counter())
            await stop.wait()

    task = loop.create_task(host())
    while "ref" not in box:
        loop.run_until_complete(asyncio.sleep(0))
    ref = box["ref"]
    try:
        return _median_call_us(lambda: loop.run_until_complete(ref.ask(Get)), n)  # type: ignore[attr-defined]
    finally:
        box["stop"].set()  # type: ignore[attr-defined]
        loop.run_until_complete(task)
        loop.close()


def thread_call_us(n: int) -> float:
    runtime = ThreadRuntime()
    ref = runtime.start(_spawn_counter)
    try:
        return _median_call_us(lambda: runtime.call(ref.ask, Get), n)
    finally:
        runtime.close()


def portal_call_us(n: int) -> float:
    """Baseline: anyio's BlockingPortal.call, the previous thread runtime."""
    with anyio.from_thread.start_blocking_portal() as portal:
        cm = portal.wrap_async_context_manager(ActorSystem())
        system = cm.__enter__()
        try:
            ref = portal.call(_spawn_counter, system)
            return _median_call_us(lambda: portal.call(ref.ask, Get), n)
        finally:
            cm.__exit__(None, None, None)


def thread_wake_floor_us(n: int) -> float:
    """Floor: two bare threads, one wake-up each way (a lock released, a lock waited on)."""
    go, back = threading.Lock(), threading.Lock()
    go.acquire()
    back.acquire()
    stop = False

    def answer() -> None:
        while True:
            go.acquire()
            if stop:
                return
            back.release()

    def call() -> None:
        go.release()
        back.acquire()

    other = threading.Thread(target=answer, name="floor-answer")
    other.start()
    try:
        return _median_call_us(call, n)
    finally:
        stop = True
        go.release()
        other.join()


def loop_roundtrip_us(n: int) -> float:
    """Floor: a bare asyncio loop on another thread, woken by ``call_soon_threadsafe``."""
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, name="floor-loop")
    runner.start()
    back = threading.Lock()
    back.acquire()
    schedule, release = loop.call_soon_threadsafe, back.release

    def call() -> None:
        schedule(release)
        back.acquire()

    try:
        return _median_call_us(call, n)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join()
        loop.close()


def spread(values: list[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


def main() -> None:
    raw_rates, tell_rates, raw_rt, ask_rt = [], [], [], []
    for _ in range(TRIALS):  # alternate, so both sides see the same background load
        raw_rates.append(anyio.run(raw_stream_rate, N_TELL))
        tell_rates.append(anyio.run(actor_tell_rate, N_TELL))
        raw_rt.append(anyio.run(raw_roundtrip_us, N_ASK))
        ask_rt.append(anyio.run(actor_ask_us, N_ASK))
    raw_rate, tell_rate = statistics.median(raw_rates), statistics.median(tell_rates)
    raw_us, ask_us = statistics.median(raw_rt), statistics.median(ask_rt)

    stepped, now, rtc, thread, thread_now, portal = [], [], [], [], [], []
    wake, loop_rt = [], []
    for _ in range(TRIALS):
        wake.append(thread_wake_floor_us(N_CALL))
        loop_rt.append(loop_roundtrip_us(N_CALL))
        stepped.append(stepped_call_us(N_CALL))
        now.append(now_call_us(SteppedRuntime(), N_CALL))
        rtc.append(run_until_complete_call_us(N_CALL))
        thread.append(thread_call_us(N_CALL))
        thread_now.append(now_call_us(ThreadRuntime(), N_CALL))
        portal.append(portal_call_us(N_CALL))
    stepped_us, rtc_us = statistics.median(stepped), statistics.median(rtc)
    now_us = statistics.median(now)
    thread_us, portal_us = statistics.median(thread), statistics.median(portal)
    thread_now_us = statistics.median(thread_now)
    wake_us, loop_us = statistics.median(wake), statistics.median(loop_rt)

    rows = [
        (
            "tell throughput",
            f"{tell_rate:,.0f} msg/s",
            f"{raw_rate:,.0f} msg/s (raw stream)",
            f"{tell_rate / raw_rate:.2f}",
            "≥ 0.5",
        ),
        (
            "ask round trip",
            f"{ask_us:.1f} µs",
            f"{raw_us:.1f} µs (raw req/resp)",
            f"{ask_us / raw_us:.2f}",
            "≤ 2.0",
        ),
        (
            "sync call, stepped",
            f"{stepped_us:.1f} µs",
            f"{rtc_us:.1f} µs (run_until_complete)",
            f"{stepped_us / rtc_us:.2f}",
            "≤ 20 µs",
        ),
        (
            "sync call, stepped, handled now",
            f"{now_us:.1f} µs",
            f"{stepped_us:.1f} µs (stepped, queued)",
            f"{now_us / stepped_us:.2f}",
            "",
        ),
        (
            "sync call, thread",
            f"{thread_us:.1f} µs",
            f"{portal_us:.1f} µs (BlockingPortal)",
            f"{thread_us / portal_us:.2f}",
            "≤ 40 µs",
        ),
        (
            "sync call, thread, handled now",
            f"{thread_now_us:.1f} µs",
            f"{thread_us:.1f} µs (thread, queued)",
            f"{thread_now_us / thread_us:.2f}",
            "",
        ),
        (
            "sync call, thread (floor)",
            f"{thread_us:.1f} µs",
            f"{loop_us:.1f} µs (bare loop round trip)",
            f"{thread_us / loop_us:.2f}",
            "",
        ),
        (
            "bare loop round trip",
            f"{loop_us:.1f} µs",
            f"{wake_us:.1f} µs (two bare threads)",
            f"{loop_us / wake_us:.2f}",
            "",
        ),
    ]
    head = ("figure", "kvferry", "baseline", "ratio", "target")
    widths = [max(len(r[i]) for r in [*rows, head]) for i in range(len(head))]
    py = sys.version.split()[0]
    print(f"kvferry actors benchmark ({TRIALS} trials each, medians; python {py})")
    for r in [head, tuple("-" * w for w in widths), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    print(f"spread over {TRIALS} trials (min / median / max of each trial's median, µs):")
    for name, values in (
        ("stepped", stepped),
        ("stepped, handled now", now),
        ("run_until_complete", rtc),
        ("thread", thread),
        ("thread, handled now", thread_now),
        ("BlockingPortal", portal),
        ("bare loop round trip", loop_rt),
        ("two bare threads", wake),
    ):
        print(f"  {name:<20} {' / '.join(f'{v:.1f}' for v in spread(values))}")
    print(
        json.dumps(
            {
                "tell_vs_raw_stream": round(tell_rate / raw_rate, 3),
                "ask_vs_raw_roundtrip": round(ask_us / raw_us, 3),
                "sync_call_us_stepped": round(stepped_us, 2),
                "sync_call_us_thread": round(thread_us, 2),
                "sync_call_us_stepped_now": round(now_us, 2),
                "sync_call_us_thread_now": round(thread_now_us, 2),
                "sync_call_us_stepped_spread": [round(v, 2) for v in spread(stepped)],
                "sync_call_us_thread_spread": [round(v, 2) for v in spread(thread)],
                "sync_call_us_thread_now_spread": [round(v, 2) for v in spread(thread_now)],
                "thread_wake_floor_us": round(wake_us, 2),
                "thread_wake_floor_us_spread": [round(v, 2) for v in spread(wake)],
                "loop_roundtrip_us": round(loop_us, 2),
                "loop_roundtrip_us_spread": [round(v, 2) for v in spread(loop_rt)],
                "sync_call_thread_vs_loop_roundtrip": round(thread_us / loop_us, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
