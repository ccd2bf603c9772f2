"""ActorSystem: a task group that owns actors, starts them ready-signalled and stops them
in reverse order of spawning (dependents first), each within a deadline.

Who owns what: the system's task group owns every actor task; ``spawn`` and the context
manager's exit run on the event loop that entered the system.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup

from .._errors import ActorCrashed
from .._logging import get_logger
from ._base import Actor, ActorRef, _Cell

M = TypeVar("M")


class ActorSystem:
    """``async with ActorSystem() as system: ref = await system.spawn(MyActor())``.

    An actor whose supervisor gives up is *escalated*: its error is recorded, the rest of
    the system keeps running, and :meth:`raise_if_failed` raises :class:`ActorCrashed`
    naming it, so the next facade call reports it instead of hanging.
    """

    def __init__(self, *, stop_timeout_s: float = 10.0) -> None:
        self._stop_timeout_s = stop_timeout_s
        self._tg: TaskGroup | None = None
        self._cells: list[_Cell[Any]] = []
        self._names: set[str] = set()
        self.failures: dict[str, BaseException] = {}
        self._log = get_logger("kvferry.actors")

    async def __aenter__(self) -> ActorSystem:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._tg is not None
        try:
            await self.stop_all()
        finally:
            result = await self._tg.__aexit__(exc_type, exc, tb)
            self._tg = None
        return result

    async def spawn(self, actor: Actor[M], *, name: str | None = None) -> ActorRef[M]:
        """Start ``actor`` in the system's task group; returns once it is ready."""
        if self._tg is None:
            raise RuntimeError("ActorSystem is not running (use `async with`)")
        name = name or type(actor).__name__
        if name in self._names:
            raise ValueError(f"an actor named {name!r} already runs in this system")
        cell: _Cell[M] = _Cell(actor, name, self._escalate)
        await self._tg.start(cell.run)
        self._cells.append(cell)
        self._names.add(name)
        return ActorRef(cell)

    async def stop_all(self) -> None:
        """Stop every actor, last spawned first, each within the stop deadline.

        An actor that does not drain in time is cancelled (its queued asks fail).
        """
        for cell in reversed(self._cells):
            await cell.send.aclose()
            with anyio.move_on_after(self._stop_timeout_s) as scope:
                await cell.stopped.wait()
            if scope.cancelled_caught:
                self._log.error("actor_stop_timed_out", actor=cell.name)
        if self._tg is not None and any(not c.stopped.is_set() for c in self._cells):
            self._tg.cancel_scope.cancel()
        self._cells.clear()
        self._names.clear()

    def _escalate(self, name: str, error: BaseException) -> None:
        self.failures[name] = error

    def raise_if_failed(self) -> None:
        """Raise :class:`ActorCrashed` if any actor was escalated."""
        if self.failures:
            name, error = next(iter(self.failures.items()))
            raise ActorCrashed(f"actor {name} crashed: {error!r}") from error
