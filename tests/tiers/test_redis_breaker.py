"""The circuit breaker on a stepped clock: no sleeps."""

from __future__ import annotations

from kvferry.tiers import CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_it_opens_after_threshold_consecutive_failures() -> None:
    breaker = CircuitBreaker(threshold=3, cooldown_s=10, clock=Clock())
    for _ in range(2):
        assert breaker.begin() == "send"
        breaker.failed()
    assert breaker.state == "closed"
    assert breaker.begin() == "send"
    breaker.failed()
    assert breaker.state == "open" and breaker.statistics().opens == 1


def test_a_success_resets_the_count_of_failures() -> None:
    breaker = CircuitBreaker(threshold=2, cooldown_s=10, clock=Clock())
    breaker.failed()
    breaker.succeeded()
    breaker.failed()
    assert breaker.state == "closed" and breaker.statistics().consecutive_failures == 1


def test_while_open_every_operation_is_rejected_and_counted() -> None:
    clock = Clock()
    breaker = CircuitBreaker(threshold=1, cooldown_s=10, clock=clock)
    breaker.failed()
    clock.now += 9.9
    assert [breaker.begin() for _ in range(3)] == ["reject"] * 3
    assert breaker.statistics().rejected == 3


def test_after_the_cooldown_one_caller_probes_and_the_others_wait() -> None:
    clock = Clock()
    breaker = CircuitBreaker(threshold=1, cooldown_s=10, clock=clock)
    breaker.failed()
    clock.now += 10
    assert breaker.begin() == "probe"
    assert breaker.state == "half_open"
    assert breaker.begin() == "reject"  # one probe at a time
    breaker.probed(True)
    assert breaker.state == "closed" and breaker.begin() == "send"


def test_a_failed_probe_opens_it_for_another_cooldown() -> None:
    clock = Clock()
    breaker = CircuitBreaker(threshold=1, cooldown_s=10, clock=clock)
    breaker.failed()
    clock.now += 10
    assert breaker.begin() == "probe"
    breaker.probed(False)
    assert breaker.state == "open" and breaker.statistics().opens == 2
    clock.now += 9
    assert breaker.begin() == "reject"
    clock.now += 1
    assert breaker.begin() == "probe"


def test_late_failures_of_operations_sent_before_it_opened_do_not_reopen_it() -> None:
    clock = Clock()
    breaker = CircuitBreaker(threshold=1, cooldown_s=10, clock=clock)
    breaker.failed()
    breaker.failed()
    assert breaker.statistics().opens == 1
