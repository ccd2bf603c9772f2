"""The host tier's actors: directory messages, the evictor's watermarks, events per step."""

from __future__ import annotations

import logging

import anyio
import pytest

from kvferry._private_api import PUBLIC_ONLY_ENV
from kvferry.actors import ActorSystem, Reply, SteppedRuntime
from kvferry.cache import (
    BlocksRemoved,
    BlocksStored,
    ClearAll,
    CompleteLoad,
    CompleteStore,
    DirectoryActor,
    Facts,
    GetStatistics,
    HostTier,
    Lookup,
    LookupAndPin,
    PrepareLoad,
    PrepareStore,
    Publish,
    PublisherActor,
    ResetCache,
    TakeEvents,
    Touch,
    Unpin,
    spawn_host_tier,
)
from kvferry.cache._testing import key as k

pytestmark = pytest.mark.anyio


async def test_directory_actor_answers_each_message() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(DirectoryActor(4))
        slots = await ref.ask(lambda r: PrepareStore(keys=(k(1), k(2)), reply=r))
        assert await ref.ask(lambda r: Lookup(keys=(k(1),), reply=r)) == 0
        await ref.tell(CompleteStore(slots=slots, ok=True))
        assert await ref.ask(lambda r: Lookup(keys=(k(1), k(2)), reply=r)) == 2
        pinned = await ref.ask(lambda r: PrepareLoad(keys=(k(2),), reply=r))
        assert pinned is not None and list(pinned) == [slots[1]]
        stats = await ref.ask(GetStatistics)
        assert stats.pinned == 1 and stats.ready == 2
        await ref.tell(CompleteLoad(slots=pinned))
        await ref.tell(Touch(keys=(k(2), k(1))))
        stats = await ref.ask(GetStatistics)
        assert stats.pinned == 0
        assert await ref.ask(ClearAll) == [k(1), k(2)]


async def test_the_evictor_brings_occupancy_down_to_the_low_watermark() -> None:
    async with ActorSystem() as system:
        tier = await spawn_host_tier(system, 10, watermarks=(0.5, 0.9))
        d = tier.directory
        for i in range(10):
            slots = await d.ask(lambda r, i=i: PrepareStore(keys=(k(i),), reply=r))
            await d.tell(CompleteStore(slots=slots, ok=True))
        await anyio.wait_all_tasks_blocked()
        stats = await d.ask(GetStatistics)
        assert stats.used == 5 and stats.evictions == 5
        assert stats.evictions_inline == 0


async def test_take_events_batches_what_every_earlier_message_changed() -> None:
    async with ActorSystem() as system:
        tier = await spawn_host_tier(system, 2, watermarks=(1.0, 1.0), events=True)
        d = tier.directory
        for i in range(3):
            slots = await d.ask(lambda r, i=i: PrepareStore(keys=(k(i),), reply=r))
            await d.tell(CompleteStore(slots=slots, ok=True))
        assert await d.ask(TakeEvents) == [
            BlocksStored(keys=[k(0), k(1)]),  # two messages, one batch
            BlocksRemoved(keys=[k(0)]),
            BlocksStored(keys=[k(2)]),
        ]
        assert await d.ask(TakeEvents) == []


async def test_events_wait_in_order_while_the_publishers_mailbox_is_full() -> None:
    """A message handled without awaiting cannot wait for the publisher: its events are
    held by the directory and handed on, first, with the next ones (never dropped)."""
    async with ActorSystem() as system:
        publisher = PublisherActor()
        publisher.mailbox_size = 1
        pub = await system.spawn(publisher)
        pub.tell_nowait(Publish(events=()))  # full until the publisher's task runs
        actor = DirectoryActor(2, watermarks=(1.0, 1.0), publisher=pub)
        actor.publish_at = 1  # each message's events handed on at once, if there is room
        for i in range(3):  # no await in between: the publisher cannot run
            reply: Reply[object] = Reply()
            actor.handle_now(PrepareStore(keys=(k(i),), reply=reply))
            actor.handle_now(CompleteStore(slots=reply.result(), ok=True))  # type: ignore[arg-type]
        assert pub.statistics().mailbox_depth == 1
        taken: Reply[object] = Reply()
        await actor.handle(TakeEvents(reply=taken))
        assert taken.result() == [
            BlocksStored(keys=[k(0), k(1)]),  # the publisher's batching, as ever
            BlocksRemoved(keys=[k(0)]),
            BlocksStored(keys=[k(2)]),
        ]


def test_with_kv_events_the_stepped_runtime_still_handles_the_directory_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The events of a step wait in the directory until the drain: the publisher is not
    woken per message, so the loop stays quiescent and each message is handled on the
    calling thread; the drain hands over all of them, merged as ever."""
    monkeypatch.delenv(PUBLIC_ONLY_ENV, raising=False)

    async def setup(system: ActorSystem) -> HostTier:
        return await spawn_host_tier(system, 4, watermarks=(1.0, 1.0), events=True)

    runtime = SteppedRuntime()
    tier = runtime.start(setup)
    try:
        d = tier.directory
        runtime.ask(d, GetStatistics)  # the actors reach their mailboxes
        before = runtime.handled_now
        for i in range(3):
            slots = runtime.ask(d, lambda r, i=i: PrepareStore(keys=(k(i),), reply=r))
            runtime.tell(d, CompleteStore(slots=slots, ok=True))
        assert runtime.handled_now - before == 6
        assert runtime.ask(d, TakeEvents) == [BlocksStored(keys=[k(0), k(1), k(2)])]
        assert runtime.handled_now - before == 6  # the drain asks the publisher
    finally:
        assert runtime.close().clean


async def test_reset_cache_clears_the_tier_and_says_so() -> None:
    async with ActorSystem() as system:
        tier = await spawn_host_tier(system, 4, events=True)
        d = tier.directory
        slots = await d.ask(lambda r: PrepareStore(keys=(k(1), k(2)), reply=r))
        await d.tell(CompleteStore(slots=slots, ok=True))
        assert await d.ask(ResetCache) == 2
        assert await d.ask(lambda r: Lookup(keys=(k(1),), reply=r)) == 0
        # Each held block is removed by name (medium CPU), after the batch's earlier
        # events: no AllBlocksCleared, which names no medium in vLLM's events.
        assert await d.ask(TakeEvents) == [
            BlocksStored(keys=[k(1), k(2)]),
            BlocksRemoved(keys=[k(1), k(2)]),
        ]


async def test_without_a_publisher_take_events_answers_nothing() -> None:
    async with ActorSystem() as system:
        tier = await spawn_host_tier(system, 4)
        slots = await tier.directory.ask(lambda r: PrepareStore(keys=(k(1),), reply=r))
        await tier.directory.tell(CompleteStore(slots=slots, ok=True))
        assert tier.publisher is None
        assert await tier.directory.ask(TakeEvents) == []


async def test_shutdown_with_a_full_tier_and_stores_in_flight_is_clean_and_quiet(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Actors stop last spawned first, so the evictor is gone while the directory still
    handles what was queued; stores completing then push occupancy past the high
    watermark, and the directory finds no evictor to tell. That is not an error."""
    system = ActorSystem()
    async with system:
        tier = await spawn_host_tier(system, 4, watermarks=(0.5, 0.75))
        d = tier.directory
        slots = await d.ask(lambda r: PrepareStore(keys=tuple(k(i) for i in range(4)), reply=r))
        await anyio.wait_all_tasks_blocked()  # the evictor found nothing evictable yet
        for slot in slots:  # the stores end while the system stops: queued, not yet handled
            d.tell_nowait(CompleteStore(slots=[slot], ok=True))
        report = await system.stop_all()
    assert report.clean, report
    assert system.failures == {}
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_facts_are_applied_in_order_as_one_message() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(DirectoryActor(4))
        slots = await ref.ask(lambda r: PrepareStore(keys=(k(1), k(2)), reply=r))
        # The store completes, then its first block is loaded and touched: in this order
        # only (a load of a block still being stored finds nothing to pin).
        await ref.tell(Facts(facts=(CompleteStore(slots=slots, ok=True), Touch(keys=(k(1),)))))
        pinned = await ref.ask(lambda r: PrepareLoad(keys=(k(1), k(2)), reply=r))
        assert pinned is not None and pinned.tolist() == slots.tolist()
        await ref.tell(Facts(facts=(CompleteLoad(slots=pinned[:1]), Unpin(slots=pinned[1:]))))
        stats = await ref.ask(GetStatistics)
        assert (stats.ready, stats.pinned, stats.loads_completed) == (2, 0, 1)
        assert ref.statistics().messages_handled == 5  # four facts in two messages


async def test_facts_and_the_ask_after_them_go_as_one_message() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(DirectoryActor(4))
        slots = await ref.ask(lambda r: PrepareStore(keys=(k(1), k(2)), reply=r))
        # The ask is answered after the facts: the store's completion makes it a hit.
        facts = (CompleteStore(slots=slots, ok=True), Touch(keys=(k(2),)))
        lease = await ref.ask(
            lambda r: Facts(facts=facts, then=LookupAndPin(keys=(k(1), k(2)), reply=r))
        )
        assert lease.leading == 2 and sorted(lease.slots.tolist()) == sorted(slots.tolist())
        pinned = await ref.ask(
            lambda r: Facts(
                facts=(Unpin(slots=lease.slots[1:]),),
                then=PrepareLoad(keys=(k(1),), release=lease.slots[:1], reply=r),
            )
        )
        assert pinned is not None and pinned.tolist() == slots[:1].tolist()
        stats = await ref.ask(GetStatistics)
        assert (stats.ready, stats.pinned) == (2, 1)
        assert ref.statistics().messages_handled == 4


@pytest.mark.parametrize("then", [False, True], ids=["alone", "with-an-ask"])
async def test_a_fact_that_fails_does_not_stop_the_others(
    then: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Alone, or before an ask in the same message (the ask is answered first): the
    failure is supervised once, as a failed tell's."""
    async with ActorSystem() as system:
        ref = await system.spawn(DirectoryActor(4))
        slots = await ref.ask(lambda r: PrepareStore(keys=(k(1),), reply=r))
        bad = Touch(keys=None)  # type: ignore[arg-type]  # no keys at all: touch raises
        facts = (bad, CompleteStore(slots=slots, ok=True))
        with caplog.at_level(logging.ERROR):
            if then:
                lease = await ref.ask(
                    lambda r: Facts(facts=facts, then=LookupAndPin(keys=(k(1),), reply=r))
                )
                assert lease.leading == 1  # the fact after the bad one was applied too
            else:
                await ref.tell(Facts(facts=facts))
            assert await ref.ask(lambda r: Lookup(keys=(k(1),), reply=r)) == 1
        assert ref.statistics().restarts == 1
        assert "tell_handler_failed" in caplog.text
