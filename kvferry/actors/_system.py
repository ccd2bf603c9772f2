"""ActorSystem: a task group that owns actors and timers, starts actors ready-signalled,
supervises them and stops them in dependency order within a deadline.

Who owns what: the system's task group owns every actor task and every timer task;
``spawn``, ``send_after``, ``send_every``, ``stop_all`` and the context manager's exit run
on the event loop that entered the system (the caller's own loop, or the loop of a
:class:`~kvferry.actors.SteppedRuntime` / :class:`~kvferry.actors.ThreadRuntime`).
Nothing here is thread-safe; the runtimes bring calls from other threads onto the loop.

Dependency order: an actor can only be handed the refs of actors that already exist, so
an actor spawned later may depend on earlier ones but not the reverse. Stopping last
spawned first lets every actor drain while the actors it talks to still answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import TracebackType
from typing import Any, TypeVar

import anyio
import attrs
from anyio.abc import TaskGroup
from opentelemetry import trace

from .._errors import ActorCrashed, ActorStopped
from .._logging import get_logger
from ._base import ActorRef, ActorStatistics
from ._cell import ActorSource, _Cell
from ._timers import Timer, start_timer

M = TypeVar("M")


@attrs.frozen(kw_only=True)
class ShutdownReport:
    """How a system (or a runtime) stopped."""

    timed_out: tuple[str, ...] = ()
    """Actors cancelled because they had not drained by the stop deadline."""
    crashed: tuple[str, ...] = ()
    """Actors escalated by their supervisor (their errors: ``ActorSystem.failures``)."""
    tasks_left: tuple[str, ...] = ()
    """Tasks still alive when a runtime closed its loop (always empty when shutdown works)."""

    @property
    def clean(self) -> bool:
        return not (self.timed_out or self.crashed or self.tasks_left)


class ActorSystem:
    """``async with ActorSystem() as system: ref = await system.spawn(MyActor())``.

    When an actor's supervisor gives up (its restart budget is spent) the actor is
    *escalated*: its error is recorded in :attr:`failures` and the whole system stops,
    cleanly and in dependency order. Every later ``tell``/``ask`` raises
    :class:`~kvferry.ActorStopped`, :meth:`raise_if_failed` raises
    :class:`~kvferry.ActorCrashed`, and so does leaving the ``async with`` block (unless
    the block itself raised).

    ``stop_timeout_s`` bounds the whole graceful shutdown; actors still busy at the
    deadline are cancelled. With a ``tracer_provider`` every handled message gets a
    ``handle message`` span, child of the sender's span.
    """

    def __init__(
        self,
        *,
        stop_timeout_s: float = 10.0,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        self._stop_timeout_s = stop_timeout_s
        self._tracer = (
            None
            if tracer_provider is None
            else trace.get_tracer("kvferry.actors", tracer_provider=tracer_provider)
        )
        self._tg: TaskGroup | None = None
        self._cells: list[_Cell[Any]] = []
        self._timers: set[Timer] = set()  # live timers only: each leaves when its task ends
        self._stop_done: anyio.Event | None = None  # exists once stopping began
        self._stopped: anyio.Event | None = None  # set once stopping ended
        self.failures: dict[str, BaseException] = {}
        """Escalated actors by name, with the error they were escalated with."""
        self.shutdown_report: ShutdownReport | None = None
        self._log = get_logger("kvferry.actors")

    async def __aenter__(self) -> ActorSystem:
        self._stopped = anyio.Event()
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
        if exc_type is None:
            self.raise_if_failed()
        return result

    @property
    def running(self) -> bool:
        return self._tg is not None and self._stop_done is None

    def _check_running(self) -> TaskGroup:
        if self._tg is None or self._stop_done is not None:
            raise RuntimeError("ActorSystem is not running (use `async with`, before it stops)")
        return self._tg

    async def spawn(self, actor: ActorSource[M], *, name: str | None = None) -> ActorRef[M]:
        """Start an actor and return its ref once :meth:`Actor.on_start` returned.

        ``actor`` is an instance (a restart keeps its state, see ``on_restart``) or a
        factory called for the first start and for every restart (fresh state).
        Raises whatever ``on_start`` raised; names are unique within a system. An actor
        still starting when the system begins to stop is stopped with the others (in
        its place in the order): its ``spawn`` returns a ref to a stopped actor, or
        raises :class:`~kvferry.ActorStopped` if the stop deadline cut ``on_start`` short.
        """
        tg = self._check_running()
        cell: _Cell[M] = _Cell(self, actor, name, self._tracer)
        if any(c.name == cell.name for c in self._cells):
            raise ValueError(f"an actor named {cell.name!r} already runs in this system")
        # Registered before it starts, so that a stop beginning meanwhile stops it too.
        self._cells.append(cell)
        try:
            await tg.start(cell.run, name=f"actor {cell.name}")
        except BaseException as exc:
            if cell.stopped.is_set():  # it never ran: its name is free again
                self._cells.remove(cell)
            if cell._kill and isinstance(exc, RuntimeError):
                # Cancelled in on_start by the stop deadline: anyio's "exited without
                # calling started" says nothing useful.
                raise ActorStopped(f"actor {cell.name} was stopped while starting") from None
            raise
        return ActorRef(cell)

    def send_after(self, delay_s: float, ref: ActorRef[M], msg: M) -> Timer:
        """Tell ``msg`` to ``ref`` after ``delay_s`` seconds of the anyio clock."""
        return self._start_timer(Timer(ref, msg, delay_s, periodic=False))

    def send_every(self, interval_s: float, ref: ActorRef[M], msg: M) -> Timer:
        """Tell ``msg`` to ``ref`` every ``interval_s`` seconds (first after one interval).

        A tick that finds the mailbox full is dropped and counted (``Timer.dropped``).
        """
        return self._start_timer(Timer(ref, msg, interval_s, periodic=True))

    def _start_timer(self, timer: Timer) -> Timer:
        tg = self._check_running()
        self._timers.add(timer)
        timer.on_end = self._timers.discard
        return start_timer(tg, timer)

    def statistics(self) -> tuple[ActorStatistics, ...]:
        """Every actor's counters, in spawn order."""
        return tuple(c.statistics() for c in self._cells)

    async def stop_all(self) -> ShutdownReport:
        """Stop timers, then every actor, last spawned first, within the stop deadline.

        Each actor handles what it has queued before the next one is stopped. An actor
        still busy at the deadline is cancelled (its queued asks fail with
        :class:`~kvferry.ActorStopped`), and so is every one after it. Safe to call
        twice; a second call waits for the first. Shielded: an outer cancellation does
        not cut the shutdown short (the deadline does).
        """
        if self._stop_done is not None:
            await self._stop_done.wait()
            assert self.shutdown_report is not None
            return self.shutdown_report
        self._stop_done = anyio.Event()
        timed_out: list[str] = []
        with anyio.CancelScope(shield=True):
            for timer in list(self._timers):
                timer.cancel()
            deadline = anyio.current_time() + self._stop_timeout_s
            for cell in self._cells_to_stop():
                cell.close(drain=True)
                with anyio.CancelScope(deadline=deadline):
                    await cell.stopped.wait()
                if not cell.stopped.is_set():
                    timed_out.append(cell.name)
                    self._log.error("actor_stop_timed_out", actor=cell.name)
                    cell.close(drain=False)
                    await cell.stopped.wait()
        self.shutdown_report = ShutdownReport(
            timed_out=tuple(timed_out), crashed=tuple(self.failures)
        )
        self._stop_done.set()
        if self._stopped is not None:
            self._stopped.set()
        return self.shutdown_report

    def _cells_to_stop(self) -> Iterator[_Cell[Any]]:
        """Every cell, last spawned first, each once; a cell registered while the
        stopping runs (by a spawn that began before it) is stopped too."""
        done: set[int] = set()
        while True:
            cell = next((c for c in reversed(self._cells) if id(c) not in done), None)
            if cell is None:
                return
            done.add(id(cell))
            yield cell

    async def wait_stopped(self) -> ShutdownReport:
        """Wait until the system has stopped (after an escalation, or ``stop_all``)."""
        if self._stopped is None:
            raise RuntimeError("ActorSystem was never entered (use `async with`)")
        await self._stopped.wait()
        assert self.shutdown_report is not None
        return self.shutdown_report

    def _escalated(self, cell: _Cell[Any], error: BaseException) -> None:
        """Called by a cell whose supervisor gave up: record it and stop the system."""
        self.failures[cell.name] = error
        if self._stop_done is None and self._tg is not None:
            self._tg.start_soon(self.stop_all, name="stop after escalation")

    def raise_if_failed(self) -> None:
        """Raise :class:`~kvferry.ActorCrashed` if an actor was escalated."""
        if self.failures:
            name, error = next(iter(self.failures.items()))
            raise ActorCrashed(f"actor {name} crashed: {error!r}") from error
