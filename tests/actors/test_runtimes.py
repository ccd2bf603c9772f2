"""The sync runtimes: the same actors driven from synchronous code (vLLM's calls)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import anyio
import anyio.to_thread
import attrs
import pytest

from kvferry.actors import (
    Actor,
    ActorCrashed,
    ActorRef,
    ActorStopped,
    ActorSystem,
    Reply,
    SteppedRuntime,
    ThreadRuntime,
    start_runtime,
)

from ._actors import Add, AskBoom, Block, Boom, Counter, Get, Msg

KINDS = ["stepped", "thread"]


async def spawn_counter(system: ActorSystem) -> ActorRef[Msg]:
    return await system.spawn(Counter(), name="counter")


@pytest.fixture(params=KINDS)
def runtime_and_ref(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    runtime, ref = start_runtime(request.param, spawn_counter)
    yield runtime, ref
    runtime.close()


def test_a_sync_runtime_drives_the_same_actor(runtime_and_ref) -> None:  # type: ignore[no-untyped-def]
    runtime, ref = runtime_and_ref
    runtime.call(ref.tell, Add(n=7))
    assert runtime.call(ref.ask, Get) == 7
    assert runtime.ask(ref, Get) == 7
    runtime.tell(ref, Add(n=1))
    assert runtime.call(ref.ask, lambda r: Get(reply=r)) == 8


def test_a_sync_call_runs_any_coroutine_function(runtime_and_ref) -> None:  # type: ignore[no-untyped-def]
    runtime, ref = runtime_and_ref

    async def add_twice(n: int) -> int:
        await ref.tell(Add(n=n))
        await ref.tell(Add(n=n))
        return await ref.ask(Get)

    assert runtime.call(add_twice, 3) == 6


def test_a_sync_call_raises_what_the_handler_raised(runtime_and_ref) -> None:  # type: ignore[no-untyped-def]
    runtime, ref = runtime_and_ref
    with pytest.raises(ValueError, match="bad ask"):
        runtime.call(ref.ask, AskBoom)
    assert runtime.call(ref.ask, Get) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_sync_ask_times_out_and_is_withdrawn(kind: str) -> None:
    runtime, ref = start_runtime(kind, spawn_counter)
    try:
        gate = runtime.call(_make_event)
        runtime.tell(ref, Block(gate=gate))
        with pytest.raises(TimeoutError):
            runtime.ask(ref, AskBoom, timeout=0.05)
        runtime.call(_set, gate)
        assert runtime.call(ref.ask, Get) == 0
        stats = ref.statistics()
        assert (stats.failures, stats.messages_dropped) == (0, 1)
    finally:
        runtime.close()


async def _make_event() -> anyio.Event:
    return anyio.Event()


async def _set(event: anyio.Event) -> None:
    event.set()


@pytest.mark.parametrize("kind", KINDS)
def test_a_sync_tell_waits_while_the_mailbox_is_full(kind: str) -> None:
    runtime, ref = start_runtime(kind, spawn_counter)  # mailbox of 2
    try:
        for _ in range(20):  # far more than the mailbox holds: each tell waits for room
            runtime.call(ref.tell, Add(n=1))
        assert runtime.call(ref.ask, Get) == 20
    finally:
        runtime.close()


@pytest.mark.parametrize("kind", KINDS)
def test_after_an_escalation_every_call_raises_actor_crashed(kind: str) -> None:
    runtime, ref = start_runtime(kind, spawn_counter)  # 2 restarts per 60 s

    async def crash_three_times() -> None:
        for _ in range(3):
            await ref.tell(Boom())
        await runtime.system.wait_stopped()  # the escalation stops the system

    try:
        runtime.call(crash_three_times)
        with pytest.raises(ActorCrashed, match="counter"):
            runtime.call(ref.ask, Get)
    finally:
        report = runtime.close()
    assert report.crashed == ("counter",) and report.tasks_left == ()


@pytest.mark.parametrize("kind", KINDS)
def test_calls_after_close_raise_actor_stopped(kind: str) -> None:
    runtime, ref = start_runtime(kind, spawn_counter)
    runtime.close()
    with pytest.raises(ActorStopped):
        runtime.call(ref.ask, Get)


@pytest.mark.parametrize("kind", KINDS)
def test_a_failing_setup_fails_start_and_leaves_nothing_running(kind: str) -> None:
    async def setup(system: ActorSystem) -> None:
        await system.spawn(Counter())
        raise OSError("no host memory")

    before = set(threading.enumerate())
    with pytest.raises(OSError, match="no host memory"):
        start_runtime(kind, setup)
    assert {t for t in threading.enumerate() if t.is_alive()} <= before


@attrs.frozen(kw_only=True)
class Offload:
    """Handled by running ``work`` on a worker thread; ``entered`` is set once it runs."""

    work: Callable[[], int] = attrs.field(eq=False)
    entered: anyio.Event = attrs.field(eq=False)


@attrs.frozen(kw_only=True)
class Result:
    reply: Reply[int | None] = attrs.field(eq=False, repr=False)


class Offloader(Actor[Offload | Result]):
    def __init__(self) -> None:
        self.result: int | None = None

    async def handle(self, msg: Offload | Result) -> None:
        match msg:
            case Offload(work=work, entered=entered):
                entered.set()
                self.result = await anyio.to_thread.run_sync(work)
            case Result(reply=reply):
                reply.set(self.result)


def test_stepped_work_that_ends_between_calls_is_picked_up_by_the_next_call() -> None:
    async def setup(system: ActorSystem) -> ActorRef[Offload | Result]:
        return await system.spawn(Offloader())

    runtime = SteppedRuntime()
    ref = runtime.start(setup)
    go = threading.Event()
    try:

        async def start_offload() -> None:
            entered = anyio.Event()
            await ref.tell(Offload(work=lambda: go.wait(30) and 42, entered=entered))
            await entered.wait()

        runtime.call(start_offload)  # returns with the actor waiting for its thread
        go.set()  # the thread ends while the loop is not running
        assert runtime.call(ref.ask, Result) == 42
    finally:
        runtime.close()


def test_the_stepped_runtime_refuses_to_run_inside_a_running_loop() -> None:
    async def main() -> None:
        with pytest.raises(RuntimeError, match="running event loop"):
            SteppedRuntime().start(spawn_counter)

    anyio.run(main)


def test_auto_picks_stepped_on_a_plain_thread_and_thread_inside_a_loop() -> None:
    runtime, _ = start_runtime("auto", spawn_counter)
    runtime.close()
    assert isinstance(runtime, SteppedRuntime)

    async def main() -> type:
        runtime, ref = start_runtime("auto", spawn_counter)
        try:
            runtime.call(ref.tell, Add(n=1))
            assert runtime.call(ref.ask, Get) == 1
            return type(runtime)
        finally:
            runtime.close()

    assert anyio.run(main) is ThreadRuntime
    with pytest.raises(ValueError, match="unknown runtime kind"):
        start_runtime("fibers", spawn_counter)


def test_a_thread_runtime_serves_several_caller_threads() -> None:
    runtime, ref = start_runtime("thread", spawn_counter)
    try:

        def worker() -> None:
            for _ in range(50):
                runtime.call(ref.tell, Add(n=1))

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert runtime.call(ref.ask, Get) == 200
    finally:
        runtime.close()


def test_a_thread_runtime_on_trio_drives_the_same_actor() -> None:
    runtime = ThreadRuntime(backend="trio")
    ref = runtime.start(spawn_counter)
    try:
        runtime.call(ref.tell, Add(n=2))
        assert runtime.call(ref.ask, Get) == 2
    finally:
        assert runtime.close().clean


def test_the_stepped_runtime_steps_the_way_the_probe_chose(api_path: str) -> None:
    """Private: CPython's loop stepped through ``_run_once``; public: ``run_forever``."""
    runtime = SteppedRuntime()
    ref = runtime.start(spawn_counter)
    assert runtime._stepper is not None
    assert runtime._stepper.path == ("run_once" if api_path == "private" else "run_forever")
    try:
        runtime.call(ref.tell, Add(n=3))
        assert runtime.call(ref.ask, Get) == 3
        with pytest.raises(TimeoutError):
            gate = runtime.call(_make_event)
            runtime.tell(ref, Block(gate=gate))
            runtime.ask(ref, Get, timeout=0.05)
        runtime.call(_set, gate)
        assert runtime.ask(ref, Get) == 3
    finally:
        assert runtime.close().clean


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_thread_runtime_wakes_its_loop_without_anyios_private_backend_api(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """anyio 4.11 to 4.15 have no ``run_sync_soon`` on their backend classes (issue 17)."""
    from anyio._backends import _asyncio, _trio

    for cls in (_asyncio.AsyncIOBackend, _trio.TrioBackend):
        monkeypatch.delattr(cls, "run_sync_soon", raising=False)
    runtime = ThreadRuntime(backend=backend)
    ref = runtime.start(spawn_counter)
    try:
        runtime.call(ref.tell, Add(n=2))
        assert runtime.call(ref.ask, Get) == 2
        assert runtime.call(_double, 21) == 42
    finally:
        assert runtime.close().clean


async def _double(n: int) -> int:
    return 2 * n
