"""CircuitBreaker: stop sending to a remote tier that keeps failing, and re-probe it.

States: ``closed`` (every operation is sent), ``open`` (none is: each is an immediate
miss or a dropped store, counted by the caller), ``half_open`` (the cool-down is over:
one probe is in flight, everything else still waits). ``threshold`` consecutive
failures (a connection error, a timeout) open it; a success resets the count. After
``cooldown_s`` the next caller is told to probe (:meth:`CircuitBreaker.begin`); the probe's
success closes the breaker, its failure opens it for another cool-down.

Who owns what: one event loop; not thread-safe (the Redis store and its actor run on one
loop). The clock is injectable, so tests step it instead of sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

import attrs

BreakerState = Literal["closed", "open", "half_open"]
Admission = Literal["send", "probe", "reject"]


@attrs.frozen(kw_only=True)
class BreakerStatistics:
    """A snapshot of a :class:`CircuitBreaker`."""

    state: BreakerState
    consecutive_failures: int
    opens: int
    """Times it opened (from closed or after a failed probe)."""
    probes: int
    rejected: int
    """Operations not sent because it was open."""


class CircuitBreaker:
    """See the module docstring. ``clock``: seconds, monotonic (injectable for tests)."""

    def __init__(
        self,
        *,
        threshold: int = 5,
        cooldown_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if threshold < 1 or not cooldown_s >= 0:
            raise ValueError("threshold must be >= 1 and cooldown_s >= 0")
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._state: BreakerState = "closed"
        self._failures = 0
        self._opened_at = 0.0
        self._opens = 0
        self._probes = 0
        self._rejected = 0

    @property
    def state(self) -> BreakerState:
        return self._state

    def begin(self) -> Admission:
        """Before an operation: ``"send"`` it; ``"probe"`` first (the caller then reports
        the probe with :meth:`probed`); or ``"reject"`` it (counted here)."""
        if self._state == "closed":
            return "send"
        if self._state == "open" and self._clock() - self._opened_at >= self.cooldown_s:
            self._state = "half_open"
            self._probes += 1
            return "probe"
        self._rejected += 1
        return "reject"

    def probed(self, ok: bool) -> None:
        """The probe :meth:`begin` asked for answered (``ok``) or failed."""
        assert self._state == "half_open", self._state
        if ok:
            self._state = "closed"
            self._failures = 0
        else:
            self._open()

    def succeeded(self) -> None:
        """An operation sent got its answer (whatever it said)."""
        if self._state == "closed":
            self._failures = 0

    def failed(self) -> None:
        """An operation sent failed to get an answer (connection error, timeout)."""
        if self._state != "closed":
            return  # already open: the failure of an operation sent before it opened
        self._failures += 1
        if self._failures >= self.threshold:
            self._open()

    def _open(self) -> None:
        self._state = "open"
        self._opened_at = self._clock()
        self._opens += 1

    def statistics(self) -> BreakerStatistics:
        return BreakerStatistics(
            state=self._state,
            consecutive_failures=self._failures,
            opens=self._opens,
            probes=self._probes,
            rejected=self._rejected,
        )
