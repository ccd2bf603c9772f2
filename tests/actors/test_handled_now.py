"""The sync runtimes' short way for an actor's ``immediate`` messages, taken only when
nothing is in the way: the stepped runtime handles them on the calling thread without a
loop iteration; the thread runtime in the loop thread's callback that receives them,
without a turn of the actor's task."""

from __future__ import annotations

import socket

import anyio
import pytest

from kvferry.actors import (
    ActorCrashed,
    ActorRef,
    ActorStopped,
    ActorSystem,
    SteppedRuntime,
    ThreadRuntime,
)

from ._actors import Add, AnswerThenBoom, AskBoom, Boom, Counter, Get, Msg, block


class NowCounter(Counter):
    """Counter whose Add, Get, Boom and AskBoom never await: handled now where they can be."""

    immediate = frozenset({Add, Get, Boom, AskBoom, AnswerThenBoom})

    def handle_now(self, msg: Msg) -> None:
        self.apply(msg)


async def spawn_now(system: ActorSystem) -> ActorRef[Msg]:
    return await system.spawn(NowCounter(), name="now")


async def spawn_counter(system: ActorSystem) -> ActorRef[Msg]:
    return await system.spawn(Counter(), name="plain")


@pytest.fixture
def stepped():  # type: ignore[no-untyped-def]
    runtime = SteppedRuntime()
    ref = runtime.start(spawn_now)
    yield runtime, ref
    runtime.close()


def _threaded(backend: str) -> tuple[ThreadRuntime, ActorRef[Msg]]:
    runtime = ThreadRuntime(backend=backend)
    ref = runtime.start(spawn_now)
    # The first call lets the actor reach its mailbox. From then on the actor's task has
    # always gone back to its empty mailbox before the loop runs the next callback that
    # receives a message: its answer is set inside its turn.
    runtime.call(ref.ask, Get)
    return runtime, ref


@pytest.fixture(params=["asyncio", "trio"])
def threaded(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    runtime, ref = _threaded(request.param)
    yield runtime, ref
    runtime.close()


@pytest.fixture(params=["stepped", "thread-asyncio", "thread-trio"])
def either(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Either sync runtime, with the actor at its empty mailbox."""
    if request.param == "stepped":
        runtime: SteppedRuntime | ThreadRuntime = SteppedRuntime()
        ref = runtime.start(spawn_now)
        runtime.call(ref.ask, Get)
    else:
        runtime, ref = _threaded(request.param.removeprefix("thread-"))
    yield runtime, ref
    runtime.close()


async def _make_event() -> anyio.Event:
    return anyio.Event()


async def _set(event: anyio.Event) -> None:
    event.set()


def _actor(ref: ActorRef[Msg]) -> NowCounter:
    actor = ref._cell.actor
    assert isinstance(actor, NowCounter)
    return actor


def test_asks_and_tells_are_handled_on_the_calling_thread_where_the_probe_allows(
    stepped, api_path: str
) -> None:  # type: ignore[no-untyped-def]
    runtime, ref = stepped
    runtime.call(ref.ask, Get)  # the first call lets the actor reach its mailbox
    before, sent = runtime.handled_now, runtime.sent
    runtime.tell(ref, Add(n=2))
    runtime.tell(ref, Add(n=3))
    assert runtime.ask(ref, Get) == 5
    assert runtime.call(ref.ask, Get) == 5
    # Public path: the loop's queues cannot be read, so every message takes an iteration.
    assert runtime.handled_now - before == (4 if api_path == "private" else 0)
    assert runtime.sent - sent == 4
    stats = ref.statistics()
    assert stats.messages_handled == 5 and stats.mailbox_depth == 0


def test_a_message_queued_ahead_keeps_its_place(either) -> None:  # type: ignore[no-untyped-def]
    runtime, ref = either
    gate = runtime.call(_make_event)
    runtime.call(block, ref, gate)  # the actor is inside a handler that awaits
    before = runtime.handled_now
    runtime.tell(ref, Add(n=1))  # so this one queues
    assert runtime.handled_now == before
    runtime.call(_set, gate)
    runtime.tell(ref, Add(n=2))  # queued behind Add(1), or handled once Add(1) was
    assert runtime.ask(ref, Get) == 3
    assert _actor(ref).seen == [1, 2]


def test_an_ask_handled_now_raises_to_its_asker_and_the_actor_goes_on(
    stepped, api_path: str
) -> None:  # type: ignore[no-untyped-def]
    runtime, ref = stepped
    runtime.call(ref.ask, Get)
    before = runtime.handled_now
    with pytest.raises(ValueError, match="bad ask"):
        runtime.ask(ref, AskBoom)
    runtime.tell(ref, Add(n=4))
    assert runtime.ask(ref, Get) == 4
    assert runtime.handled_now - before == (3 if api_path == "private" else 0)
    stats = ref.statistics()
    assert stats.failures == 1 and stats.restarts == 0


def test_a_tell_handled_now_that_raises_is_supervised_in_its_turn(stepped, api_path: str) -> None:  # type: ignore[no-untyped-def]
    """Counter's budget is two restarts: the third failure escalates, as it would have
    had the tells been queued."""
    runtime, ref = stepped
    runtime.call(ref.ask, Get)
    before = runtime.handled_now
    runtime.tell(ref, Boom())
    if api_path == "private":
        assert runtime.handled_now == before + 1
        assert ref.statistics().mailbox_depth == 1  # its failure, waiting for its turn
    runtime.tell(ref, Add(n=1))  # behind the failure: supervised first
    assert runtime.ask(ref, Get) == 1
    actor = _actor(ref)
    assert [str(e) for e in actor.restarted_with] == ["boom"]
    assert ref.statistics().restarts == 1
    runtime.tell(ref, Boom())
    runtime.ask(ref, Get)
    runtime.tell(ref, Boom())
    with pytest.raises(ActorStopped, match="crashed before answering Get"):
        runtime.ask(ref, Get)  # queued behind the failure that escalated
    with pytest.raises(ActorCrashed, match="boom"):
        runtime.ask(ref, Get)
    assert ref.statistics().restarts == 2


def test_an_ask_whose_handler_raised_after_answering_is_supervised_as_a_tell(either) -> None:  # type: ignore[no-untyped-def]
    """The asker has its answer; the error is not lost: supervised in its turn, as the
    actor's task supervises it (test_supervision.py), wherever the ask was handled."""
    runtime, ref = either
    runtime.tell(ref, Add(n=2))
    assert runtime.ask(ref, AnswerThenBoom) == 2
    runtime.tell(ref, Add(n=1))
    assert runtime.ask(ref, Get) == 3
    assert [str(e) for e in _actor(ref).restarted_with] == ["answered, then boom"]
    stats = ref.statistics()
    assert stats.failures == 1 and stats.restarts == 1


@pytest.mark.parametrize("waiting", ["callback", "timer", "socket"])
def test_work_waiting_on_the_loop_takes_the_iteration(stepped, waiting: str, api_path: str) -> None:  # type: ignore[no-untyped-def]
    """A ready callback, a timer due or a watched socket: the message takes the loop's
    iteration, which runs that work too."""
    runtime, ref = stepped
    runtime.call(ref.ask, Get)
    loop = runtime.loop
    ran: list[str] = []
    pair = socket.socketpair()
    try:
        if waiting == "callback":
            loop.call_soon(ran.append, waiting)
        elif waiting == "timer":
            loop.call_at(loop.time() - 1.0, ran.append, waiting)
        else:
            pair[1].send(b"x")
            loop.add_reader(pair[0], lambda: ran.append(waiting))
        before = runtime.handled_now
        runtime.tell(ref, Add(n=1))  # queued: the loop has work
        assert runtime.ask(ref, Get) == 1
        assert runtime.handled_now == before
        assert ran == [waiting]
        if waiting == "socket":
            loop.remove_reader(pair[0])
        assert runtime.ask(ref, Get) == 1
        # Nothing waits any more (on the public path, the loop's queues are not read).
        assert runtime.handled_now == before + (api_path == "private")
    finally:
        pair[0].close()
        pair[1].close()


@pytest.mark.anyio
async def test_on_a_running_loop_the_same_actor_handles_immediate_messages_in_its_task() -> None:
    async with ActorSystem() as system:
        ref = await spawn_now(system)
        await ref.tell(Add(n=1))
        await ref.tell(Boom())
        with pytest.raises(ValueError, match="bad ask"):
            await ref.ask(AskBoom)
        assert await ref.ask(Get) == 1
        stats = ref.statistics()
        assert stats.failures == 2 and stats.restarts == 1


# -- the thread runtime ------------------------------------------------------------------


def test_on_the_thread_runtime_the_loop_threads_callback_handles_them(threaded) -> None:  # type: ignore[no-untyped-def]
    runtime, ref = threaded
    before = runtime.handled_now
    runtime.tell(ref, Add(n=2))
    runtime.tell(ref, Add(n=3))
    assert runtime.ask(ref, Get) == 5
    assert runtime.call(ref.ask, Get) == 5
    assert runtime.handled_now - before == 4
    stats = ref.statistics()
    assert stats.messages_handled == 5 and stats.mailbox_depth == 0
    assert _actor(ref).seen == [2, 3]


def test_on_the_thread_runtime_an_actor_without_immediate_messages_takes_its_turn() -> None:
    runtime = ThreadRuntime()
    ref = runtime.start(spawn_counter)
    try:
        runtime.tell(ref, Add(n=1))
        assert runtime.ask(ref, Get) == 1
        assert runtime.handled_now == 0
        assert ref.statistics().messages_handled == 2
    finally:
        runtime.close()


def test_on_the_thread_runtime_errors_go_where_they_would_have_gone(threaded) -> None:  # type: ignore[no-untyped-def]
    runtime, ref = threaded
    before = runtime.handled_now
    with pytest.raises(ValueError, match="bad ask"):
        runtime.ask(ref, AskBoom)
    assert runtime.handled_now == before + 1
    assert ref.statistics().failures == 1 and ref.statistics().restarts == 0
    runtime.tell(ref, Boom())  # returns once handled: its failure is queued for the task
    assert runtime.handled_now == before + 2
    runtime.tell(ref, Add(n=1))
    assert runtime.ask(ref, Get) == 1
    assert [str(e) for e in _actor(ref).restarted_with] == ["boom"]
    stats = ref.statistics()
    assert stats.failures == 2 and stats.restarts == 1


def test_on_the_thread_runtime_a_failure_around_the_handler_reaches_the_caller(
    threaded, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """An error of the short way itself (not of the handler) ends the call: it does not
    vanish into the loop's callback and leave the caller waiting."""
    runtime, ref = threaded

    def broken(msg: object, reply: object, hop: object) -> None:
        raise RuntimeError("short way broke")

    monkeypatch.setattr(ref._cell, "handle_now", broken)
    with pytest.raises(RuntimeError, match="short way broke"):
        runtime.ask(ref, Get)
    with pytest.raises(RuntimeError, match="short way broke"):
        runtime.tell(ref, Add(n=1))
    monkeypatch.undo()
    assert runtime.ask(ref, Get) == 0
