"""Messages of the host tier's actors: DirectoryActor, EvictorActor, PublisherActor.

One module for the three, because they talk to each other (the directory tells the evictor
that room is low, the evictor asks the directory to evict, the directory hands its events
to the publisher). Commands are imperative, facts past tense; an ask carries its reply.
"""

from __future__ import annotations

from typing import TypeAlias

import attrs
import numpy as np
import numpy.typing as npt

from ..actors import ActorRef, Reply
from ._directory import Key
from ._events import KVEvent
from ._statistics import DirectoryStatistics


def _i64(a: npt.ArrayLike) -> npt.NDArray[np.int64]:
    view = np.asarray(a, dtype=np.int64).view()
    view.flags.writeable = False
    return view


# -- DirectoryActor ----------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Lookup:
    """How many leading keys are stored and ready."""

    keys: tuple[Key, ...]
    reply: Reply[int] = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class LookupEach:
    """For each key, whether it is stored and ready (a hybrid model's windowed lookup)."""

    keys: tuple[Key, ...]
    reply: Reply[npt.NDArray[np.bool_]] = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class Lease:
    """The answer to :class:`LookupAndPin`: the hit, and the slots pinned for it."""

    leading: int
    """How many leading keys are ready (the hit of a :class:`Lookup`)."""
    ready: npt.NDArray[np.bool_] | None = attrs.field(eq=False, default=None)
    """Per key, whether it is ready (with ``each``; the answer of :class:`LookupEach`)."""
    slots: npt.NDArray[np.int64] = attrs.field(converter=_i64, eq=False)
    """The slots pinned: the leading hit's, or with ``each`` every ready key's."""


@attrs.frozen(kw_only=True)
class LookupAndPin:
    """A :class:`Lookup` (with ``each``, a :class:`LookupEach`) that also pins the hit.

    The pins are a lease: they keep the hit from being evicted until the engine either
    allocates blocks for it (``PrepareLoad(release=...)`` turns the lease into the
    load's pins) or does not (``Unpin``). The sender must release every lease it took.
    """

    keys: tuple[Key, ...]
    each: bool = False
    reply: Reply[Lease] = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class Unpin:
    """Release a lease (the slots a :class:`LookupAndPin` pinned)."""

    slots: npt.NDArray[np.int64] = attrs.field(converter=_i64, eq=False)


@attrs.frozen(kw_only=True)
class PrepareLoad:
    """Pin the slots of ``keys`` for a load; answers their slots, or None if any is not ready.

    ``release``: a lease to release once the load's pins are taken (see
    :class:`LookupAndPin`), released whatever the answer.
    """

    keys: tuple[Key, ...]
    release: npt.NDArray[np.int64] = attrs.field(
        converter=_i64, eq=False, factory=lambda: np.zeros(0, np.int64)
    )
    reply: Reply[npt.NDArray[np.int64] | None] = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class LoadLeased:
    """A load of slots a :class:`LookupAndPin` leased: they stay pinned, now for the load
    (released by :class:`CompleteLoad`); a reuse for the policy. What :class:`PrepareLoad`
    does without an answer to wait for, when the lease holds exactly the load's keys."""

    slots: npt.NDArray[np.int64] = attrs.field(converter=_i64, eq=False)


@attrs.frozen(kw_only=True)
class CompleteLoad:
    """A load finished (or failed): unpin its slots. ``handed``: more of the load's slots,
    whose pins pass to a write of them instead (released by :class:`Unpin` when it ends)."""

    slots: npt.NDArray[np.int64] = attrs.field(converter=_i64, eq=False)
    handed: npt.NDArray[np.int64] = attrs.field(
        converter=_i64, eq=False, factory=lambda: np.zeros(0, np.int64)
    )


@attrs.frozen(kw_only=True)
class PrepareStore:
    """Reserve a slot per key; answers the slots, -1 for a skipped key. ``admit=False``
    skips the admission filter (a block read up from a lower tier)."""

    keys: tuple[Key, ...]
    admit: bool = True
    reply: Reply[npt.NDArray[np.int64]] = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class CompleteStore:
    """A store finished: its keys become lookup hits if ``ok``, else they are dropped.
    ``pin``: slots of these to pin at once (released by :class:`Unpin`)."""

    slots: npt.NDArray[np.int64] = attrs.field(converter=_i64, eq=False)
    ok: bool
    pin: npt.NDArray[np.int64] = attrs.field(
        converter=_i64, eq=False, factory=lambda: np.zeros(0, np.int64)
    )


@attrs.frozen(kw_only=True)
class Touch:
    """A request finished having used these keys (head first): recency for the policy.

    The connector sends it from ``request_finished`` with the request's keys, as vLLM's
    manager applies recency at ``on_request_finished``; absent keys are ignored.
    """

    keys: tuple[Key, ...]


@attrs.frozen(kw_only=True)
class ClearAll:
    """Drop every ready, unpinned key; answers the dropped keys (BlocksRemoved events)."""

    reply: Reply[list[Key]] = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class ResetCache:
    """Forget every key (``reset_prefix_cache``); answers how many ready blocks were dropped.

    Emits the BlocksRemoved of every ready key. Blocks in flight are freed when their
    jobs end.
    """

    reply: Reply[int] = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class TakeEvents:
    """Answers the KV events of every message sent before this one, batched."""

    reply: Reply[list[KVEvent]] = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class EvictSome:
    """Evict towards the low watermark, at most ``max_blocks`` (None: all the way);
    answers how many were evicted. The evictor sends it."""

    max_blocks: int | None
    reply: Reply[int] = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class Demotions:
    """Slots evicted from a ``write_back`` directory, with their keys: DEMOTING (no
    longer hits, bytes kept) until :class:`EndDemotions`."""

    slots: npt.NDArray[np.int64] = attrs.field(converter=_i64, eq=False)
    keys: tuple[Key, ...]


@attrs.frozen(kw_only=True)
class TakeDemotions:
    """Answers the :class:`Demotions` since the last one (``write_back`` directories)."""

    reply: Reply[Demotions] = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class EndDemotions:
    """These DEMOTING slots were written down (or are not to be): free them."""

    slots: npt.NDArray[np.int64] = attrs.field(converter=_i64, eq=False)


@attrs.frozen(kw_only=True)
class AttachEvictor:
    """From now on, tell ``evictor`` when occupancy passes the high watermark."""

    evictor: ActorRef[EvictorMsg] = attrs.field(eq=False)


@attrs.frozen(kw_only=True)
class GetStatistics:
    reply: Reply[DirectoryStatistics] = attrs.field(eq=False, repr=False)


Fact: TypeAlias = Unpin | LoadLeased | CompleteLoad | CompleteStore | Touch | EndDemotions
"""A tell the connector may hold back and send in a :class:`Facts` batch."""


@attrs.frozen(kw_only=True)
class Facts:
    """Tells the connector gathered since its last message to the directory, in order:
    one message (one mailbox entry, one turn of the actor) instead of one each, as if
    they had come one by one.

    ``then``: the ask the connector sends next, carried in the same message (asked with
    its reply), so that the directory answers it after all of them. A fact that fails
    does not stop the others nor the ask: once the ask is answered, the first failure is
    supervised as a failed tell.
    """

    facts: tuple[Fact, ...]
    then: LookupAndPin | PrepareLoad | PrepareStore | None = attrs.field(default=None, repr=False)


DirectoryMsg: TypeAlias = (
    Lookup
    | LookupEach
    | LookupAndPin
    | Unpin
    | PrepareLoad
    | LoadLeased
    | CompleteLoad
    | PrepareStore
    | CompleteStore
    | Touch
    | ClearAll
    | ResetCache
    | TakeEvents
    | EvictSome
    | TakeDemotions
    | EndDemotions
    | AttachEvictor
    | GetStatistics
    | Facts
)


# -- EvictorActor ------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class RoomLow:
    """Fact, from the directory: occupancy passed the high watermark."""


EvictorMsg: TypeAlias = RoomLow


# -- PublisherActor ----------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Publish:
    """Events the directory recorded while handling one message, in order."""

    events: tuple[KVEvent, ...]


@attrs.frozen(kw_only=True)
class Drain:
    """Answers every event published since the last Drain, batched (one engine step's)."""

    reply: Reply[list[KVEvent]] = attrs.field(eq=False, repr=False)


PublisherMsg: TypeAlias = Publish | Drain
