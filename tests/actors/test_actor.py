"""tell, ask, back-pressure, statistics and stop: the contract of ActorRef."""

from __future__ import annotations

import anyio
import pytest

from kvferry.actors import ActorStatistics, ActorStopped, ActorSystem, Reply
from kvferry.actors._testing import settle, virtual_time_backend

from ._actors import Add, AskBoom, Counter, Forget, Get, block

pytestmark = pytest.mark.anyio


async def test_tell_then_ask_sees_the_tell() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Counter())
        await ref.tell(Add(n=2))
        await ref.tell(Add(n=3))
        assert await ref.ask(Get) == 5


async def test_ask_takes_a_callable_that_builds_the_message() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Counter())
        await ref.tell(Add(n=4))
        assert await ref.ask(lambda reply: Get(reply=reply)) == 4


async def test_messages_are_handled_in_the_order_they_were_sent() -> None:
    async with ActorSystem() as system:
        actor = Counter()
        ref = await system.spawn(actor)
        for n in range(10):
            await ref.tell(Add(n=n))
        await ref.ask(Get)
        assert actor.seen == list(range(10))


async def test_an_error_while_answering_goes_back_to_the_asker() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Counter())
        with pytest.raises(ValueError, match="bad ask"):
            await ref.ask(AskBoom)
        await ref.tell(Add(n=1))  # the actor carries on, not restarted
        assert await ref.ask(Get) == 1
        stats = ref.statistics()
        assert (stats.failures, stats.restarts) == (1, 0)


async def test_an_ask_the_handler_forgets_to_answer_still_ends() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Counter())
        with pytest.raises(RuntimeError, match="did not answer Forget"):
            await ref.ask(Forget)


async def test_full_mailbox_blocks_tell_and_raises_in_tell_nowait() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Counter())  # mailbox_size = 2
        gate = anyio.Event()
        await block(ref, gate)
        ref.tell_nowait(Add(n=1))
        ref.tell_nowait(Add(n=1))
        with pytest.raises(anyio.WouldBlock):
            ref.tell_nowait(Add(n=1))
        sent = anyio.Event()

        async def blocked_sender() -> None:
            await ref.tell(Add(n=10))
            sent.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(blocked_sender)
            await settle()
            assert not sent.is_set()  # tell waits for room
            stats = ref.statistics()
            assert (stats.mailbox_depth, stats.senders_waiting) == (2, 1)
            gate.set()
        assert sent.is_set()
        assert await ref.ask(Get) == 12


async def test_blocked_senders_get_room_in_the_order_they_came() -> None:
    async with ActorSystem() as system:
        actor = Counter()
        ref = await system.spawn(actor)
        gate = anyio.Event()
        await block(ref, gate)
        ref.tell_nowait(Add(n=0))
        ref.tell_nowait(Add(n=1))
        async with anyio.create_task_group() as tg:
            for n in (2, 3, 4):
                tg.start_soon(ref.tell, Add(n=n))
                await settle()  # each sender blocks before the next one starts
            gate.set()
        await ref.ask(Get)
        assert actor.seen == [0, 1, 2, 3, 4]


async def test_statistics_is_a_frozen_snapshot() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Counter(), name="counter")
        await ref.tell(Add(n=1))
        await ref.ask(Get)
        stats = ref.statistics()
        assert stats == ActorStatistics(
            name="counter",
            mailbox_size=2,
            mailbox_depth=0,
            senders_waiting=0,
            messages_handled=2,
            failures=0,
            restarts=0,
            messages_dropped=0,
            running=True,
        )
        with pytest.raises(AttributeError):
            stats.failures = 3  # type: ignore[misc]
        assert system.statistics() == (stats,)


async def test_ask_to_a_stopped_actor_raises_actor_stopped() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Counter())
        await ref.stop()
        await ref.wait_stopped()
        with pytest.raises(ActorStopped):
            await ref.ask(Get)
        with pytest.raises(ActorStopped):
            await ref.tell(Add(n=1))
        with pytest.raises(ActorStopped):
            ref.tell_nowait(Add(n=1))
        assert ref.statistics().running is False


async def test_a_graceful_stop_handles_what_was_queued_first() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Counter())
        gate = anyio.Event()
        await block(ref, gate)
        await ref.tell(Add(n=4))
        results: list[int] = []

        async def asker() -> None:
            results.append(await ref.ask(Get))

        async with anyio.create_task_group() as tg:
            tg.start_soon(asker)
            await settle()
            await ref.stop()
            gate.set()
        await ref.wait_stopped()
        assert results == [4]


async def test_stop_without_drain_fails_queued_asks_with_actor_stopped() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Counter())
        await block(ref, anyio.Event())  # never set: the actor is stuck
        errors: list[BaseException] = []

        async def asker() -> None:
            try:
                await ref.ask(Get)
            except ActorStopped as exc:
                errors.append(exc)

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(asker)
                tg.start_soon(asker)
                await settle()
                await ref.stop(drain=False)
            await ref.wait_stopped()
        assert len(errors) == 2


async def test_a_tell_blocked_on_a_full_mailbox_fails_when_the_actor_stops() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Counter())
        await block(ref, anyio.Event())
        ref.tell_nowait(Add(n=1))
        ref.tell_nowait(Add(n=1))
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:

                async def sender() -> None:
                    with pytest.raises(ActorStopped):
                        await ref.tell(Add(n=1))

                tg.start_soon(sender)
                await settle()
                await ref.stop(drain=False)
        await ref.wait_stopped()
        assert ref.statistics().messages_dropped == 2  # the two queued tells


@pytest.mark.parametrize("anyio_backend", [virtual_time_backend()])
async def test_ask_times_out_on_the_anyio_clock() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Counter())
        gate = anyio.Event()
        await block(ref, gate)
        t0 = anyio.current_time()
        with pytest.raises(TimeoutError):
            await ref.ask(Get, timeout=30.0)
        assert anyio.current_time() - t0 == pytest.approx(30.0)
        gate.set()


async def test_an_ask_that_timed_out_while_queued_is_never_handled() -> None:
    async with ActorSystem() as system:
        actor = Counter()
        ref = await system.spawn(actor)
        gate = anyio.Event()
        await block(ref, gate)
        with pytest.raises(TimeoutError):
            await ref.ask(lambda r: AskBoom(reply=r), timeout=0.01)  # would count a failure
        gate.set()
        assert await ref.ask(Get) == 0
        stats = ref.statistics()
        assert (stats.failures, stats.messages_dropped) == (0, 1)


async def test_an_actor_reaches_its_own_ref_and_system() -> None:
    async with ActorSystem() as system:
        actor = Counter()
        ref = await system.spawn(actor, name="c")
        assert actor.ref == ref
        assert actor.system is system


async def test_on_start_failure_fails_spawn_and_the_system_runs_on() -> None:
    class Broken(Counter):
        async def on_start(self) -> None:
            raise OSError("no device")

    async with ActorSystem() as system:
        with pytest.raises(OSError, match="no device"):
            await system.spawn(Broken())
        ref = await system.spawn(Counter())
        assert await ref.ask(Get) == 0


async def test_names_are_unique_within_a_system() -> None:
    async with ActorSystem() as system:
        await system.spawn(Counter(), name="x")
        with pytest.raises(ValueError, match="'x'"):
            await system.spawn(Counter(), name="x")


async def test_a_reply_resolves_once() -> None:
    reply: Reply[int] = Reply()
    reply.set(1)
    reply.fail(RuntimeError("late"))
    reply.set(2)
    assert reply.done and await reply.wait() == 1
