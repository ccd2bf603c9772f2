"""The test kit users get for their own actors (kvferry.testing)."""

from __future__ import annotations

import threading

import anyio
import attrs
import pytest

from kvferry.actors import Actor, ActorRef, ActorSystem, Reply, start_runtime
from kvferry.actors._testing import (
    Probe,
    assert_no_task_left,
    assert_no_thread_left,
    settle,
    settle_runtime,
)

pytestmark = pytest.mark.anyio


@attrs.frozen(kw_only=True)
class Store:
    key: str


@attrs.frozen(kw_only=True)
class Stored:
    key: str


@attrs.frozen(kw_only=True)
class Size:
    reply: Reply[int] = attrs.field(eq=False, repr=False)


class Cache(Actor[Store]):
    """The actor under test: reports each store to a listener."""

    def __init__(self, listener: ActorRef[Stored | Size]) -> None:
        self.listener = listener

    async def handle(self, msg: Store) -> None:
        await self.listener.tell(Stored(key=msg.key))
        await self.listener.ask(Size)


async def test_a_probe_records_what_the_actor_under_test_sends() -> None:
    async with ActorSystem() as system:
        probe = Probe(answer=lambda msg: 1)
        cache = await system.spawn(Cache(await system.spawn(probe)))
        await cache.tell(Store(key="a"))
        assert await probe.expect(Stored) == Stored(key="a")
        await probe.expect(Size)
        await settle()
        probe.assert_nothing_more()


async def test_a_probe_without_an_answer_fails_the_ask() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Probe())
        with pytest.raises(AssertionError, match="no answer"):
            await ref.ask(Size)


async def test_expect_fails_on_the_wrong_message_and_on_silence() -> None:
    async with ActorSystem() as system:
        probe = Probe()
        ref = await system.spawn(probe)
        await ref.tell(Store(key="x"))
        with pytest.raises(AssertionError, match="expected a Stored"):
            await probe.expect(Stored)
        with pytest.raises(TimeoutError):
            await probe.receive(timeout=0.01)


async def test_the_leak_checks_catch_a_task_and_a_thread() -> None:
    stop = threading.Event()
    with pytest.raises(AssertionError, match="threads left behind"):
        with assert_no_thread_left(join_timeout_s=0.01):
            threading.Thread(target=stop.wait, name="leaky").start()
    stop.set()
    async with anyio.create_task_group() as tg:
        with pytest.raises(AssertionError, match="tasks left behind"):
            async with assert_no_task_left():
                tg.start_soon(anyio.sleep_forever, name="leaky")
        tg.cancel_scope.cancel()


def test_settle_runtime_lets_a_sync_runtime_finish_its_work() -> None:
    async def setup(system: ActorSystem) -> tuple[Probe, ActorRef[Store]]:
        probe = Probe(answer=lambda msg: 0)
        return probe, await system.spawn(Cache(await system.spawn(probe)))

    runtime, (probe, cache) = start_runtime("stepped", setup)
    try:
        runtime.call(cache.tell, Store(key="k"))
        settle_runtime(runtime)
        assert [type(m) for m in probe.received] == [Stored, Size]
    finally:
        runtime.close()
