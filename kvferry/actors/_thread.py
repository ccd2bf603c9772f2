"""ThreadRuntime: the actors' event loop runs on a dedicated thread.

A sync call puts an item on the inbox and wakes the loop thread with one call of the
backend's own public thread-safe scheduling (asyncio's ``loop.call_soon_threadsafe``,
trio's ``TrioToken.run_sync_soon``; :func:`loop_waker`), without the second round trip
and the task per call of anyio's ``BlockingPortal``; the caller then blocks on a lock.
On the loop thread, ``_pump`` takes the items: an ask or a tell goes straight into the
actor's mailbox, and the actor's answer releases the caller's lock, so that
``call(ref.ask, make)`` costs one hop there and one back. An actor's ``immediate``
message, when the actor waits at an empty mailbox, is handled right there in ``_pump``
(as the stepped runtime handles it on the engine thread), without waking the actor's
task: the same handler, in the same place in the actor's order, one loop turn fewer.
Any other call goes to the call server (a task of the actor system), which releases the
lock when it returns.

Who owns what: the loop thread owns the loop, the actor system, the call server and
its queue; a caller thread owns nothing but its pending item. The inbox is a deque
(appends and pops are atomic); ``_guard`` orders "closing" against "queueing", so no
item is queued after the final drain and left waiting forever.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import attrs
from anyio.abc import TaskGroup
from opentelemetry import trace

from .._errors import ActorCrashed, ActorStopped
from .._logging import get_logger
from ._base import ActorRef, MakeAsk
from ._runtime import (
    Setup,
    _Call,
    _Deliver,
    route_ref_call,
    run_call,
    send_waiting,
    serve_deliveries,
)
from ._system import ActorSystem, ShutdownReport

T = TypeVar("T")
S = TypeVar("S")
M = TypeVar("M")

_Item = _Call | _Deliver

Waker = Callable[[Callable[[], object]], None]
"""Schedules a callback on the loop from any thread; raises :class:`LoopEnded` once the
loop has ended."""


class LoopEnded(Exception):
    """The loop a :data:`Waker` would wake has ended."""


def loop_waker(backend: str) -> Waker:
    """The current loop's cross-thread wake-up, through the backend's public API.

    Called on the loop's own thread. asyncio: ``loop.call_soon_threadsafe``; trio:
    ``TrioToken.run_sync_soon``. (anyio's ``from_thread`` adds a task or a context copy
    per call, which is what this runtime avoids.)
    """
    if backend == "asyncio":
        import asyncio

        loop = asyncio.get_running_loop()
        schedule = loop.call_soon_threadsafe

        def wake_asyncio(fn: Callable[[], object]) -> None:
            try:
                schedule(fn)
            except RuntimeError as exc:  # "Event loop is closed"
                if loop.is_closed():
                    raise LoopEnded from exc
                raise

        return wake_asyncio
    if backend == "trio":
        import trio

        run_sync_soon = trio.lowlevel.current_trio_token().run_sync_soon

        def wake_trio(fn: Callable[[], object]) -> None:
            try:
                run_sync_soon(fn)
            except trio.RunFinishedError as exc:
                raise LoopEnded from exc

        return wake_trio
    raise ValueError(f"unknown backend {backend!r} (asyncio or trio)")


class _LockWaker:
    """A reply's waker on the thread runtime: the answer releases the asking thread."""

    __slots__ = ("lock",)

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()

    def set(self) -> None:
        self.lock.release()


class ThreadRuntime:
    """Runs the actors' loop on a thread of its own; each call is one round trip to it."""

    def __init__(
        self,
        *,
        stop_timeout_s: float = 10.0,
        tracer_provider: trace.TracerProvider | None = None,
        backend: str = "asyncio",
    ) -> None:
        self._stop_timeout_s = stop_timeout_s
        self._tracer_provider = tracer_provider
        self._backend = backend
        self._inbox: deque[_Item | None] = deque()  # caller threads → loop thread
        self._queue: deque[_Item | None] = deque()  # pump → call server (loop thread)
        self._guard = threading.Lock()
        self._closing = False
        self._wake: anyio.Event | None = None
        self._waker: Waker | None = None
        self._thread: threading.Thread | None = None
        self._tasks_left: tuple[str, ...] = ()
        self._report: ShutdownReport | None = None
        self._log = get_logger("kvferry.actors", runtime="thread")
        self.handled_now = 0
        """Asks and tells handled on the loop thread as they arrived, without a turn of
        the actor's task (its ``immediate`` messages, when it waits at an empty mailbox)."""
        self.system: ActorSystem

    def start(self, setup: Setup[S]) -> S:
        """Start the loop thread, open the actor system, run ``setup`` in it; its result."""
        ready = _Call(setup, (), lock=threading.Lock())
        ready.lock.acquire()
        self._thread = threading.Thread(
            target=self._main, args=(ready,), name="kvferry-loop", daemon=True
        )
        self._thread.start()
        ready.lock.acquire()
        if ready.error is not None:
            self.close()
        return ready.result()  # type: ignore[no-any-return]

    # -- the loop thread ---------------------------------------------------------------

    def _main(self, ready: _Call) -> None:
        try:
            anyio.run(self._host_main, ready, backend=self._backend)
        except BaseException as exc:
            self._log.error("runtime_host_failed", exc_info=exc)
            ready.finish(error=exc)
        finally:
            with self._guard:
                self._closing = True
                left = [*self._inbox, *self._queue]
                self._inbox.clear()
                self._queue.clear()
            error = ActorStopped("the thread runtime closed before the call ran")
            for item in left:
                if isinstance(item, _Deliver):
                    item.fail(error)
                elif item is not None:
                    item.finish(error=error)

    async def _host_main(self, ready: _Call) -> None:
        self._waker = loop_waker(self._backend)
        before = {t.id for t in anyio.get_running_tasks()}
        try:
            async with ActorSystem(
                stop_timeout_s=self._stop_timeout_s, tracer_provider=self._tracer_provider
            ) as system:
                self.system = system
                ready.args = (system,)
                await run_call(ready)
                if ready.error is None:
                    await serve_deliveries(self._serve)
        except ActorCrashed:
            pass  # already reported: by calls, by the log, and in the shutdown report
        finally:
            # Trio's own system tasks (named "<...>", e.g. the one that runs
            # run_sync_soon callbacks) live as long as the run; they are not ours.
            self._tasks_left = tuple(
                sorted(
                    str(t.name)
                    for t in anyio.get_running_tasks()
                    if t.id not in before and not str(t.name).startswith("<")
                )
            )

    async def _serve(self, deliveries: TaskGroup) -> None:
        """The call server: one call at a time, in the host task; a delivery to a full
        mailbox waits for room in a task of its own, in ``deliveries``."""
        queue = self._queue
        while True:
            # No await between this check and the wait: a wakeup (run on this thread)
            # cannot fall in between and be lost.
            while not queue:
                self._wake = anyio.Event()
                await self._wake.wait()
            item = queue.popleft()
            if item is None:
                return
            if isinstance(item, _Deliver):
                deliveries.start_soon(send_waiting, item, name=f"deliver to {item.ref.name}")
            else:
                await run_call(item)

    def _pump(self) -> None:
        """On the loop thread: deliver asks and tells, hand the rest to the server."""
        inbox, queue = self._inbox, self._queue
        handed = False
        while inbox:
            item = inbox.popleft()
            if isinstance(item, _Deliver):
                if item.handle_now():
                    self.handled_now += 1
                    continue
                if item.offer():
                    continue
            queue.append(item)  # a call, the close marker, or a delivery to a full mailbox
            handed = True
        if handed and self._wake is not None:
            self._wake.set()

    # -- caller threads ----------------------------------------------------------------

    def _post(self, item: _Item | None) -> None:
        with self._guard:
            if self._closing and item is not None:
                raise ActorStopped("the thread runtime is closed")
            self._inbox.append(item)
        waker = self._waker
        assert waker is not None
        try:
            waker(self._pump)
        except LoopEnded:
            pass  # _main fails whatever is still queued

    def _check_open(self) -> None:
        if self._thread is None or threading.current_thread() is self._thread:
            raise RuntimeError("ThreadRuntime used before start(), or from its own loop thread")
        system = getattr(self, "system", None)
        if system is not None and system.failures:
            system.raise_if_failed()

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the loop thread; block until it returns, and return that.

        ``ref.ask`` and ``ref.tell`` take the short way (:meth:`ask`, :meth:`tell`).
        Raises what ``fn`` raised; :class:`~kvferry.ActorCrashed` if an actor of the
        system was escalated; :class:`~kvferry.ActorStopped` once the runtime is closed.
        """
        routed, value = route_ref_call(self, fn, args)
        if routed:
            return value  # type: ignore[no-any-return]
        self._check_open()
        call = _Call(fn, args, lock=threading.Lock())
        call.lock.acquire()
        self._post(call)
        call.lock.acquire()
        return call.result()  # type: ignore[no-any-return]

    def ask(self, ref: ActorRef[M], make: MakeAsk[T, M], *, timeout: float | None = None) -> T:
        """``ref.ask(make)`` from this thread: one hop to the loop thread and one back.

        Raises :class:`TimeoutError` after ``timeout`` seconds (the ask is withdrawn if
        still queued), and what ``ref.ask`` raises.
        """
        self._check_open()
        waker = _LockWaker()
        reply, envelope = ref._prepare_ask(make, waker)
        item = _Deliver(ref, envelope, reply)
        self._post(item)
        if not waker.lock.acquire(timeout=-1 if timeout is None else timeout):
            reply._abandoned = True  # read by the actor's task; a plain flag is enough
            waker_ = self._waker
            assert waker_ is not None
            try:
                waker_(item.withdraw)  # if it still waits for room, it is not delivered
            except LoopEnded:
                pass
            raise TimeoutError(f"no answer from {ref.name} within {timeout} s")
        return reply.result()

    def tell(self, ref: ActorRef[M], msg: M) -> None:
        """``ref.tell(msg)`` from this thread: returns once the message is queued (waits
        while the mailbox is full)."""
        self._check_open()
        call = _Call(ref.tell, (msg,), lock=threading.Lock())
        call.lock.acquire()
        self._post(_Deliver(ref, (msg, None, call.hop), None, call))
        call.lock.acquire()
        call.result()

    def close(self) -> ShutdownReport:
        """Stop the actors (dependency order, within the deadline) and join the loop thread.

        Idempotent. ``tasks_left`` in the report names tasks other than the host still
        alive on the loop once the system stopped, and the loop thread if it did not end.
        """
        if self._report is not None:
            return self._report
        thread = self._thread
        if thread is None:
            self._report = ShutdownReport()
            return self._report
        if threading.current_thread() is thread:
            raise RuntimeError("ThreadRuntime.close() from its own loop thread")
        with self._guard:
            self._closing = True
        if self._waker is not None:
            self._post(None)
        # The system's own deadline bounds the shutdown; the margin covers loop teardown.
        thread.join(self._stop_timeout_s + 5.0)
        tasks_left = self._tasks_left
        if thread.is_alive():
            tasks_left = (*tasks_left, f"thread {thread.name}")
        if tasks_left:
            self._log.error("tasks_left_behind", tasks=list(tasks_left))
        system = getattr(self, "system", None)
        base = (system.shutdown_report if system is not None else None) or ShutdownReport()
        self._report = attrs.evolve(base, tasks_left=tasks_left)
        return self._report
