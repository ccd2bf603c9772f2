"""Actor, ActorRef and Reply on anyio.

Who owns what: an :class:`Actor` owns every attribute on ``self``; only its own task
(started by :class:`~kvferry.actors.ActorSystem`) touches them, one message at a time.
Other tasks talk to it through its :class:`ActorRef` only. A :class:`Reply` is resolved
on the event-loop thread, never from another thread.

Semantics (pykka's, on bounded mailboxes):

- ``tell`` waits for room in the mailbox; ``tell_nowait`` raises :class:`anyio.WouldBlock`
  when it is full. Both raise :class:`~kvferry.ActorStopped` once the actor has stopped.
- ``ask`` always ends: with the reply, with the exception the handler raised while
  answering, with :class:`TimeoutError`, or with :class:`~kvferry.ActorStopped`.
- An exception in a ``tell`` handler is logged, counted and handed to the actor's
  supervisor, which restarts the actor within its budget and otherwise stops it.
- A stopping actor first handles what is already queued; a crashed one fails its queued
  asks with ``ActorStopped``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

import anyio
import attrs
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._errors import ActorCrashed, ActorStopped
from .._logging import get_logger

M = TypeVar("M")
T = TypeVar("T")


class Reply(Generic[T]):
    """One-shot answer slot carried inside an ask-message.

    The handler calls :meth:`set` or :meth:`fail` exactly once; the asker awaits
    :meth:`wait`. Resolve it only on the event-loop thread.
    """

    __slots__ = ("_done", "_value", "_error")

    def __init__(self) -> None:
        self._done = anyio.Event()
        self._value: T | None = None
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def set(self, value: T) -> None:
        if self._done.is_set():
            return
        self._value = value
        self._done.set()

    def fail(self, error: BaseException) -> None:
        if self._done.is_set():
            return
        self._error = error
        self._done.set()

    async def wait(self) -> T:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


def _reply_of(msg: object) -> Reply[Any] | None:
    reply = getattr(msg, "reply", None)
    return reply if isinstance(reply, Reply) else None


@attrs.frozen(kw_only=True)
class ActorStatistics:
    """A snapshot of one actor's counters."""

    name: str
    mailbox_size: int
    mailbox_depth: int
    messages_handled: int
    failures: int
    restarts: int
    running: bool


@attrs.frozen(kw_only=True)
class RestartPolicy:
    """One-for-one restart budget: at most ``max_restarts`` within ``within_s`` seconds."""

    max_restarts: int = 3
    within_s: float = 10.0


class Actor(Generic[M]):
    """One task, one bounded mailbox; messages are handled strictly one at a time.

    Subclasses implement :meth:`handle`; they may override :meth:`on_start`,
    :meth:`on_stop` and :meth:`on_restart` (called after a ``tell`` handler raised,
    before the next message; the default keeps the state as it is).
    """

    mailbox_size: ClassVar[int] = 64
    restart_policy: ClassVar[RestartPolicy] = RestartPolicy()

    async def on_start(self) -> None:
        """Called once in the actor's task before its first message."""

    async def on_stop(self) -> None:
        """Called once in the actor's task after its last message."""

    async def on_restart(self, error: BaseException) -> None:
        """Called after a ``tell`` handler raised, when the supervisor restarts the actor."""

    async def handle(self, msg: M) -> None:
        raise NotImplementedError


class ActorRef(Generic[M]):
    """The send side of an actor's mailbox: the only way to talk to the actor."""

    __slots__ = ("_cell",)

    def __init__(self, cell: _Cell[M]) -> None:
        self._cell = cell

    @property
    def name(self) -> str:
        return self._cell.name

    def __repr__(self) -> str:
        return f"<ActorRef {self._cell.name}>"

    async def tell(self, msg: M) -> None:
        """Deliver ``msg``, waiting while the mailbox is full."""
        try:
            await self._cell.send.send(msg)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise ActorStopped(f"actor {self.name} has stopped") from None

    def tell_nowait(self, msg: M) -> None:
        """Deliver ``msg`` now; raises :class:`anyio.WouldBlock` if the mailbox is full."""
        try:
            self._cell.send.send_nowait(msg)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise ActorStopped(f"actor {self.name} has stopped") from None

    async def ask(self, make: Callable[[Reply[T]], M], *, timeout: float | None = None) -> T:
        """Send ``make(reply)`` and wait for the answer.

        Ends with the reply's value, the handler's exception, :class:`TimeoutError`
        after ``timeout`` seconds, or :class:`~kvferry.ActorStopped`.
        """
        reply: Reply[T] = Reply()
        # A message class is called with ``reply=`` (kw_only attrs classes); a callable
        # gets the reply positionally.
        msg = make(reply=reply) if isinstance(make, type) else make(reply)  # type: ignore[call-arg]
        with anyio.fail_after(math.inf if timeout is None else timeout):
            await self.tell(msg)
            return await reply.wait()

    def statistics(self) -> ActorStatistics:
        return self._cell.statistics()

    async def stop(self) -> None:
        """Close the mailbox; the actor handles what is queued, then stops."""
        await self._cell.send.aclose()

    async def wait_stopped(self) -> None:
        await self._cell.stopped.wait()


class _Cell(Generic[M]):
    """The runtime around one actor instance: mailbox, counters, supervision."""

    def __init__(self, actor: Actor[M], name: str, on_escalate: Callable[[str, BaseException], None]) -> None:
        self.actor = actor
        self.name = name
        self.size = actor.mailbox_size
        send, recv = anyio.create_memory_object_stream[M](self.size)
        self.send: MemoryObjectSendStream[M] = send
        self.recv: MemoryObjectReceiveStream[M] = recv
        self.handled = 0
        self.failures = 0
        self.restarts: list[float] = []
        self.running = False
        self.stopped = anyio.Event()
        self.error: BaseException | None = None
        self._on_escalate = on_escalate
        self._log = get_logger("kvferry.actors", actor=name)

    def statistics(self) -> ActorStatistics:
        return ActorStatistics(
            name=self.name,
            mailbox_size=self.size,
            mailbox_depth=self.recv.statistics().current_buffer_used,
            messages_handled=self.handled,
            failures=self.failures,
            restarts=len(self.restarts),
            running=self.running,
        )

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.running = True
        try:
            await self.actor.on_start()
            task_status.started()
            async for msg in self.recv:
                if not await self._handle_one(msg):
                    break
            await self.actor.on_stop()
        finally:
            self.running = False
            self.send.close()
            self._fail_queued()
            self.recv.close()
            self.stopped.set()

    async def _handle_one(self, msg: M) -> bool:
        """Handle one message; False when the actor must stop (budget spent)."""
        reply = _reply_of(msg)
        try:
            await self.actor.handle(msg)
        except Exception as exc:
            self.failures += 1
            self.handled += 1
            if reply is not None:
                # An error while answering an ask goes back to the asker.
                reply.fail(exc)
                return True
            self._log.error(
                "tell_handler_failed", message=type(msg).__name__, exc_info=exc
            )
            return await self._supervise(exc)
        self.handled += 1
        if reply is not None and not reply.done:
            reply.fail(RuntimeError(f"{self.name} did not answer {type(msg).__name__}"))
        return True

    async def _supervise(self, exc: BaseException) -> bool:
        policy = self.actor.restart_policy
        now = anyio.current_time()
        self.restarts = [t for t in self.restarts if now - t < policy.within_s]
        if len(self.restarts) >= policy.max_restarts:
            self.error = exc
            self._log.error("actor_escalated", restarts=len(self.restarts))
            self._on_escalate(self.name, exc)
            return False
        self.restarts.append(now)
        self._log.warning("actor_restarted", restarts=len(self.restarts))
        await self.actor.on_restart(exc)
        return True

    def _fail_queued(self) -> None:
        """Nothing waits forever on a stopped actor: fail every queued ask."""
        while True:
            try:
                msg = self.recv.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
            reply = _reply_of(msg)
            if reply is not None:
                reply.fail(
                    ActorCrashed(f"actor {self.name} crashed") if self.error else
                    ActorStopped(f"actor {self.name} stopped before answering")
                )
            else:
                self._log.warning("tell_dropped_on_stop", message=type(msg).__name__)
