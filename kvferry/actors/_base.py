"""Actor, ActorRef and Reply on anyio.

Who owns what: an :class:`Actor` owns every attribute on ``self``; only its own task
(started by :class:`~kvferry.actors.ActorSystem`) touches them, one message at a time.
Other tasks talk to it through its :class:`ActorRef` only, on the event loop that runs
the system. A :class:`Reply` is resolved on that loop, never from another thread.

Semantics (pykka's, on bounded mailboxes; docs/actors.md has the table):

- ``tell`` waits for room in the mailbox; ``tell_nowait`` raises :class:`anyio.WouldBlock`
  when it is full. Both raise :class:`~kvferry.ActorStopped` once the actor has stopped.
- ``ask`` always ends: with the reply, with the exception the handler raised while
  answering, with :class:`TimeoutError`, or with :class:`~kvferry.ActorStopped`. An ask
  that timed out (or was cancelled) while still queued is withdrawn: it is never handled.
- An exception in a ``tell`` handler is logged, counted and handed to the actor's
  supervisor (:class:`RestartPolicy`).
- ``stop()`` lets the actor handle what is already queued, then stops it;
  ``stop(drain=False)`` cancels it at once. Whatever is still queued when an actor ends
  is dropped: queued asks fail with ``ActorStopped`` (so does any other answer slot a
  queued message carries, a tell's ``notify``: :func:`replies_of`), queued tells are
  counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeAlias, TypeVar

import anyio
import anyio.lowlevel
import attrs

from .._errors import ActorStopped
from ._context import Hop, capture

if TYPE_CHECKING:
    from ._cell import _Cell
    from ._system import ActorSystem

M = TypeVar("M")
T = TypeVar("T")

_STOPPED = anyio.ClosedResourceError


R = TypeVar("R")
M_co = TypeVar("M_co", covariant=True)


class _MessageClass(Protocol[R, M_co]):
    """An ask-message class: built with its reply slot, ``Get(reply=reply)``."""

    def __call__(self, *, reply: Reply[R]) -> M_co: ...


MakeAsk: TypeAlias = "_MessageClass[T, M] | Callable[[Reply[T]], M]"
"""What ``ask`` takes: a message class (``ref.ask(Get)``) or a callable given the reply
(``ref.ask(lambda r: Lookup(keys=keys, reply=r))``)."""


class Waker(Protocol):
    """What a :class:`Reply` tells when it is resolved: an ``anyio.Event`` for an async
    asker, or a sync runtime's own hook (stop the stepped loop, release a thread's lock)."""

    def set(self) -> None: ...


class Reply(Generic[T]):
    """One-shot answer slot carried inside an ask-message.

    The handler calls :meth:`set` or :meth:`fail` once (later calls are ignored); the
    asker awaits :meth:`wait`. Resolve it only on the event loop that runs the actor.
    """

    __slots__ = ("_event", "_value", "_error", "_done", "_abandoned")

    def __init__(self) -> None:
        # The event is created by the first waiter: most replies are awaited before they
        # are set, but one set first (or never awaited) costs no event at all.
        self._event: Waker | None = None
        self._value: T | None = None
        self._error: BaseException | None = None
        self._done = False
        self._abandoned = False

    @property
    def done(self) -> bool:
        return self._done

    @property
    def abandoned(self) -> bool:
        """True once the asker gave up (timeout, cancellation): the answer is discarded."""
        return self._abandoned

    def set(self, value: T) -> None:
        if self._done:
            return
        self._value = value
        self._done = True
        if self._event is not None:
            self._event.set()

    def fail(self, error: BaseException) -> None:
        if self._done:
            return
        self._error = error
        self._done = True
        if self._event is not None:
            self._event.set()

    def result(self) -> T:
        """The value, or raise the error the reply failed with; only once :attr:`done`."""
        assert self._done, "Reply.result() before the reply was resolved"
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    async def wait(self) -> T:
        """The value, or raise the error the reply failed with."""
        if not self._done:
            if self._event is None:
                self._event = anyio.Event()
            assert isinstance(self._event, anyio.Event), "a sync runtime's reply is not awaitable"
            try:
                await self._event.wait()
            except BaseException:
                self._abandoned = True
                raise
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


Envelope: TypeAlias = tuple[M, Reply[Any] | None, Hop | None]
"""What a mailbox holds: the message, the asker's reply slot, the sender's context."""


def reply_of(msg: object) -> Reply[Any] | None:
    """The reply slot of an ask-message (a ``reply`` field), else None."""
    reply = getattr(msg, "reply", None)
    return reply if isinstance(reply, Reply) else None


def replies_of(msg: object) -> list[Reply[Any]]:
    """Every answer slot a message carries: each attrs field holding a :class:`Reply`,
    whatever its name (an ask's ``reply``, a tell's ``notify``), else :func:`reply_of`'s.

    What an actor that ends with the message still queued fails, so that no waiter on
    any of them waits forever.
    """
    cls = type(msg)
    if not attrs.has(cls):
        reply = reply_of(msg)
        return [] if reply is None else [reply]
    replies: list[Reply[Any]] = []
    for field in attrs.fields(cls):
        value = getattr(msg, field.name, None)
        if isinstance(value, Reply) and all(value is not r for r in replies):
            replies.append(value)
    return replies


@attrs.frozen(kw_only=True)
class ActorStatistics:
    """A snapshot of one actor's counters (trio's ``statistics()`` convention)."""

    name: str
    mailbox_size: int
    mailbox_depth: int
    """Messages queued, not yet handled."""
    senders_waiting: int
    """Tasks blocked in ``tell`` because the mailbox is full (back-pressure at work)."""
    messages_handled: int
    failures: int
    """Handler exceptions: asks answered with an error, and tell failures."""
    restarts: int
    messages_dropped: int
    """Asks withdrawn by their asker, and tells still queued when the actor ended."""
    running: bool


@attrs.frozen(kw_only=True)
class RestartPolicy:
    """One-for-one restart budget: at most ``max_restarts`` within ``within_s`` seconds.

    A ``tell`` handler that raises while the budget lasts gets the actor restarted (see
    :meth:`Actor.on_restart`); one more failure inside the window escalates: the actor
    stops, and so does its :class:`~kvferry.actors.ActorSystem`, which reports it.
    ``max_restarts=0`` escalates on the first failure. The window runs on the anyio clock.
    """

    max_restarts: int = 3
    within_s: float = 10.0

    def __attrs_post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not self.within_s > 0:
            raise ValueError(f"within_s must be > 0, got {self.within_s}")


class Actor(Generic[M]):
    """One task, one bounded mailbox; messages are handled strictly one at a time.

    Subclasses implement :meth:`handle` (and :meth:`handle_now` for the types named in
    :attr:`immediate`) and may override :meth:`on_start`, :meth:`on_stop` and
    :meth:`on_restart`. ``mailbox_size`` and ``restart_policy`` may be set per class or
    per instance.
    """

    mailbox_size: ClassVar[int] = 64
    restart_policy: ClassVar[RestartPolicy] = RestartPolicy()
    immediate: ClassVar[frozenset[type]] = frozenset()
    """Message types whose handling never awaits: :meth:`handle_now` handles them, in the
    actor's task like any message, and, while the actor waits at an empty mailbox, on the
    stepped runtime straight from the sync caller (no loop iteration) and on the thread
    runtime in the loop thread's callback that receives it (no turn of the actor's task);
    the same order either way."""
    _cell: _Cell[M] | None = None  # set by ActorSystem.spawn

    @property
    def ref(self) -> ActorRef[M]:
        """This actor's own ref (to tell itself, or hand to others)."""
        if self._cell is None:
            raise RuntimeError(f"{type(self).__name__} has not been spawned")
        return ActorRef(self._cell)

    @property
    def system(self) -> ActorSystem:
        """The system the actor runs in (for timers: ``self.system.send_every(...)``)."""
        if self._cell is None:
            raise RuntimeError(f"{type(self).__name__} has not been spawned")
        return self._cell.system

    async def on_start(self) -> None:
        """Called in the actor's task before its first message; raising fails ``spawn``."""

    async def on_stop(self) -> None:
        """Called in the actor's task after its last message (graceful stop or escalation).

        Once per instance, and only for one whose :meth:`on_start` returned; a factory
        restart calls it on the old instance before making the new one. Not called when
        the actor is cancelled (``stop(drain=False)``, shutdown deadline).
        """

    async def on_restart(self, error: BaseException) -> None:
        """Called when the supervisor restarts this instance after a ``tell`` handler raised.

        The default keeps the state as it is (bookkeeping state is the truth). Spawn a
        factory instead of an instance to restart from fresh state. Raising escalates.
        """

    async def handle(self, msg: M) -> None:
        raise NotImplementedError

    def handle_now(self, msg: M) -> None:
        """Handle a message of an :attr:`immediate` type, without awaiting anything; what
        it raises counts as :meth:`handle`'s would (an ask's error, or supervision)."""
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

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActorRef) and other._cell is self._cell

    def __hash__(self) -> int:
        return id(self._cell)

    def _stopped(self) -> ActorStopped:
        cell = self._cell
        how = "crashed" if cell.error is not None else "stopped"
        return ActorStopped(f"actor {cell.name} has {how}")

    async def tell(self, msg: M) -> None:
        """Deliver ``msg``, waiting while the mailbox is full (back-pressure)."""
        try:
            await self._cell.mailbox.send((msg, None, capture()))
        except _STOPPED:
            raise self._stopped() from self._cell.error

    def tell_nowait(self, msg: M) -> None:
        """Deliver ``msg`` now; raises :class:`anyio.WouldBlock` if the mailbox is full."""
        try:
            self._cell.mailbox.send_nowait((msg, None, capture()))
        except _STOPPED:
            raise self._stopped() from self._cell.error

    async def ask(
        self,
        make: MakeAsk[T, M],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (pykka's ask(timeout=): bounds one ask)
    ) -> T:
        """Send ``make(reply)`` and wait for the answer.

        ``make`` is a message class (called as ``make(reply=reply)``) or a callable
        (called as ``make(reply)``). Ends with the reply's value, the handler's exception,
        :class:`TimeoutError` after ``timeout`` seconds, or :class:`~kvferry.ActorStopped`.
        """
        # The reply will be awaited: make its event now, without anyio's backend lookup.
        reply, envelope = self._prepare_ask(make, self._cell.new_event())
        if timeout is None:
            await self._post(envelope, reply)
            return await reply.wait()
        with anyio.fail_after(timeout):
            await self._post(envelope, reply)
            return await reply.wait()

    def _prepare_ask(
        self, make: MakeAsk[T, M], waker: Waker | None
    ) -> tuple[Reply[T], Envelope[M]]:
        """The reply slot and the envelope of an ask; ``waker`` is told when it is answered
        (an event for an async asker; the sync runtimes pass their own)."""
        reply: Reply[T] = Reply()
        reply._event = waker
        msg = make(reply=reply) if isinstance(make, type) else make(reply)  # type: ignore[call-arg]
        return reply, (msg, reply, capture())

    def _offer(self, envelope: Envelope[M]) -> bool:
        """Queue ``envelope`` if there is room (True), else False. Never waits, never yields."""
        try:
            self._cell.mailbox.send_nowait(envelope)
        except anyio.WouldBlock:
            return False
        except _STOPPED:
            raise self._stopped() from self._cell.error
        return True

    async def _post(
        self,
        envelope: Envelope[M],
        reply: Reply[Any] | None,
        taken: Callable[[], object] | None = None,
    ) -> None:
        # No checkpoint when there is room: the ask suspends on its reply right after,
        # which saves one loop iteration per ask. ``taken``: see ``Mailbox.send``.
        try:
            if not self._offer(envelope):
                await self._cell.mailbox.send(envelope, taken=taken)
        except _STOPPED:
            raise self._stopped() from self._cell.error
        except BaseException:
            if reply is not None:
                reply._abandoned = True
            raise

    def statistics(self) -> ActorStatistics:
        return self._cell.statistics()

    async def stop(self, *, drain: bool = True) -> None:
        """Close the mailbox: nothing more gets in.

        With ``drain`` the actor handles what is queued, then stops; without, it is
        cancelled now and its queued asks fail with :class:`~kvferry.ActorStopped`.
        Returns at once; :meth:`wait_stopped` waits for the end.
        """
        self._cell.close(drain=drain)
        await anyio.lowlevel.checkpoint()

    async def wait_stopped(self) -> None:
        await self._cell.stopped.wait()
