"""Driving an :class:`ActorSystem` from synchronous code (vLLM's connector calls).

Three ways to drive the same actors (DESIGN §2):

1. on a running loop: ``async with ActorSystem() as system`` inside the caller's own
   asyncio or trio program (what :class:`kvferry.Ferry` does);
2. :class:`~kvferry.actors.ThreadRuntime`: the loop runs on a dedicated thread, and
   ``call`` hands a coroutine function to it and blocks until it returns;
3. :class:`~kvferry.actors.SteppedRuntime`: the loop runs on the caller's thread, only
   while a ``call`` is in progress; between calls the actors' tasks are suspended.

Both sync runtimes share one interface (:class:`SyncRuntime`) and two ways to run a call.
``call(ref.ask, make)`` and ``call(ref.tell, msg)``, the facade's everyday calls, put the
message straight into the mailbox (:class:`_Deliver`) and wait for the reply. Any other
``call(fn, *args)`` goes to a long-lived *call server* task inside the actor system,
which runs calls one at a time: a call costs no new task, and runs in a real task
(cancel scopes, anyio primitives and contextvars all behave as in any task). Either way
the caller's span and log context travel with the call.

A delivery that finds its mailbox full waits for room in a task of its own, in a task
group the server owns (:func:`serve_deliveries`), never in the server itself: one stuck
actor must not hold up the calls and the deliveries of everyone else. A caller is
blocked on its own ask or tell until it is delivered (or answered), so it has at most
one delivery waiting and its messages keep their order. An ask abandoned by its caller
(a timeout) is withdrawn from the wait (:meth:`_Deliver.withdraw`); at the close marker
the server cancels the deliveries still waiting, failing them with
:class:`~kvferry.ActorStopped`, before it returns and the system stops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import anyio
from anyio.abc import TaskGroup

from .._errors import ActorStopped
from ._base import ActorRef, Envelope, MakeAsk, Reply
from ._context import HopScope, capture
from ._system import ActorSystem, ShutdownReport

T = TypeVar("T")
S = TypeVar("S")
M = TypeVar("M")

Setup = Callable[[ActorSystem], Awaitable[S]]
"""Runs once in the new system (spawn the actors); its result is what ``start`` returns."""


class SyncRuntime(Protocol):
    """What the sync facade needs of a runtime. ``call`` and ``close`` come from one
    thread at a time, never from inside the runtime's own loop."""

    system: ActorSystem

    def start(self, setup: Setup[S]) -> S: ...

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T: ...

    def ask(self, ref: ActorRef[M], make: MakeAsk[T, M], *, timeout: float | None = None) -> T:
        """``call(ref.ask, make)`` without the routing: what a caller on a hot path sends."""
        ...

    def tell(self, ref: ActorRef[M], msg: M) -> None:
        """``call(ref.tell, msg)`` without the routing."""
        ...

    def close(self) -> ShutdownReport: ...


class _Call:
    """One call handed to the call server: the function, then its outcome.

    Written by the server (on the loop), read by the caller once ``done`` is true (the
    stepped runtime) or once ``lock`` is released (the thread runtime).
    """

    __slots__ = ("fn", "args", "hop", "value", "error", "done", "lock")

    def __init__(
        self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...], lock: Any = None
    ) -> None:
        self.fn = fn
        self.args = args
        self.hop = capture()  # the caller's span and log context, applied around fn
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = False
        self.lock = lock

    def finish(self, value: Any = None, error: BaseException | None = None) -> None:
        if self.done:
            return
        self.value = value
        self.error = error
        self.done = True
        if self.lock is not None:
            self.lock.release()

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class _Deliver:
    """An ask or a tell that a sync runtime puts straight into a mailbox, without the
    call server. Only when the mailbox is full does the server take it, to wait for room.

    The caller waits on ``reply`` (an ask) or on ``call`` (a tell); :meth:`fail` ends
    whichever it is. ``scope`` is set while the delivery waits for room (on the loop).
    """

    __slots__ = ("ref", "envelope", "reply", "call", "scope", "withdrawn")

    def __init__(
        self,
        ref: ActorRef[Any],
        envelope: Envelope[Any],
        reply: Reply[Any] | None,
        call: _Call | None = None,
    ) -> None:
        self.ref = ref
        self.envelope = envelope
        self.reply = reply
        self.call = call
        self.scope: anyio.CancelScope | None = None
        self.withdrawn = False

    def withdraw(self) -> None:
        """The caller gave up: a delivery still waiting for room is not made. On the
        loop's thread (the stepped runtime: between iterations; the thread runtime: a
        callback scheduled by the caller)."""
        self.withdrawn = True
        if self.scope is not None:
            self.scope.cancel()

    def offer(self) -> bool:
        """Queue it now if there is room (True); on the loop's thread only."""
        try:
            queued = self.ref._offer(self.envelope)
        except Exception as exc:
            self.fail(exc)
            return True
        if queued and self.call is not None:
            self.call.finish()
        return queued

    def handle_now(self) -> bool:
        """Handle it at once (True) where its actor may take it now
        (:meth:`~kvferry.actors._cell._Cell.can_handle_now`); on the loop's thread, outside
        any iteration of the actor's task (a callback of the loop, or between iterations)."""
        msg, reply, hop = self.envelope
        cell = self.ref._cell
        if not cell.can_handle_now(msg) or (reply is not None and reply._abandoned):
            return False
        try:
            cell.handle_now(msg, reply, hop)  # the handler's own errors are dealt with there
        except Exception as exc:  # anything else: the caller must not wait forever
            self.fail(exc)
            return True
        if self.call is not None:
            self.call.finish()
        return True

    def fail(self, error: BaseException) -> None:
        if self.reply is not None:
            self.reply.fail(error)
        if self.call is not None:
            self.call.finish(error=error)


async def send_waiting(item: _Deliver) -> None:
    """Wait for room for a :class:`_Deliver` that found the mailbox full, in a task of
    its own (:func:`serve_deliveries`). Withdrawn (:meth:`_Deliver.withdraw`) or
    cancelled, it leaves the mailbox's queue of waiting senders and its caller, if still
    waiting, gets :class:`~kvferry.ActorStopped`; unless the actor had already taken it
    in: then a tell is delivered (its caller hears so; the actor handles it), and an
    ask is withdrawn all the same (abandoned: the actor drops it), unless answered."""
    with anyio.CancelScope() as scope:
        item.scope = scope
        if item.withdrawn or (item.reply is not None and item.reply._abandoned):
            scope.cancel()
        # A tell's call ends delivered the moment the actor takes it in, even as the
        # wait is cancelled: the ActorStopped below is then ignored (a call ends once).
        taken = item.call.finish if item.call is not None else None
        try:
            await item.ref._post(item.envelope, item.reply, taken)
        except Exception as exc:
            item.fail(exc)
            return
        except BaseException:
            item.fail(ActorStopped(f"not delivered to {item.ref.name}: the runtime is closing"))
            raise
        finally:
            item.scope = None
        if item.call is not None:
            item.call.finish()


async def serve_deliveries(
    serve: Callable[[TaskGroup], Awaitable[None]],
) -> None:
    """Run the call server ``serve(deliveries)``, where ``deliveries`` is the task group
    its waiting deliveries run in; once it returns (the close marker) or fails, cancel
    the deliveries still waiting (each fails with :class:`~kvferry.ActorStopped`) and
    wait for them, so that the system's shutdown starts with nothing of the server left.
    """
    async with anyio.create_task_group() as deliveries:
        try:
            await serve(deliveries)
        finally:
            deliveries.cancel_scope.cancel()


async def run_call(call: _Call) -> None:
    """Run one call to its outcome. A BaseException (cancellation, KeyboardInterrupt)
    is reported to the caller and then re-raised, which ends the server."""
    try:
        if call.hop is None:
            value = await call.fn(*call.args)
        else:
            with HopScope(call.hop):
                value = await call.fn(*call.args)
    except Exception as exc:
        call.finish(error=exc)
    except BaseException as exc:
        call.finish(error=exc)
        raise
    else:
        call.finish(value)


def ref_method(fn: Callable[..., Awaitable[Any]]) -> tuple[ActorRef[Any], str] | None:
    """``(ref, "ask" | "tell")`` when ``fn`` is ``ref.ask`` or ``ref.tell``, else None.

    The sync runtimes send those from the caller's side of the loop, without the call
    server: the facade's common calls then cost one loop iteration (stepped) or one
    cross-thread hop (thread).
    """
    ref = getattr(fn, "__self__", None)
    if isinstance(ref, ActorRef):
        func = getattr(fn, "__func__", None)
        if func is ActorRef.ask:
            return ref, "ask"
        if func is ActorRef.tell:
            return ref, "tell"
    return None


def route_ref_call(
    runtime: Any, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]
) -> tuple[bool, Any]:
    """``(True, result)`` when ``fn(*args)`` is ``ref.ask(make)`` / ``ref.tell(msg)``, sent
    the short way through ``runtime.ask`` / ``runtime.tell``; ``(False, None)`` otherwise."""
    routed = ref_method(fn)
    if routed is None or len(args) != 1:
        return False, None
    ref, kind = routed
    if kind == "ask":
        return True, runtime.ask(ref, args[0])
    runtime.tell(ref, args[0])
    return True, None


def _loop_running_here() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def start_runtime(kind: str, setup: Setup[S], **options: Any) -> tuple[Any, S]:
    """Start a runtime of ``kind`` ("stepped", "thread" or "auto") and run ``setup`` in it.

    "auto" is stepped (the cheapest call, no second thread competing for the GIL), unless
    this thread already runs an event loop, in which the stepped runtime cannot nest:
    then thread. ``options`` go to the runtime (``stop_timeout_s``, ``tracer_provider``).
    """
    from ._stepped import SteppedRuntime
    from ._thread import ThreadRuntime

    if kind == "auto":
        kind = "thread" if _loop_running_here() else "stepped"
    runtime: SteppedRuntime | ThreadRuntime
    if kind == "stepped":
        runtime = SteppedRuntime(**options)
    elif kind == "thread":
        runtime = ThreadRuntime(**options)
    else:
        raise ValueError(f"unknown runtime kind {kind!r} (stepped, thread or auto)")
    return runtime, runtime.start(setup)
