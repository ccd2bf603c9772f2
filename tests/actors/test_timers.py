"""Timers on the anyio clock, tested on virtual time (trio's MockClock)."""

from __future__ import annotations

import anyio
import attrs
import pytest

from kvferry.actors import Actor, ActorSystem
from kvferry.actors._testing import Probe, settle, virtual_time_backend

pytestmark = pytest.mark.anyio


@attrs.frozen(kw_only=True)
class Tick:
    pass


class Clocked(Actor[Tick]):
    """Records the anyio time of every tick it handles."""

    mailbox_size = 1

    def __init__(self) -> None:
        self.times: list[float] = []

    async def handle(self, msg: Tick) -> None:
        self.times.append(anyio.current_time())


@pytest.mark.parametrize("anyio_backend", [virtual_time_backend()])
async def test_send_after_delivers_once_at_the_deadline() -> None:
    async with ActorSystem() as system:
        actor = Clocked()
        ref = await system.spawn(actor)
        t0 = anyio.current_time()
        timer = system.send_after(90.0, ref, Tick())
        await anyio.sleep(1000)
        assert [t - t0 for t in actor.times] == [pytest.approx(90.0)]
        assert (timer.fired, timer.active) == (1, False)


@pytest.mark.parametrize("anyio_backend", [virtual_time_backend()])
async def test_send_every_ticks_on_the_clock_without_drift() -> None:
    async with ActorSystem() as system:
        actor = Clocked()
        ref = await system.spawn(actor)
        t0 = anyio.current_time()
        timer = system.send_every(10.0, ref, Tick())
        await anyio.sleep(35)
        assert [round(t - t0, 6) for t in actor.times] == [10.0, 20.0, 30.0]
        assert timer.fired == 3 and timer.dropped == 0


@pytest.mark.parametrize("anyio_backend", [virtual_time_backend()])
async def test_a_tick_that_finds_the_mailbox_full_is_dropped_and_counted() -> None:
    gate = anyio.Event()

    class Slow(Clocked):
        async def handle(self, msg: Tick) -> None:
            await gate.wait()
            await super().handle(msg)

    async with ActorSystem() as system:
        actor = Slow()
        ref = await system.spawn(actor)  # mailbox of 1
        timer = system.send_every(1.0, ref, Tick())
        await anyio.sleep(5.5)  # tick 1 is being handled, tick 2 queued, 3..5 dropped
        assert (timer.fired, timer.dropped) == (2, 3)
        gate.set()
        await settle()
        assert len(actor.times) == 2


@pytest.mark.parametrize("anyio_backend", [virtual_time_backend()])
async def test_a_cancelled_timer_sends_nothing_more() -> None:
    async with ActorSystem() as system:
        probe = Probe()
        ref = await system.spawn(probe)
        timer = system.send_every(1.0, ref, Tick())
        await anyio.sleep(2.5)
        timer.cancel()
        await anyio.sleep(100)
        assert len(probe.received) == 2 and not timer.active


@pytest.mark.parametrize("anyio_backend", [virtual_time_backend()])
async def test_an_actor_can_schedule_its_own_ticks() -> None:
    class SelfTimed(Clocked):
        async def on_start(self) -> None:
            self.system.send_every(5.0, self.ref, Tick())

    async with ActorSystem() as system:
        actor = SelfTimed()
        await system.spawn(actor)
        await anyio.sleep(12)
        assert len(actor.times) == 2


@pytest.mark.parametrize("anyio_backend", [virtual_time_backend()])
async def test_timers_end_with_the_system() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Probe())
        after = system.send_after(3600.0, ref, Tick())
        every = system.send_every(60.0, ref, Tick())
    assert not after.active and not every.active
    assert after.fired == 0


async def test_timers_reject_nonsense() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Probe())
        with pytest.raises(ValueError, match="interval"):
            system.send_every(0.0, ref, Tick())
        with pytest.raises(ValueError, match="delay"):
            system.send_after(-1.0, ref, Tick())


@pytest.mark.parametrize("anyio_backend", [virtual_time_backend()])
async def test_the_system_forgets_timers_that_fired_or_were_cancelled() -> None:
    """A system that sets a timeout per request must not hold every timer it ever made."""
    async with ActorSystem() as system:
        ref = await system.spawn(Clocked())
        for _ in range(100):
            system.send_after(1.0, ref, Tick())
        cancelled = [system.send_every(5.0, ref, Tick()) for _ in range(10)]
        live = system.send_every(5.0, ref, Tick())
        await anyio.sleep(2.0)
        for timer in cancelled:
            timer.cancel()
        await settle()
        assert system._timers == {live}
        assert all(not t.active for t in cancelled) and live.active
