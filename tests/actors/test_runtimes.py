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
    ActorStatistics,
    ActorStopped,
    ActorSystem,
    Reply,
    ShutdownReport,
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


# -- deliveries waiting for room ---------------------------------------------------------
# A delivery to a full mailbox waits for room in a task of its own, never in the call
# server. The defects these pin were hangs: each test runs the calls that hung in a
# thread of its own and bounds the wait for it.


def _bounded(fn: Callable[[], object], timeout: float = 5.0) -> object:
    """``fn()`` in a daemon thread; its result, or fail if it has not returned in time."""
    out: list[object] = []
    done = threading.Event()

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # handed to the test
            out.append(exc)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(timeout), f"{fn} still running after {timeout} s"
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def _fill_and_abandon(runtime: SteppedRuntime | ThreadRuntime, ref: ActorRef[Msg]) -> anyio.Event:
    """Hold ``ref`` in its handler, fill its mailbox (2), then ask it and give up."""
    gate = runtime.call(_make_event)  # set by the caller, when it wants
    for _ in range(3):  # one in the handler, two queued
        runtime.tell(ref, Block(gate=gate))
    with pytest.raises(TimeoutError):
        runtime.ask(ref, Get, timeout=0.05)  # handed to the call server: it waits for room
    return gate


async def spawn_two(system: ActorSystem) -> tuple[ActorRef[Msg], ActorRef[Msg]]:
    stuck = await system.spawn(Counter(), name="stuck")
    healthy = await system.spawn(Counter(), name="healthy")
    return stuck, healthy


@pytest.mark.parametrize("kind", KINDS)
def test_a_delivery_waiting_for_room_does_not_hold_up_other_calls(kind: str) -> None:
    runtime, (stuck, healthy) = start_runtime(kind, spawn_two, stop_timeout_s=0.5)
    gate = _fill_and_abandon(runtime, stuck)

    def others() -> int:
        assert runtime.call(_double, 21) == 42  # a call the server runs
        for _ in range(6):  # more than its mailbox holds: the stepped tells wait for room
            runtime.tell(healthy, Add(n=1))
        return runtime.ask(healthy, Get)

    assert _bounded(others) == 6
    runtime.call(_set, gate)
    assert runtime.close().clean


async def _settled_statistics(ref: ActorRef[Msg]) -> ActorStatistics:
    await anyio.wait_all_tasks_blocked()
    return ref.statistics()


@pytest.mark.parametrize("kind", KINDS)
def test_an_abandoned_ask_waiting_for_room_is_withdrawn(kind: str) -> None:
    runtime, ref = start_runtime(kind, spawn_counter, stop_timeout_s=0.5)
    gate = _fill_and_abandon(runtime, ref)
    stats = _bounded(lambda: runtime.call(_settled_statistics, ref))
    assert stats.senders_waiting == 0  # type: ignore[attr-defined]
    runtime.call(_set, gate)
    assert runtime.ask(ref, Get) == 0
    stats = ref.statistics()
    assert (stats.messages_handled, stats.messages_dropped) == (4, 0)  # three Blocks, a Get
    assert runtime.close().clean


@pytest.mark.parametrize("kind", KINDS)
def test_close_is_bounded_after_an_ask_timed_out_on_a_full_mailbox(kind: str) -> None:
    runtime, ref = start_runtime(kind, spawn_counter, stop_timeout_s=0.2)
    _fill_and_abandon(runtime, ref)  # its gate is never set: the actor stays stuck
    report = _bounded(runtime.close)
    assert report == ShutdownReport(timed_out=("counter",))


def _tell_waiting_for_room(
    runtime: ThreadRuntime, ref: ActorRef[Msg], msg: Msg
) -> tuple[threading.Thread, list[BaseException | None]]:
    """``runtime.tell(ref, msg)`` from a thread of its own, returned once the tell waits
    for room in the full mailbox (in a delivery task); its outcome (None: delivered) is
    appended to the list when it ends."""
    outcome: list[BaseException | None] = []

    def teller() -> None:
        try:
            runtime.tell(ref, msg)
        except ActorStopped as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=teller, daemon=True)
    thread.start()

    async def wait_parked() -> None:
        while not ref.statistics().senders_waiting:
            await anyio.wait_all_tasks_blocked()

    _bounded(lambda: runtime.call(wait_parked))
    return thread, outcome


def test_close_fails_a_tell_still_waiting_for_room() -> None:
    runtime, ref = start_runtime("thread", spawn_counter, stop_timeout_s=0.2)
    gate = runtime.call(_make_event)  # never set
    for _ in range(3):
        runtime.tell(ref, Block(gate=gate))
    thread, outcome = _tell_waiting_for_room(runtime, ref, Add(n=1))
    report = _bounded(runtime.close)
    thread.join(5.0)
    assert report == ShutdownReport(timed_out=("counter",))
    assert len(outcome) == 1 and isinstance(outcome[0], ActorStopped)


class _SeesQueued(ThreadRuntime):
    """A thread runtime that says when a call of ``_set``, and when ``close``'s marker,
    has been queued for its loop."""

    def __init__(self, *, stop_timeout_s: float) -> None:
        super().__init__(stop_timeout_s=stop_timeout_s)
        self.set_queued = threading.Event()
        self.close_queued = threading.Event()

    def _post(self, item: object) -> None:
        super()._post(item)  # type: ignore[arg-type]
        if item is None:
            self.close_queued.set()
        elif getattr(item, "fn", None) is _set:
            self.set_queued.set()


def test_a_tell_the_actor_takes_in_as_the_runtime_closes_is_delivered() -> None:
    """A tell waiting for room is let in by its actor on the very loop turn that cancels
    the deliveries still waiting (close): it is handled, so its caller must not hear
    ActorStopped ("not delivered")."""
    actor = Counter()  # a mailbox of 2

    async def setup(system: ActorSystem) -> ActorRef[Msg]:
        return await system.spawn(actor, name="counter")

    runtime = _SeesQueued(stop_timeout_s=5.0)  # asyncio: the loop's order is deterministic
    ref = runtime.start(setup)
    gate = runtime.call(_make_event)
    runtime.tell(ref, Block(gate=gate))
    runtime.tell(ref, Add(n=1))
    runtime.tell(ref, Add(n=2))  # queued behind the Block: the mailbox is full
    thread, outcome = _tell_waiting_for_room(runtime, ref, Add(n=4))
    holding = threading.Event()

    async def hold_the_loop() -> None:
        """Blocks the loop thread until the gate's call and then the close marker are
        queued, so that the call server takes both on one turn: it sets the gate (the
        actor is woken first), then cancels the deliveries still waiting."""
        holding.set()
        assert runtime.close_queued.wait(5.0)

    holder = threading.Thread(target=lambda: runtime.call(hold_the_loop), daemon=True)
    holder.start()
    assert holding.wait(5.0)
    opener = threading.Thread(target=lambda: runtime.call(_set, gate), daemon=True)
    opener.start()
    assert runtime.set_queued.wait(5.0)
    report = _bounded(runtime.close)
    for t in (thread, holder, opener):
        t.join(5.0)
    assert report == ShutdownReport()
    assert actor.seen == [1, 2, 4]  # handled, while the system drained
    assert outcome == [None]
