"""One-for-one supervision: restart within a budget, then escalate to the system."""

from __future__ import annotations

import logging

import anyio
import pytest

from kvferry.actors import ActorCrashed, ActorStopped, ActorSystem, RestartPolicy
from kvferry.actors._testing import Faulty, settle, virtual_time_backend

from ._actors import Add, Boom, Counter, Get, block

pytestmark = pytest.mark.anyio


async def test_a_tell_failure_is_logged_counted_and_restarts_the_actor(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvferry.actors")
    async with ActorSystem() as system:
        actor = Counter()
        ref = await system.spawn(actor, name="counter")
        await ref.tell(Add(n=5))
        await ref.tell(Boom())
        assert await ref.ask(Get) == 5  # restarted in place: its state is kept
        assert [repr(e) for e in actor.restarted_with] == ["RuntimeError('boom')"]
        stats = ref.statistics()
        assert (stats.failures, stats.restarts, stats.running) == (1, 1, True)
    failed = [r for r in caplog.records if r.kvferry_event == "tell_handler_failed"]  # type: ignore[attr-defined]
    assert len(failed) == 1
    assert failed[0].kvferry == {"actor": "counter", "message": "Boom"}  # type: ignore[attr-defined]
    assert failed[0].exc_info is not None and "boom" in str(failed[0].exc_info[1])


async def test_the_mailbox_survives_a_restart_and_the_failing_message_is_dropped() -> None:
    async with ActorSystem() as system:
        actor = Counter()
        ref = await system.spawn(actor)
        gate = anyio.Event()
        await block(ref, gate)
        ref.tell_nowait(Boom())
        ref.tell_nowait(Add(n=7))  # queued behind the failure
        gate.set()
        assert await ref.ask(Get) == 7
        assert actor.seen == [7]


async def test_a_factory_actor_restarts_from_fresh_state() -> None:
    instances: list[Counter] = []

    def make() -> Counter:
        instances.append(Counter())
        return instances[-1]

    async with ActorSystem() as system:
        ref = await system.spawn(make, name="fresh")
        await ref.tell(Add(n=5))
        await ref.tell(Boom())
        assert await ref.ask(Get) == 0
        assert len(instances) == 2 and instances[0].value == 5


class Stops(Counter):
    """A counter that records each ``on_stop`` call."""

    def __init__(self, stopped: list[Counter]) -> None:
        super().__init__()
        self.stopped = stopped

    async def on_stop(self) -> None:
        self.stopped.append(self)


class StartFails(Stops):
    async def on_start(self) -> None:
        raise OSError("no fresh state")


@pytest.mark.parametrize("fails", ["factory", "on_start"])
async def test_a_factory_restart_that_fails_escalates_and_stops_the_old_instance_once(
    fails: str,
) -> None:
    stopped: list[Counter] = []
    made: list[Counter] = []

    def make() -> Counter:
        if made and fails == "factory":
            raise OSError("no fresh state")
        made.append(Stops(stopped) if not made else StartFails(stopped))
        return made[-1]

    with pytest.raises(ActorCrashed) as info:
        async with ActorSystem() as system:
            ref = await system.spawn(make, name="fresh")
            await ref.tell(Boom())  # the restart fails: escalated
            await ref.wait_stopped()
    assert isinstance(info.value.__cause__, OSError)
    # The first instance was stopped once, by the restart; a second that never started
    # (as at spawn, an on_start that raised) is not stopped at all.
    assert stopped == [made[0]]


@pytest.mark.parametrize("anyio_backend", [virtual_time_backend()])
async def test_a_crash_looping_actor_escalates_after_its_budget() -> None:
    with pytest.raises(ActorCrashed, match="crashy"):
        async with ActorSystem() as system:
            other = await system.spawn(Counter(), name="other")
            crashy = await system.spawn(Counter(), name="crashy")  # 2 restarts per 60 s
            await crashy.tell(Boom())
            await crashy.tell(Boom())
            await crashy.ask(Get)
            assert crashy.statistics().restarts == 2
            system.raise_if_failed()  # within budget: nothing escalated yet
            gate = anyio.Event()
            await block(crashy, gate)
            crashy.tell_nowait(Boom())  # the third failure inside the window
            asked: list[BaseException] = []

            async def asker() -> None:
                try:
                    await crashy.ask(Get)
                except ActorStopped as exc:
                    asked.append(exc)

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(asker)
                    await settle()
                    gate.set()
                report = await system.wait_stopped()  # the others stopped too
            assert len(asked) == 1 and isinstance(asked[0].__cause__, RuntimeError)
            assert system.failures.keys() == {"crashy"}
            assert report.crashed == ("crashy",) and not other.statistics().running
            with pytest.raises(ActorStopped):
                await other.tell(Add(n=1))
            with pytest.raises(ActorCrashed):
                system.raise_if_failed()


@pytest.mark.parametrize("anyio_backend", [virtual_time_backend()])
async def test_failures_spread_wider_than_the_window_never_escalate() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Counter())  # 2 restarts per 60 s
        for _ in range(5):
            await ref.tell(Boom())
            await ref.ask(Get)
            await anyio.sleep(61)  # virtual: the previous restarts leave the window
        assert ref.statistics().restarts == 5
        system.raise_if_failed()


async def test_max_restarts_zero_escalates_on_the_first_failure() -> None:
    actor = Counter()
    actor.restart_policy = RestartPolicy(max_restarts=0)  # type: ignore[misc]
    with pytest.raises(ActorCrashed):
        async with ActorSystem() as system:
            ref = await system.spawn(actor)
            await ref.tell(Boom())
            await ref.wait_stopped()
    assert ref.statistics().restarts == 0


async def test_a_restart_hook_that_raises_escalates_at_once() -> None:
    class BadRestart(Counter):
        async def on_restart(self, error: BaseException) -> None:
            raise OSError("cannot recover")

    with pytest.raises(ActorCrashed) as info:
        async with ActorSystem() as system:
            ref = await system.spawn(BadRestart())
            await ref.tell(Boom())
            await ref.wait_stopped()
    assert isinstance(info.value.__cause__, OSError)


async def test_faulty_injects_failures_for_chosen_messages() -> None:
    async with ActorSystem() as system:
        inner = Counter()
        ref = await system.spawn(
            Faulty(inner, when=lambda m: isinstance(m, Add) and m.n == 2, times=1)
        )
        for n in (1, 2, 2, 3):
            await ref.tell(Add(n=n))
        assert await ref.ask(Get) == 6  # the first Add(2) failed and was dropped
        assert len(inner.restarted_with) == 1


def test_a_restart_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError, match="within_s"):
        RestartPolicy(within_s=0)
