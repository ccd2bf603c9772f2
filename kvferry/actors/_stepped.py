"""SteppedRuntime: the actors' event loop runs on the caller's thread, during calls only.

``call(ref.ask, make)`` puts the message in the actor's mailbox from this thread and runs
the loop until the reply is set, so an actor that answers at once costs one loop
iteration. ``call(ref.tell, msg)`` only queues (the actor handles it
in the next call's iterations). Shorter still, an ask or tell of a type the actor names
``immediate`` is handled on this thread without an iteration when nothing is in the way:
the actor waits at an empty mailbox and the loop is quiescent (no callback ready, no timer
due, no socket watched: :meth:`LoopStepper.quiescent <kvferry._private_api.LoopStepper>`),
so the message comes in the same order and nothing else waits on it. Any other
``call(fn, *args)`` goes to the call server (a task of the actor system) and runs the loop
until the server has finished it. Then the loop stops and every actor task stays
suspended until the next call. No second thread competes with the engine for the GIL, and
no call creates a task or runs ``run_until_complete``. Work that completes between calls
(a copy thread's future, an expired timer) is picked up by the next call's iterations.

This is the one module of kvferry that drives asyncio directly: a loop cannot be stepped
through anyio. Where CPython's loop allows, it is stepped through its private
``_run_once``, a sixth of a call cheaper (:class:`kvferry._private_api.LoopStepper`, which
probes for it at start and otherwise runs ``run_forever`` until the step's end stops it).
Everything that runs *inside* the loop (actors, the call server's calls) uses anyio only.

Who owns what: the runtime owns its loop, the host task (which holds the actor system
open) and the call queue. ``start``, ``call`` and ``close`` must come from one thread at
a time, and never from inside the loop (a handler cannot ``call`` its own runtime).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import attrs
from anyio.abc import TaskGroup
from opentelemetry import trace

from .._errors import ActorCrashed, ActorStopped
from .._logging import get_logger
from .._private_api import LoopStepper
from ._base import ActorRef, MakeAsk, Reply
from ._context import capture
from ._runtime import (
    Setup,
    _Call,
    _Deliver,
    _loop_running_here,
    route_ref_call,
    run_call,
    send_waiting,
    serve_deliveries,
)
from ._system import ActorSystem, ShutdownReport

T = TypeVar("T")
S = TypeVar("S")
M = TypeVar("M")


class SteppedRuntime:
    """Runs the actors' loop on the calling thread for the duration of each call."""

    def __init__(
        self,
        *,
        stop_timeout_s: float = 10.0,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        # A loop of our own, never installed as the thread's current loop.
        self._runner = asyncio.Runner(loop_factory=asyncio.new_event_loop)
        self._stop_timeout_s = stop_timeout_s
        self._tracer_provider = tracer_provider
        self._loop: asyncio.AbstractEventLoop | None = None
        self._host: asyncio.Task[None] | None = None
        self._queue: deque[_Call | _Deliver | None] = deque()
        self._stepper: LoopStepper | None = None
        self._wakeup: asyncio.Future[None] | None = None
        self._busy = False
        self._report: ShutdownReport | None = None
        self.sent = 0
        """Asks and tells sent through :meth:`ask` and :meth:`tell` (``call`` included)."""
        self.handled_now = 0
        """Of those, the ones handled on the calling thread, without a loop iteration."""
        self._log = get_logger("kvferry.actors", runtime="stepped")
        self.system: ActorSystem

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "start() first"
        return self._loop

    def start(self, setup: Setup[S]) -> S:
        """Open the actor system, run ``setup(system)`` in it, and return its result."""
        if _loop_running_here():
            raise RuntimeError(
                "SteppedRuntime cannot run inside a running event loop: use ThreadRuntime "
                "or `async with ActorSystem()`"
            )
        loop = self._loop = self._runner.get_loop()
        stepper = self._stepper = LoopStepper(loop)
        ready = _Call(setup, ())
        host = self._host = loop.create_task(self._host_main(ready), name="kvferry host")
        # Whatever ends the host (done, crashed) must also end the step in progress.
        host.add_done_callback(lambda _: stepper.set())
        try:
            self._step_until(ready)
            return ready.result()  # type: ignore[no-any-return]
        except BaseException:
            self.close()
            raise

    async def _host_main(self, ready: _Call) -> None:
        loop = asyncio.get_running_loop()
        assert self._stepper is not None
        end_step = self._stepper.set
        try:
            async with ActorSystem(
                stop_timeout_s=self._stop_timeout_s, tracer_provider=self._tracer_provider
            ) as system:
                self.system = system
                ready.args = (system,)
                await run_call(ready)
                end_step()
                if ready.error is None:
                    await serve_deliveries(
                        lambda deliveries: self._serve(loop, end_step, deliveries)
                    )
        except ActorCrashed:
            pass  # already reported: by calls, by the log, and in the shutdown report

    async def _serve(
        self,
        loop: asyncio.AbstractEventLoop,
        end_step: Callable[[], None],
        deliveries: TaskGroup,
    ) -> None:
        """The call server: one call at a time, in this (the host) task; a delivery to a
        full mailbox waits for room in a task of its own, in ``deliveries``."""
        queue = self._queue

        async def deliver(item: _Deliver) -> None:
            await send_waiting(item)
            end_step()  # its caller may wait for it

        while True:
            while not queue:
                self._wakeup = loop.create_future()
                await self._wakeup
            item = queue.popleft()
            if item is None:
                return
            if isinstance(item, _Deliver):
                deliveries.start_soon(deliver, item, name=f"deliver to {item.ref.name}")
                continue
            await run_call(item)
            # Ends this step after the current iteration: the actors that the call woke
            # have run as far as they could without waiting.
            end_step()

    def _step_until(self, done: _Call | Reply[Any], timeout: float | None = None) -> None:
        """Run the loop on this thread until ``done`` is (or ``timeout`` seconds passed)."""
        assert self._loop is not None and self._host is not None and self._stepper is not None
        loop, host, stepper = self._loop, self._host, self._stepper
        deadline = None if timeout is None else loop.time() + timeout
        # Without a timer at the deadline, select() could sleep past it.
        alarm = None if deadline is None else loop.call_at(deadline, stepper.set)

        def check() -> None:
            if host.done():
                error = None if host.cancelled() else host.exception()
                raise ActorStopped("the stepped runtime's host task ended") from error
            if deadline is not None and loop.time() >= deadline:
                raise TimeoutError(f"no answer within {timeout} s")

        self._busy = True
        try:
            stepper.run_until(lambda: done.done, check)
        finally:
            self._busy = False
            if alarm is not None:
                alarm.cancel()

    def _submit(self, item: _Call | _Deliver | None) -> None:
        self._queue.append(item)
        wakeup = self._wakeup
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    def _check_open(self) -> None:
        if self._busy:
            raise RuntimeError("SteppedRuntime is not reentrant (called from its own loop?)")
        host = self._host
        if host is None or host.done():
            raise ActorStopped("the stepped runtime is closed")
        if self.system.failures:
            self.system.raise_if_failed()

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the loop, on this thread, and return its result.

        ``ref.ask`` and ``ref.tell`` take the short way (:meth:`ask`, :meth:`tell`).
        Raises what ``fn`` raised; :class:`~kvferry.ActorCrashed` if an actor of the
        system was escalated; :class:`~kvferry.ActorStopped` once the runtime is closed.
        """
        routed, value = route_ref_call(self, fn, args)
        if routed:
            return value  # type: ignore[no-any-return]
        self._check_open()
        call = _Call(fn, args)
        self._submit(call)
        self._step_until(call)
        return call.result()  # type: ignore[no-any-return]

    def ask(self, ref: ActorRef[M], make: MakeAsk[T, M], *, timeout: float | None = None) -> T:
        """``ref.ask(make)`` from sync code: queue the message from this thread, then run
        the loop until the answer is set (the answer stops the loop).

        Raises :class:`TimeoutError` after ``timeout`` seconds (the ask is withdrawn if
        still queued), and what ``ref.ask`` raises.
        """
        self._check_open()
        self.sent += 1
        cell = ref._cell
        stepper = self._stepper
        # The loop's state is read only for an actor that names immediate messages.
        if stepper is not None and cell.actor.immediate and stepper.quiescent():
            reply, envelope = ref._prepare_ask(make, None)
            if cell.can_handle_now(envelope[0]):
                stepper.run_now(cell.handle_now, envelope[0], reply, envelope[2])
                self.handled_now += 1
                return reply.result()
            reply._event = stepper
        else:
            reply, envelope = ref._prepare_ask(make, stepper)
        item = _Deliver(ref, envelope, reply)
        if not item.offer():
            self._submit(item)  # full: the call server waits for room
        try:
            self._step_until(reply, timeout)
        except BaseException:
            reply._abandoned = True
            self._withdraw(item)
            raise
        return reply.result()

    def tell(self, ref: ActorRef[M], msg: M) -> None:
        """``ref.tell(msg)`` from sync code: queue it; the actor handles it during the
        next call. Waits (runs the loop) only while the mailbox is full."""
        self._check_open()
        self.sent += 1
        cell = ref._cell
        stepper = self._stepper
        if stepper is not None and cell.can_handle_now(msg) and stepper.quiescent():
            stepper.run_now(cell.handle_now, msg, None, capture())
            self.handled_now += 1
            return
        call = _Call(ref.tell, (msg,))
        item = _Deliver(ref, (msg, None, call.hop), None, call)
        if not item.offer():
            self._submit(item)
            try:
                self._step_until(call)
            except BaseException:
                self._withdraw(item)
                raise
        call.result()

    def _withdraw(self, item: _Deliver) -> None:
        """A delivery whose caller gave up: not made if it still waits for room (the
        loop's next iteration takes it out of the mailbox's waiting senders)."""
        stepper, host = self._stepper, self._host
        if stepper is not None and host is not None and not host.done():
            stepper.run_now(item.withdraw)

    def close(self) -> ShutdownReport:
        """Stop the actors (dependency order, within the deadline), then close the loop.

        Idempotent. The report's ``tasks_left`` names tasks still alive once the system
        stopped, before the loop cancels them: empty when shutdown left nothing behind.
        """
        if self._report is not None:
            return self._report
        if self._busy:
            raise RuntimeError("SteppedRuntime.close() from inside its own loop")
        tasks_left: tuple[str, ...] = ()
        host, loop = self._host, self._loop
        if host is not None and loop is not None:
            if not host.done():
                assert self._stepper is not None
                self._submit(None)
                self._busy = True
                try:
                    self._stepper.run_until(host.done, lambda: None)
                finally:
                    self._busy = False
            if not host.cancelled() and host.exception() is not None:
                self._log.error("runtime_host_failed", exc_info=host.exception())
            tasks_left = tuple(sorted(t.get_name() for t in asyncio.all_tasks(loop)))
            if tasks_left:
                self._log.error("tasks_left_behind", tasks=list(tasks_left))
        self._runner.close()  # cancels what is left, stops anyio's idle worker threads
        system = getattr(self, "system", None)
        base = (system.shutdown_report if system is not None else None) or ShutdownReport()
        self._report = attrs.evolve(base, tasks_left=tasks_left)
        return self._report
