"""The actor core: tell, ask, back-pressure, stop, crash, supervision, sync runtimes."""

from __future__ import annotations

from typing import TypeAlias

import anyio
import attrs
import pytest

from kvferry.actors import (
    Actor,
    ActorCrashed,
    ActorStopped,
    ActorSystem,
    Reply,
    RestartPolicy,
    start_runtime,
)


@attrs.frozen
class Add:
    n: int


@attrs.frozen
class Get:
    reply: Reply[int] = attrs.field(eq=False)


@attrs.frozen
class Boom:
    """A tell whose handler raises."""


@attrs.frozen
class AskBoom:
    reply: Reply[int] = attrs.field(eq=False)


@attrs.frozen
class Block:
    """Blocks the actor until ``gate`` is set."""

    gate: anyio.Event = attrs.field(eq=False)


@attrs.frozen
class Forget:
    """An ask whose handler never answers."""

    reply: Reply[int] = attrs.field(eq=False)


Msg: TypeAlias = Add | Get | Boom | AskBoom | Block | Forget


class Counter(Actor[Msg]):
    mailbox_size = 2
    restart_policy = RestartPolicy(max_restarts=2, within_s=60.0)

    def __init__(self) -> None:
        self.value = 0
        self.restarted = 0

    async def on_restart(self, error: BaseException) -> None:
        self.restarted += 1

    async def handle(self, msg: Msg) -> None:
        match msg:
            case Add(n=n):
                self.value += n
            case Get(reply=reply):
                reply.set(self.value)
            case Boom():
                raise RuntimeError("boom")
            case AskBoom():
                raise ValueError("bad ask")
            case Block(gate=gate):
                await gate.wait()
            case Forget():
                pass


@pytest.mark.anyio
async def test_tell_then_ask_sees_the_tell() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Counter())
        await ref.tell(Add(2))
        await ref.tell(Add(3))
        assert await ref.ask(Get) == 5
        assert ref.statistics().messages_handled == 3


@pytest.mark.anyio
async def test_an_error_while_answering_goes_back_to_the_asker() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Counter())
        with pytest.raises(ValueError, match="bad ask"):
            await ref.ask(AskBoom)
        # the actor carries on
        await ref.tell(Add(1))
        assert await ref.ask(Get) == 1
        assert ref.statistics().failures == 1


@pytest.mark.anyio
async def test_an_ask_the_handler_forgets_to_answer_still_ends() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Counter())
        with pytest.raises(RuntimeError, match="did not answer"):
            await ref.ask(Forget)


@pytest.mark.anyio
async def test_full_mailbox_blocks_tell_and_raises_in_tell_nowait() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Counter())
        gate = anyio.Event()
        await ref.tell(Block(gate))
        await anyio.wait_all_tasks_blocked()  # the actor is now inside Block
        ref.tell_nowait(Add(1))
        ref.tell_nowait(Add(1))  # mailbox_size = 2: now full
        assert ref.statistics().mailbox_depth == 2
        with pytest.raises(anyio.WouldBlock):
            ref.tell_nowait(Add(1))
        sent = anyio.Event()

        async def blocked_sender() -> None:
            await ref.tell(Add(10))
            sent.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(blocked_sender)
            await anyio.wait_all_tasks_blocked()
            assert not sent.is_set()  # tell waits for room
            gate.set()
        assert sent.is_set()
        assert await ref.ask(Get) == 12


@pytest.mark.anyio
async def test_ask_to_a_stopped_actor_raises_actor_stopped() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Counter())
        await ref.stop()
        await ref.wait_stopped()
        with pytest.raises(ActorStopped):
            await ref.ask(Get)
        with pytest.raises(ActorStopped):
            ref.tell_nowait(Add(1))


@pytest.mark.anyio
async def test_a_stopping_actor_answers_what_was_queued() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Counter())
        gate = anyio.Event()
        await ref.tell(Block(gate))
        await anyio.wait_all_tasks_blocked()
        await ref.tell(Add(4))
        results: list[int] = []

        async def asker() -> None:
            results.append(await ref.ask(Get))

        async with anyio.create_task_group() as tg:
            tg.start_soon(asker)
            await anyio.wait_all_tasks_blocked()
            await ref.stop()
            gate.set()
        assert results == [4]


@pytest.mark.anyio
async def test_ask_times_out() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Counter())
        gate = anyio.Event()
        await ref.tell(Block(gate))
        await anyio.wait_all_tasks_blocked()
        with pytest.raises(TimeoutError):
            await ref.ask(Get, timeout=0.01)
        gate.set()


@pytest.mark.anyio
async def test_tell_failures_restart_within_budget_then_escalate() -> None:
    async with ActorSystem() as system:
        actor = Counter()
        ref = await system.spawn(actor)
        await ref.tell(Boom())
        await ref.tell(Boom())
        assert await ref.ask(Get) == 0
        assert actor.restarted == 2
        assert ref.statistics().restarts == 2
        system.raise_if_failed()  # nothing escalated yet
        gate = anyio.Event()
        await ref.tell(Block(gate))
        await anyio.wait_all_tasks_blocked()
        await ref.tell(Boom())  # the third failure: over budget
        results: list[BaseException] = []

        async def asker() -> None:
            try:
                await ref.ask(Get)
            except Exception as exc:
                results.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(asker)
            await anyio.wait_all_tasks_blocked()
            gate.set()
        # the queued ask failed instead of hanging
        assert len(results) == 1 and isinstance(results[0], ActorCrashed)
        with pytest.raises(ActorCrashed, match="Counter"):
            system.raise_if_failed()
        with pytest.raises(ActorStopped):
            await ref.ask(Get)


@pytest.mark.parametrize("kind", ["stepped", "thread"])
def test_sync_runtime_drives_the_same_actor(kind: str) -> None:
    async def setup(system: ActorSystem):  # type: ignore[no-untyped-def]
        return await system.spawn(Counter())

    runtime, ref = start_runtime(kind, setup)
    try:
        runtime.call(ref.tell, Add(7))
        assert runtime.call(ref.ask, Get) == 7
        assert runtime.call(ref.ask, Get) == 7
    finally:
        runtime.close()
    assert ref.statistics().running is False


def test_auto_runtime_inside_a_running_loop_uses_a_thread() -> None:
    async def setup(system: ActorSystem):  # type: ignore[no-untyped-def]
        return await system.spawn(Counter())

    async def main() -> str:
        runtime, ref = start_runtime("auto", setup)
        try:
            runtime.call(ref.tell, Add(1))
            assert runtime.call(ref.ask, Get) == 1
            return type(runtime).__name__
        finally:
            runtime.close()

    assert anyio.run(main) == "ThreadRuntime"
