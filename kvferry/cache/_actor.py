"""DirectoryActor: the single owner of the host tier's :class:`Directory`.

Who sends what: the scheduler-side facade asks ``Lookup`` / ``PrepareLoad`` /
``PrepareStore`` on the engine thread's calls and tells ``CompleteLoad`` /
``CompleteStore`` when the workers report a job done. Nothing else touches the directory.
"""

from __future__ import annotations

from typing import TypeAlias

import attrs
import numpy as np
import numpy.typing as npt
from typing import assert_never

from ..actors import Actor, Reply
from ._directory import Directory, DirectoryStatistics, Key


def _i64(a: npt.ArrayLike) -> npt.NDArray[np.int64]:
    view = np.asarray(a, dtype=np.int64).view()
    view.flags.writeable = False
    return view


@attrs.frozen(kw_only=True)
class Lookup:
    """How many leading keys are stored and ready."""

    keys: tuple[Key, ...]
    reply: Reply[int] = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class PrepareLoad:
    """Pin the slots of ``keys`` for a load; answers their slots, or None if any is not ready."""

    keys: tuple[Key, ...]
    reply: Reply[npt.NDArray[np.int64] | None] = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class CompleteLoad:
    """A load finished (or failed): unpin its slots."""

    slots: npt.NDArray[np.int64] = attrs.field(converter=_i64, eq=False)


@attrs.frozen(kw_only=True)
class PrepareStore:
    """Reserve a slot per key; answers the slots, -1 for a skipped key."""

    keys: tuple[Key, ...]
    reply: Reply[npt.NDArray[np.int64]] = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class CompleteStore:
    """A store finished: its keys become lookup hits if ``ok``, else they are dropped."""

    slots: npt.NDArray[np.int64] = attrs.field(converter=_i64, eq=False)
    ok: bool


@attrs.frozen(kw_only=True)
class ClearAll:
    """Drop every ready, unpinned key; answers the dropped keys."""

    reply: Reply[list[Key]] = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class GetStatistics:
    reply: Reply[DirectoryStatistics] = attrs.field(eq=False, repr=False)


DirectoryMsg: TypeAlias = (
    Lookup | PrepareLoad | CompleteLoad | PrepareStore | CompleteStore | ClearAll | GetStatistics
)


class DirectoryActor(Actor[DirectoryMsg]):
    """Owns one :class:`Directory`. Its state is the truth and is kept across restarts."""

    mailbox_size = 256

    def __init__(self, num_slots: int) -> None:
        self.directory = Directory(num_slots)

    async def handle(self, msg: DirectoryMsg) -> None:
        d = self.directory
        match msg:
            case Lookup(keys=keys, reply=reply):
                reply.set(d.lookup(keys))
            case PrepareLoad(keys=keys, reply=reply):
                reply.set(d.prepare_load(keys))
            case CompleteLoad(slots=slots):
                d.complete_load(slots)
            case PrepareStore(keys=keys, reply=reply):
                reply.set(d.prepare_store(keys))
            case CompleteStore(slots=slots, ok=ok):
                d.complete_store(slots, ok)
            case ClearAll(reply=reply):
                reply.set(d.clear())
            case GetStatistics(reply=reply):
                reply.set(d.statistics())
            case _:
                assert_never(msg)
