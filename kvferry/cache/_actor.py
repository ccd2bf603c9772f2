"""The host tier's actors: DirectoryActor, EvictorActor, PublisherActor.

Who owns what:

- :class:`DirectoryActor` owns the :class:`~kvferry.cache.Directory` (keys, slots, pins,
  the policy, admission). The scheduler-side facade asks ``LookupAndPin`` (a lookup
  that leases its hit until the engine allocates blocks for it) / ``PrepareLoad`` /
  ``PrepareStore`` on the engine thread's calls and tells ``Unpin`` / ``LoadLeased`` /
  ``CompleteLoad`` / ``CompleteStore`` / ``Touch`` when leases, jobs and requests end
  (gathered in one ``Facts`` before its next ask).
  Nothing else touches the directory; its state is the truth and is kept across restarts.
- :class:`EvictorActor` owns only its pacing. Told ``RoomLow`` by the directory when a
  store pushed occupancy past the high watermark, it asks the directory to ``EvictSome``
  — a message queued behind those already waiting, so lookups and stores in the mailbox
  are answered first and a store rarely has to evict inline.
- :class:`PublisherActor` owns the pending KV events. The directory tells it what each
  message changed; ``TakeEvents`` (to the directory, so that it follows every earlier
  message) drains it once per engine step.

:func:`spawn_host_tier` starts the three, wired. ``DirectoryActor(num_slots)`` alone
still works: no events, and eviction happens inline in batches.
"""

from __future__ import annotations

from typing import assert_never

import anyio
import attrs

from .._errors import ActorStopped
from ..actors import Actor, ActorRef, ActorSystem
from ._admission import DEFAULT_WATERMARKS
from ._directory import Directory, Key
from ._events import EventBuffer, KVEvent
from ._messages import (
    AttachEvictor,
    ClearAll,
    CompleteLoad,
    CompleteStore,
    Demotions,
    DirectoryMsg,
    Drain,
    EndDemotions,
    EvictorMsg,
    EvictSome,
    Fact,
    Facts,
    GetStatistics,
    Lease,
    LoadLeased,
    Lookup,
    LookupAndPin,
    LookupEach,
    PrepareLoad,
    PrepareStore,
    Publish,
    PublisherMsg,
    ResetCache,
    RoomLow,
    TakeDemotions,
    TakeEvents,
    Touch,
    Unpin,
)
from ._policy import EvictionPolicy


class DirectoryActor(Actor[DirectoryMsg]):
    """Owns one :class:`Directory`; the keyword arguments are the directory's."""

    mailbox_size = 256

    def __init__(
        self,
        num_slots: int,
        *,
        policy: str | EvictionPolicy = "lru",
        watermarks: tuple[float, float] = DEFAULT_WATERMARKS,
        store_threshold: int = 1,
        tracker_size: int = 64_000,
        publisher: ActorRef[PublisherMsg] | None = None,
        write_back: bool = False,
    ) -> None:
        self.directory = Directory(
            num_slots,
            policy=policy,
            watermarks=watermarks,
            store_threshold=store_threshold,
            tracker_size=tracker_size,
            events=publisher is not None,
            write_back=write_back,
        )
        self._publisher = publisher
        self._unpublished: list[KVEvent] = []  # the publisher's mailbox was full
        self.publish_at = 1024
        """Events the directory holds between drains before it hands them on."""
        self._evictor: ActorRef[EvictorMsg] | None = None
        self.room_low_coalesced = 0
        """RoomLow facts not sent because one was already waiting in the evictor's mailbox."""

    immediate = frozenset(
        {
            Lookup,
            LookupEach,
            LookupAndPin,
            Unpin,
            LoadLeased,
            CompleteLoad,
            CompleteStore,
            Touch,
            EndDemotions,
            Facts,
            PrepareLoad,
            PrepareStore,
            ClearAll,
            ResetCache,
            EvictSome,
            TakeDemotions,
            AttachEvictor,
            GetStatistics,
        }
    )
    """Every message but :class:`TakeEvents` (which asks the publisher): plain bookkeeping,
    handled without awaiting (on the stepped runtime, often straight from the engine
    thread)."""

    async def handle(self, msg: DirectoryMsg) -> None:
        match msg:
            case TakeEvents(reply=reply):
                reply.set(await self._take_events())
            case _:
                self.handle_now(msg)

    def handle_now(self, msg: DirectoryMsg) -> None:
        d = self.directory
        match msg:
            case Lookup(keys=keys, reply=reply):
                reply.set(d.lookup(keys))
            case LookupEach(keys=keys, reply=reply):
                reply.set(d.ready(keys))
            case LookupAndPin(keys=keys, each=each, reply=reply):
                reply.set(self._lookup_and_pin(keys, each))
            case (
                Unpin() | LoadLeased() | CompleteLoad() | CompleteStore() | Touch() | EndDemotions()
            ):
                self._apply(msg)
            case Facts(facts=facts, then=ask):
                if ask is None:
                    self._apply_all(facts)
                else:
                    try:
                        self._apply_all(facts)
                    except Exception:
                        self.handle_now(ask)  # answered first, then supervised as a tell
                        raise
                    self.handle_now(ask)
                    return  # its events were published with the ask's
            case PrepareLoad(keys=keys, release=release, reply=reply):
                pinned = d.prepare_load(keys)
                if len(release):
                    d.unpin(release)
                reply.set(pinned)
            case PrepareStore(keys=keys, admit=admit, reply=reply):
                reply.set(d.prepare_store(keys, admit=admit))
                self._check_room()
            case ClearAll(reply=reply):
                reply.set(d.clear())
            case ResetCache(reply=reply):
                reply.set(d.reset())
            case EvictSome(max_blocks=max_blocks, reply=reply):
                reply.set(d.evict(max_blocks))
            case TakeDemotions(reply=reply):
                taken, demoted = d.take_demotions()
                reply.set(Demotions(slots=taken, keys=tuple(demoted)))
            case AttachEvictor(evictor=evictor):
                self._evictor = evictor
            case GetStatistics(reply=reply):
                reply.set(d.statistics())
            case TakeEvents():
                raise TypeError("TakeEvents is not handled now: it asks the publisher")
            case _:
                assert_never(msg)
        self._publish_now()

    def _apply(self, msg: Fact) -> None:
        if self._apply_one(msg):
            self._check_room()

    def _apply_one(self, msg: Fact) -> bool:
        """Apply ``msg``; True when it may have made blocks evictable (room to check)."""
        d = self.directory
        match msg:
            case Unpin(slots=slots):
                d.unpin(slots)
            case LoadLeased(slots=slots):
                d.load_leased(slots)
                return False
            case CompleteLoad(slots=slots, handed=handed):
                d.complete_load(slots, handed)
            case CompleteStore(slots=slots, ok=ok, pin=pin):
                d.complete_store(slots, ok, pin)  # stored blocks can be evicted from now on
            case Touch(keys=keys):
                d.touch(keys)
                return False
            case EndDemotions(slots=slots):
                d.end_demotions(slots)
            case _:
                assert_never(msg)
        return True

    def _apply_all(self, facts: tuple[Fact, ...]) -> None:
        """Each in order; one that fails does not stop the others (each would have been a
        message of its own), and the first failure is raised at the end (supervised as a
        failed tell). The room is checked once, after them."""
        error: Exception | None = None
        check = False
        for fact in facts:
            try:
                check |= self._apply_one(fact)
            except Exception as exc:
                error = error or exc
        if check:
            self._check_room()
        if error is not None:
            raise error

    def _lookup_and_pin(self, keys: tuple[Key, ...], each: bool) -> Lease:
        d = self.directory
        if each:
            ready = d.ready(keys)
            hits = [k for k, r in zip(keys, ready.tolist(), strict=True) if r]
            return Lease(
                leading=int(ready.argmin()) if not ready.all() else len(keys),
                ready=ready,
                slots=d.lease(hits),
            )
        slots = d.lookup_and_lease(keys)
        return Lease(leading=len(slots), slots=slots)

    def _check_room(self) -> None:
        if self._evictor is None or not self.directory.room_short():
            return
        try:
            self._evictor.tell_nowait(RoomLow())
        except anyio.WouldBlock:  # one is waiting already: it will see this shortfall too
            self.room_low_coalesced += 1
        except ActorStopped:
            # Stopping: actors stop last spawned first, so the evictor goes before the
            # directory drains its mailbox. From now on a store that finds no free slot
            # evicts inline, as without an evictor.
            self._evictor = None

    def _publish_now(self) -> None:
        """Hand the events recorded to the publisher once :attr:`publish_at` of them wait
        (a drain takes them all anyway), if its mailbox has room; else they wait, in
        order, for the next message or drain (never dropped). Between two drains the
        publisher is seldom woken, so the loop stays quiescent and the stepped runtime
        keeps handling this actor's messages straight from the engine thread."""
        publisher = self._publisher
        if publisher is None or self.directory.events_pending < self.publish_at:
            return
        self._unpublished.extend(self.directory.take_events())
        try:
            publisher.tell_nowait(Publish(events=tuple(self._unpublished)))
        except anyio.WouldBlock:
            return
        self._unpublished = []

    async def _take_events(self) -> list[KVEvent]:
        if self._publisher is None:
            return self.directory.take_events()
        events = self._unpublished + self.directory.take_events()
        self._unpublished = []
        if events:
            await self._publisher.tell(Publish(events=tuple(events)))
        return await self._publisher.ask(lambda r: Drain(reply=r))


class EvictorActor(Actor[EvictorMsg]):
    """Keeps the directory between its watermarks, off the critical path.

    ``batch_blocks`` bounds one ``EvictSome`` (None: one message per shortfall); a bound
    lets lookups interleave with a long eviction, at a policy pass per batch.
    """

    mailbox_size = 1

    def __init__(
        self, directory: ActorRef[DirectoryMsg], *, batch_blocks: int | None = None
    ) -> None:
        self._directory = directory
        self._batch = batch_blocks
        self.evicted = 0
        self.rounds = 0

    async def handle(self, msg: EvictorMsg) -> None:
        match msg:
            case RoomLow():
                batch = self._batch
                while True:
                    n: int = await self._directory.ask(
                        lambda r: EvictSome(max_blocks=batch, reply=r)
                    )
                    self.evicted += n
                    self.rounds += 1
                    if batch is None or n < batch:
                        break
            case _:
                assert_never(msg)


class PublisherActor(Actor[PublisherMsg]):
    """Batches KV events between two drains (one engine step); see :class:`EventBuffer`."""

    mailbox_size = 64

    def __init__(self, *, max_keys: int = 1_000_000) -> None:
        self.buffer = EventBuffer(max_keys=max_keys)

    async def handle(self, msg: PublisherMsg) -> None:
        match msg:
            case Publish(events=events):
                self.buffer.extend(events)
            case Drain(reply=reply):
                reply.set(self.buffer.take())
            case _:
                assert_never(msg)


@attrs.frozen(kw_only=True)
class HostTier:
    """The refs of one host tier's actors."""

    directory: ActorRef[DirectoryMsg]
    evictor: ActorRef[EvictorMsg]
    publisher: ActorRef[PublisherMsg] | None


async def spawn_host_tier(
    system: ActorSystem,
    num_slots: int,
    *,
    policy: str | EvictionPolicy = "lru",
    watermarks: tuple[float, float] = DEFAULT_WATERMARKS,
    store_threshold: int = 1,
    tracker_size: int = 64_000,
    events: bool = False,
    evict_batch: int | None = None,
    prefix: str = "",
    write_back: bool = False,
) -> HostTier:
    """Spawn publisher (if ``events``), directory and evictor, wired; actors are named
    ``{prefix}kv-events``, ``{prefix}directory`` and ``{prefix}evictor``.

    Raises :class:`~kvferry.ConfigError` for a bad policy, watermarks or threshold.
    """
    publisher = await system.spawn(PublisherActor(), name=f"{prefix}kv-events") if events else None
    directory = await system.spawn(
        DirectoryActor(
            num_slots,
            policy=policy,
            watermarks=watermarks,
            store_threshold=store_threshold,
            tracker_size=tracker_size,
            publisher=publisher,
            write_back=write_back,
        ),
        name=f"{prefix}directory",
    )
    evictor = await system.spawn(
        EvictorActor(directory, batch_blocks=evict_batch), name=f"{prefix}evictor"
    )
    await directory.tell(AttachEvictor(evictor=evictor))
    return HostTier(directory=directory, evictor=evictor, publisher=publisher)
