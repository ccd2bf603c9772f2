"""Timers on the anyio clock: a message sent once after a delay, or periodically.

They sleep with :func:`anyio.sleep_until`, so a test on trio's ``MockClock`` runs them
on virtual time: a 10-second tick costs no real time.

Who owns what: a :class:`Timer` is one task in its :class:`ActorSystem`'s task group;
its counters are written by that task only. :meth:`Timer.cancel` may be called from any
task on the same loop. The system cancels every timer first when it stops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc

from .._errors import ActorStopped
from .._logging import get_logger
from ._base import ActorRef


class Timer:
    """A scheduled send. ``fired`` counts messages delivered; ``dropped`` periodic ticks
    skipped because the mailbox was full or the loop fell behind (a tick only says "it is
    time again", so the next one carries the same news).
    """

    def __init__(self, ref: ActorRef[Any], msg: object, interval_s: float, periodic: bool) -> None:
        if periodic and not interval_s > 0:
            raise ValueError(f"a periodic timer needs an interval > 0, got {interval_s}")
        if not interval_s >= 0:
            raise ValueError(f"delay must be >= 0, got {interval_s}")
        self.ref = ref
        self.msg = msg
        self.interval_s = interval_s
        self.periodic = periodic
        self.fired = 0
        self.dropped = 0
        self.active = True
        self._scope = anyio.CancelScope()
        self.on_end: Callable[[Timer], object] | None = None
        """Called once when the timer's task ends (the system forgets the timer then)."""

    def __repr__(self) -> str:
        kind = "every" if self.periodic else "after"
        return f"<Timer {kind} {self.interval_s}s → {self.ref.name}: {type(self.msg).__name__}>"

    def cancel(self) -> None:
        """Stop the timer; a message already being delivered may still arrive."""
        self._scope.cancel()

    async def run(self) -> None:
        try:
            with self._scope:
                if self.periodic:
                    await self._every()
                else:
                    await anyio.sleep(self.interval_s)
                    await self.ref.tell(self.msg)
                    self.fired += 1
        except ActorStopped:
            pass  # the receiver is gone: nothing left to time
        finally:
            self.active = False
            if self.on_end is not None:
                self.on_end(self)

    async def _every(self) -> None:
        interval = self.interval_s
        # Deadlines are start + k * interval, so the ticks do not drift with handler time.
        due = anyio.current_time() + interval
        while True:
            await anyio.sleep_until(due)
            try:
                self.ref.tell_nowait(self.msg)
                self.fired += 1
            except anyio.WouldBlock:
                self.dropped += 1
                get_logger("kvferry.actors").debug(
                    "tick_dropped", actor=self.ref.name, message=type(self.msg).__name__
                )
            due += interval
            now = anyio.current_time()
            if due <= now:  # the loop was blocked past whole periods: skip them, keep phase
                missed = int((now - due) // interval) + 1
                self.dropped += missed
                due += missed * interval


def start_timer(tg: anyio.abc.TaskGroup, timer: Timer) -> Timer:
    tg.start_soon(timer.run, name=repr(timer))
    return timer
