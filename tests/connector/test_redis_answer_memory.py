"""What the Redis tier's scheduler side remembers of its existence answers, and for how
long: expired answers are forgotten (an engine that sees many distinct prompts must not
hold every answer it ever had), a request whose answers were forgotten still waits afresh,
and an answer from a check sent before a reset, or before a fact that is forgotten now, is
not applied after it.

On a real redis-server. A check's answer is waited for through a semaphore released when
its handler ended, and held back, where a test needs it out, by an event (never a sleep);
the clocks are injected."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import numpy as np
import pytest

from kvferry.connector import _redis_tier
from kvferry.connector._redis_tier import ANSWER_TTL_S, RedisTier

from ..tiers.conftest import key as chunk_key
from ..tiers.redis_servers import RedisServer, redis_available
from ._redis_tiers import redis_name, tiers

pytestmark = pytest.mark.skipif(not redis_available(), reason="needs redis-server (make test)")

FAILED = np.array([1], np.int64)
"""A chunk's read or write failed (on one worker)."""
OK = np.array([0], np.int64)


@attrs.define
class Checks:
    answered: threading.Semaphore = attrs.field(factory=lambda: threading.Semaphore(0))
    """Released once per check the checker answered (queued, not drained yet)."""
    asked: threading.Semaphore = attrs.field(factory=lambda: threading.Semaphore(0))
    """Released once per check Redis answered (not handed to the engine thread yet)."""
    gate: threading.Event = attrs.field(factory=threading.Event)
    """Cleared: a check Redis answered stays out (its answer held back) until it is set."""
    fail: bool = False
    """Every check goes unanswered (a timeout, an error)."""


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> Checks:
    c = Checks()
    c.gate.set()
    handle = _redis_tier._Checker.handle
    ask = _redis_tier._Checker._ask

    async def signalled(self: Any, msg: Any) -> None:
        try:
            await handle(self, msg)
        finally:
            c.answered.release()

    async def gated(self: Any, keys: list[bytes]) -> Any:
        found = None if c.fail else await ask(self, keys)
        c.asked.release()
        await asyncio.to_thread(c.gate.wait, 30)
        return found

    monkeypatch.setattr(_redis_tier._Checker, "handle", signalled)
    monkeypatch.setattr(_redis_tier._Checker, "_ask", gated)
    return c


@pytest.fixture
def make_tier(redis_server: RedisServer, checks: Checks) -> Iterator[Callable[..., RedisTier]]:
    with tiers(redis_server) as make:
        try:
            yield make
        finally:
            checks.gate.set()  # a check held back ends, or the checker's runtime never stops


def check(tier: RedisTier, checks: Checks, keys: list[bytes]) -> None:
    """Ask Redis about ``keys`` in a check of their own, and wait until it answered."""
    tier.ask(keys)
    tier.flush()
    assert checks.asked.acquire(timeout=30)
    assert checks.answered.acquire(timeout=30)


def test_expired_answers_are_forgotten_and_a_request_still_waits_afresh(
    make_tier: Callable[..., RedisTier], redis_server: RedisServer, checks: Checks
) -> None:
    """Answers expired are dropped from memory, not kept until MAX_ANSWERS (262,144) of
    them pile up. A request that began to wait before they were answered and comes back
    after they were forgotten still counts them answered (its wait restarts, a new
    question), unless the question is still out."""
    now = [100.0]
    tier = make_tier(lambda: now[0])
    keys = [chunk_key(i) for i in range(1, 4)]
    redis_server.cli("set", redis_name(redis_server, keys[0]), "a value")
    check(tier, checks, keys)
    present, unknown = tier.known(keys)
    assert present.tolist() == [True, False, False] and not unknown.any()
    assert tier.statistics().answers == 3

    now[0] += ANSWER_TTL_S + 0.5
    assert tier.known(keys)[1].all()
    assert tier.statistics().answers == 0  # forgotten, not merely untrusted
    assert tier.answered_since(keys, 100.0)  # the wait since 100.0 restarts

    late = chunk_key(4)
    tier.ask([late])  # a question to be sent: not answered
    assert not tier.answered_since([*keys, late], 100.0)
    tier.flush()  # sent, not drained: still not answered
    assert not tier.answered_since([*keys, late], 100.0)
    assert checks.asked.acquire(timeout=30)
    assert checks.answered.acquire(timeout=30)
    assert tier.known([late])[1].tolist() == [False]
    assert tier.answered_since([*keys, late], 100.0)


def test_a_fact_learnt_again_is_kept_as_long_as_its_last_stamp(
    make_tier: Callable[..., RedisTier],
) -> None:
    """A key learnt again moves to the end: forgetting the oldest answers does not take it
    with its first stamp."""
    now = [100.0]
    tier = make_tier(lambda: now[0])
    a, b = chunk_key(1), chunk_key(2)
    tier.prepare_writes([a, b])
    tier.writes_ended(np.array([0], np.int64), [a], OK)  # a: present at 100
    now[0] = 101.0
    tier.writes_ended(np.array([1], np.int64), [b], OK)  # b: present at 101
    now[0] = 101.5
    tier.reads_ended([a], FAILED)  # a: absent at 101.5
    now[0] = 100.0 + ANSWER_TTL_S + 0.2  # a's first stamp expired, none of the last
    present, unknown = tier.known([a, b])
    assert present.tolist() == [False, True] and not unknown.any()
    assert tier.statistics().answers == 2
    now[0] = 101.0 + ANSWER_TTL_S + 0.2  # b expired: only a's last stamp is left
    assert tier.known([a, b])[1].tolist() == [False, True]
    assert tier.statistics().answers == 1


def test_a_failed_check_keeps_the_wait_it_ends(
    make_tier: Callable[..., RedisTier], checks: Checks
) -> None:
    """A question that went unanswered (Redis timing out) is no answer: a request whose
    keys have none does not wait afresh, or a Redis that never answers would hold it back
    for ``lookup_wait_ms`` again and again."""
    now = [100.0]
    tier = make_tier(lambda: now[0])
    k = chunk_key(1)
    checks.fail = True
    check(tier, checks, [k])
    assert tier.known([k])[1].tolist() == [True]
    assert tier.statistics().checks_unanswered == 1
    assert not tier.answered_since([k], 100.0)
    assert tier.answered_since([k], 100.5)  # a wait begun after the failure: answered


def hold_stale_present(
    tier: RedisTier, redis_server: RedisServer, checks: Checks, k: bytes
) -> None:
    """A check of ``k`` sent while ``k`` is in Redis, held back; then the chunk's read fails
    (the reader found it damaged and deleted it): Redis's coming "there" is older."""
    name = redis_name(redis_server, k)
    redis_server.cli("set", name, "a value")
    checks.gate.clear()
    tier.ask([k])
    tier.flush()
    assert checks.asked.acquire(timeout=30)  # Redis said "there"; held back
    redis_server.cli("del", name)
    tier.reads_ended([k], FAILED)


def drain(tier: RedisTier, checks: Checks, k: bytes) -> tuple[bool, bool]:
    """Let the held check be answered and drained: (present, unknown) of ``k`` then."""
    checks.gate.set()
    assert checks.answered.acquire(timeout=30)
    present, unknown = tier.known([k])
    return bool(present[0]), bool(unknown[0])


def test_an_answer_from_a_check_sent_before_a_reset_is_dropped(
    make_tier: Callable[..., RedisTier], redis_server: RedisServer, checks: Checks
) -> None:
    """A reset forgets what was known, the chunk's failed read included: an answer to a
    check sent before it, drained after it, must not make the chunk a hit again (its
    loads failing for two seconds). The chunk is asked again, and that answer counts."""
    now = [100.0]
    tier = make_tier(lambda: now[0])
    k = chunk_key(1)
    hold_stale_present(tier, redis_server, checks, k)
    tier.reset()
    assert drain(tier, checks, k) == (False, True)
    check(tier, checks, [k])
    assert tier.known([k])[1].tolist() == [False]  # answered afresh: absent


def test_an_answer_older_than_a_fact_forgotten_by_the_bound_is_dropped(
    make_tier: Callable[..., RedisTier],
    redis_server: RedisServer,
    checks: Checks,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same when the failed read is forgotten because MAX_ANSWERS are remembered."""
    monkeypatch.setattr(_redis_tier, "MAX_ANSWERS", 1)
    now = [100.0]
    tier = make_tier(lambda: now[0])
    k, other = chunk_key(1), chunk_key(2)
    hold_stale_present(tier, redis_server, checks, k)
    tier.reads_ended([other], FAILED)  # one answer too many: k's is forgotten
    tier.known([other])
    assert tier.statistics().answers == 1
    assert drain(tier, checks, k) == (False, True)


def test_an_answer_older_than_a_fact_forgotten_as_expired_is_dropped(
    make_tier: Callable[..., RedisTier], redis_server: RedisServer, checks: Checks
) -> None:
    """And when the failed read expired and was forgotten before the check, out for longer
    than an answer is trusted (a slow Redis), came back."""
    now = [100.0]
    tier = make_tier(lambda: now[0])
    k = chunk_key(1)
    hold_stale_present(tier, redis_server, checks, k)
    now[0] += ANSWER_TTL_S + 0.5
    assert tier.known([k])[1].tolist() == [True]
    assert tier.statistics().answers == 0
    assert drain(tier, checks, k) == (False, True)
