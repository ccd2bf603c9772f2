"""The runtime around one actor: its mailbox, its task, its counters, its supervisor.

Who owns what: a ``_Cell`` is created by :meth:`ActorSystem.spawn` and runs as one task
in the system's task group. Its counters, its actor instance and its restart window are
written by that task only. Any task on the same event loop may send to ``mailbox`` (through
an :class:`ActorRef`) or call :meth:`close`; nothing here is touched from another thread.

Mailbox fate, in one place:

- on a restart the failing message is dropped (not retried: a message that failed once
  would likely fail again), and the queued ones stay, handled in order by the restarted
  actor;
- on a graceful stop the queued messages are handled, then the actor stops;
- on escalation or cancellation whatever is still queued (and the message being handled,
  if it was an ask) fails with :class:`~kvferry.ActorStopped`: every answer slot a queued
  message carries (:func:`~kvferry.actors._base.replies_of`: an ask's ``reply``, a tell's
  ``notify``); queued tells without one are counted as dropped and logged.

Handled now (:meth:`_Cell.handle_now`, the sync runtimes' short way for an actor's
``immediate`` messages): only while the task waits at an empty mailbox, so the message
takes its place in the order, outside the task's turn (the stepped runtime: on the
engine thread between loop iterations; the thread runtime: in the loop thread's callback
that received it) in a copy of the task's context (its log keys). An ask's error goes to
the asker as usual; a tell's error is queued as a :class:`_Failed` marker, which the task
supervises in order like a failure of its own.
"""

from __future__ import annotations

import contextvars
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeAlias, TypeVar

import anyio
import anyio.lowlevel
import structlog
from anyio.abc import TaskStatus
from opentelemetry import trace

from .._errors import ActorStopped
from .._logging import get_logger
from .._private_api import context_var_setter, event_factory
from ._base import Actor, ActorStatistics, Envelope, Reply, replies_of
from ._context import HopScope
from ._mailbox import Mailbox

if TYPE_CHECKING:
    from ._system import ActorSystem

M = TypeVar("M")

ActorSource: TypeAlias = Actor[M] | Callable[[], Actor[M]]


_FAIRNESS_STREAK = 16
"""Queued messages an actor handles back to back before it yields to the other tasks."""


class _Failed:
    """A tell handled now whose handler raised: queued so that the task supervises it."""

    __slots__ = ("msg", "error")

    def __init__(self, msg: Any, error: Exception) -> None:
        self.msg = msg
        self.error = error


class _Cell(Generic[M]):
    def __init__(
        self,
        system: ActorSystem,
        source: ActorSource[M],
        name: str | None,
        tracer: trace.Tracer | None,
    ) -> None:
        if isinstance(source, Actor):
            self.factory: Callable[[], Actor[M]] | None = None
            actor = source
        else:
            self.factory = source
            actor = source()
        actor._cell = self
        self.actor: Actor[M] = actor
        self.system = system
        self.name = name or type(actor).__name__
        self.mailbox: Mailbox[Envelope[M]] = Mailbox(actor.mailbox_size)
        self.new_event = event_factory()
        # structlog's ``message`` key, set per message: directly on structlog's own
        # variable where the probe allows (a fraction of ``bind_contextvars``' cost).
        self._set_message = context_var_setter("message")
        self.handled = 0
        self.failures = 0
        self.restarts = 0
        self.dropped = 0
        self.running = False
        self.waiting = False
        """The task waits for a message (at an empty mailbox, unless one just came)."""
        self._context: contextvars.Context | None = None
        self.stopped = anyio.Event()
        self.error: BaseException | None = None
        """The error this actor was escalated with."""
        self.scope: anyio.CancelScope | None = None
        self._kill = False
        self._started = False
        """The current instance's ``on_start`` returned and its ``on_stop`` has not run."""
        self._current: Reply[Any] | None = None
        self._restart_times: deque[float] = deque()
        self._tracer = tracer
        self._log = get_logger("kvferry.actors", actor=self.name)

    def statistics(self) -> ActorStatistics:
        mailbox = self.mailbox
        return ActorStatistics(
            name=self.name,
            mailbox_size=mailbox.size,
            mailbox_depth=len(mailbox),
            senders_waiting=mailbox.senders_waiting,
            messages_handled=self.handled,
            failures=self.failures,
            restarts=self.restarts,
            messages_dropped=self.dropped,
            running=self.running,
        )

    def close(self, *, drain: bool) -> None:
        """Let nothing more in; without ``drain``, cancel the actor now."""
        self.mailbox.close()
        if not drain:
            self._kill = True
            if self.scope is not None:
                self.scope.cancel()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        # Bound in this task's own context, once: every log line of the actor carries it.
        structlog.contextvars.bind_contextvars(actor=self.name)
        self._context = contextvars.copy_context()  # for the messages handled now
        try:
            with anyio.CancelScope() as self.scope:
                if self._kill:
                    self.scope.cancel()
                await self.actor.on_start()
                self._started = True
                self.running = True
                task_status.started()
                await self._loop()
                await self._on_stop()
        finally:
            self.running = False
            self._finish()

    async def _loop(self) -> None:
        mailbox = self.mailbox
        tracer = self._tracer
        streak = 0
        while True:
            # Taking a queued message does not yield; after a streak of them, yield once
            # (before taking the next, so a cancellation there loses nothing).
            if streak >= _FAIRNESS_STREAK:
                streak = 0
                await anyio.lowlevel.checkpoint()
            try:
                if mailbox.ready:
                    msg, reply, hop = mailbox.receive_nowait()
                    streak += 1
                else:
                    streak = 0
                    self.waiting = True
                    try:
                        msg, reply, hop = await mailbox.receive()
                    finally:
                        self.waiting = False
            except anyio.EndOfStream:
                return
            if reply is not None and reply._abandoned:
                self.dropped += 1  # its asker timed out or was cancelled while it queued
                continue
            if isinstance(msg, _Failed):  # a tell handled now failed: supervised in turn
                if not await self._supervise(msg.msg, msg.error):
                    return
                continue
            self._current = reply
            try:
                if type(msg) in self.actor.immediate:
                    self._run_now(msg, hop)  # as the sync runtimes' short ways run it
                elif hop is None and tracer is None:
                    # Set in this actor's own context and left set: the next message
                    # overwrites it, and nothing else runs in this context meanwhile.
                    self._set_message(type(msg).__name__)
                    await self.actor.handle(msg)
                else:
                    with HopScope(hop, tracer, self.name, type(msg).__name__) as scope:
                        try:
                            await self.actor.handle(msg)
                        except Exception as exc:
                            scope.fail(exc)
                            raise
            except Exception as exc:
                self.handled += 1
                self.failures += 1
                if reply is not None and not reply._done:
                    reply.fail(exc)  # an error while answering goes back to the asker
                    continue
                if not await self._supervise(msg, exc):
                    return
                continue
            self.handled += 1
            if reply is not None and not reply._done:
                reply.fail(RuntimeError(f"{self.name} did not answer {type(msg).__name__}"))

    def can_handle_now(self, msg: object) -> bool:
        """Whether :meth:`handle_now` may take ``msg``: of an ``immediate`` type, and the
        task waits at an empty mailbox (nothing queued or parked ahead of it)."""
        mailbox = self.mailbox
        return (
            self.waiting
            and self.running
            and type(msg) in self.actor.immediate
            and not len(mailbox)
            and not mailbox.senders_waiting
            and not mailbox.closed
        )

    def handle_now(self, msg: M, reply: Reply[Any] | None, hop: Any) -> None:
        """Handle ``msg`` on the calling thread, as the task would have (counters, log
        keys, hop scope, an ask's error to its asker); only after :meth:`can_handle_now`
        said yes, and outside any turn of a task of the loop (the stepped runtime between
        iterations, or a callback on the loop's thread). A tell whose handler raised, or
        an ask whose handler raised after answering, is queued as :class:`_Failed`."""
        context = self._context
        if context is None:
            raise RuntimeError(f"actor {self.name} has not started")
        try:
            context.run(self._run_now, msg, hop)
        except Exception as exc:
            self.handled += 1
            self.failures += 1
            if reply is not None and not reply._done:
                reply.fail(exc)  # an error while answering goes back to the asker
                return
            # A tell, or an ask answered before its handler raised: supervised, as the
            # task supervises them.
            try:
                self.mailbox.send_nowait((_Failed(msg, exc), None, None))  # type: ignore[arg-type]
            except (anyio.WouldBlock, anyio.ClosedResourceError):
                # The handler filled (or closed) its own mailbox: no turn left to
                # supervise in, so the failure ends the actor now.
                self._log.error("tell_handler_failed", message=type(msg).__name__, exc_info=exc)
                self._escalate(exc)
            return
        self.handled += 1
        if reply is not None and not reply._done:
            reply.fail(RuntimeError(f"{self.name} did not answer {type(msg).__name__}"))

    def _run_now(self, msg: M, hop: Any) -> None:
        """An immediate message's handling, in whatever context the caller runs it (the
        task's own, or the copy :meth:`handle_now` enters)."""
        if hop is None and self._tracer is None:
            self._set_message(type(msg).__name__)
            self.actor.handle_now(msg)
            return
        with HopScope(hop, self._tracer, self.name, type(msg).__name__) as scope:
            try:
                self.actor.handle_now(msg)
            except Exception as exc:
                scope.fail(exc)
                raise

    async def _supervise(self, msg: M, exc: Exception) -> bool:
        """Restart within the budget (True), or escalate (False)."""
        self._log.error("tell_handler_failed", message=type(msg).__name__, exc_info=exc)
        policy = self.actor.restart_policy
        now = anyio.current_time()
        times = self._restart_times
        while times and now - times[0] >= policy.within_s:
            times.popleft()
        if len(times) >= policy.max_restarts:
            self._escalate(exc)
            return False
        times.append(now)
        self.restarts += 1
        try:
            await self._restart(exc)
        except Exception as restart_exc:
            self._log.error("actor_restart_failed", exc_info=restart_exc)
            self._escalate(restart_exc)
            return False
        self._log.warning("actor_restarted", restarts=self.restarts, error=repr(exc))
        return True

    async def _restart(self, exc: Exception) -> None:
        if self.factory is None:
            await self.actor.on_restart(exc)
            return
        await self._on_stop()
        actor = self.factory()
        actor._cell = self
        self.actor = actor
        await actor.on_start()
        self._started = True

    def _escalate(self, exc: BaseException) -> None:
        self.error = exc
        self._log.error("actor_escalated", restarts=len(self._restart_times), error=repr(exc))
        self.system._escalated(self, exc)

    async def _on_stop(self) -> None:
        """The current instance's ``on_stop``: once, and only if its ``on_start`` returned
        (a factory restart that failed leaves an instance already stopped, or never
        started, in place)."""
        if not self._started:
            return
        self._started = False
        try:
            await self.actor.on_stop()
        except Exception as exc:
            self._log.error("actor_on_stop_failed", exc_info=exc)

    def _finish(self) -> None:
        """Nothing waits forever on an ended actor: fail the asks it will never answer."""
        self.mailbox.close()
        how = "crashed" if self.error is not None else "stopped"
        current = self._current
        if current is not None and not current._done:
            current.fail(self._stopped_error(f"actor {self.name} {how} while answering"))
        while True:
            try:
                msg, reply, _ = self.mailbox.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream):
                break
            replies = replies_of(msg)
            if reply is not None and all(reply is not r for r in replies):
                replies.append(reply)
            if replies:
                for slot in replies:
                    slot.fail(
                        self._stopped_error(
                            f"actor {self.name} {how} before answering {type(msg).__name__}"
                        )
                    )
            else:
                self.dropped += 1
                self._log.warning("tell_dropped_on_stop", message=type(msg).__name__)
        self.stopped.set()

    def _stopped_error(self, text: str) -> ActorStopped:
        err = ActorStopped(text)
        err.__cause__ = self.error
        return err
