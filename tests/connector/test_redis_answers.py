"""The Redis tier's scheduler-side bookkeeping under races a long run meets: an existence
check's answer that comes back after something newer was learnt about the chunk, and a
request that vLLM leaves waiting in its queue for longer than an answer is trusted.

On a real redis-server. The checker's answers are waited for through an event set when its
handler ended (never a sleep); the clocks are injected."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvferry.connector import _redis_tier
from kvferry.connector._redis_tier import ANSWER_TTL_S, RedisTier

from ..tiers.conftest import key as chunk_key
from ..tiers.redis_servers import RedisServer, redis_available
from ._halves import SLOT_BYTES, Halves
from ._redis_tiers import redis_name, tiers
from ._steps import BLOCK, key, request

pytestmark = pytest.mark.skipif(not redis_available(), reason="needs redis-server (make test)")


@pytest.fixture
def answered(monkeypatch: pytest.MonkeyPatch) -> threading.Semaphore:
    """Released once per existence check the checker answered (its answer is then in the
    tier's queue, not yet drained by the engine thread)."""
    done = threading.Semaphore(0)
    handle = _redis_tier._Checker.handle

    async def signalled(self: Any, msg: Any) -> None:
        try:
            await handle(self, msg)
        finally:
            done.release()

    monkeypatch.setattr(_redis_tier._Checker, "handle", signalled)
    return done


@pytest.fixture
def make_tier(redis_server: RedisServer) -> Iterator[Callable[..., RedisTier]]:
    with tiers(redis_server) as make:
        yield make


def test_an_answer_from_before_a_read_failed_does_not_make_the_chunk_a_hit_again(
    make_tier: Callable[..., RedisTier], redis_server: RedisServer, answered: threading.Semaphore
) -> None:
    """A check asked while a read of the chunk was in flight (the chunk's earlier answer
    had expired, or a reset forgot it) can come back after that read failed: Redis said
    "there" before the reader found the value damaged and deleted it (or before Redis
    evicted it). The read's failure is newer: the chunk stays known absent, instead of
    being a hit for two seconds whose loads all fail again."""
    now = [100.0]
    tier = make_tier(lambda: now[0])
    k = chunk_key(1)
    name = redis_name(redis_server, k)
    redis_server.cli("set", name, "a value")
    tier.ask([k])
    tier.flush()
    assert answered.acquire(timeout=30)  # Redis answered "there"; not drained yet
    redis_server.cli("del", name)  # the reader found it damaged and deleted it
    tier.reads_ended([k], np.array([1], np.int64))  # the workers report that read failed
    present, unknown = tier.known([k])
    assert not present[0] and not unknown[0]  # known absent: not a hit
    assert redis_server.cli("exists", name).strip() == "0"


def test_an_answer_from_before_a_write_ended_does_not_make_the_chunk_absent_again(
    make_tier: Callable[..., RedisTier], redis_server: RedisServer, answered: threading.Semaphore
) -> None:
    """The other way round: a check that Redis answered before this engine's write of the
    chunk landed must not undo the write's success (a miss, and the chunk written again)."""
    now = [100.0]
    tier = make_tier(lambda: now[0])
    k = chunk_key(2)
    assert tier.prepare_writes([k]).tolist() == [0]  # a store ended: written through
    tier.ask([k])  # a lookup's check (held back while two were out) goes meanwhile
    tier.flush()
    assert answered.acquire(timeout=30)  # Redis answered "not there"; not drained yet
    redis_server.cli("set", redis_name(redis_server, k), "a value")  # the write lands
    assert tier.writes_ended(np.array([0], np.int64), [k], np.array([0], np.int64)) == 1
    present, _ = tier.known([k])
    assert present[0]
    assert tier.prepare_writes([k]).tolist() == [-1]  # not written again


class Engine(Halves):
    def __init__(self, make_vllm_config: Any, kv_cache_config: Any, seed: int, **kw: Any):
        clock: Callable[[], float] = kw.pop("clock")
        extra = {"cpu_bytes_to_use": 8 * SLOT_BYTES, "tiers": [{"kind": "redis", **kw}]}
        super().__init__(make_vllm_config, kv_cache_config, extra, seed, clock)


def test_a_request_vllm_comes_back_to_late_waits_for_a_fresh_answer(
    make_vllm_config: Any, kv_cache_config: Any, redis_server: RedisServer
) -> None:
    """vLLM asks about a waiting request, gets "ask again", then does not come back to it
    for seconds (its running batch is full). Meanwhile Redis answered, and the answer
    expired (ANSWER_TTL_S). When vLLM comes back, the prompt is still in Redis: the
    lookup must ask again and wait for the answer, not treat the request's first wait,
    long over, as ``lookup_wait_ms`` spent and report a miss at once."""
    redis_server.cli("flushall")
    now = [1000.0]
    made: list[Engine] = []
    try:
        a = Engine(make_vllm_config, kv_cache_config, 1, url=redis_server.url, clock=lambda: now[0])
        made.append(a)
        b = Engine(make_vllm_config, kv_cache_config, 2, url=redis_server.url, clock=lambda: now[0])
        made.append(b)
        stored = request("r1", 2 * BLOCK + 8, seed=5)
        a.sched.on_new_request(stored)
        a.step({"r1": ([1, 2, 3],)}, {"r1": stored.num_tokens})
        a.run_until(lambda: a.sched.statistics().redis_chunks_written == 2)

        req = request("r2", 2 * BLOCK + 8, seed=5)
        keys = [key(req, c) for c in range(2)]
        tier = b.sched.redis
        assert tier is not None
        b.sched.on_new_request(req)
        assert b.sched.get_num_new_matched_tokens(req, 0) == (None, False)
        b.run_until(lambda: not tier.known(keys)[1].any())  # Redis answered: both there
        now[0] += ANSWER_TTL_S + 1.0  # vLLM does not come back to r2 for a while
        said: list[tuple[int | None, bool]] = []

        def answered() -> bool:  # vLLM asks again each step while told so
            said.append(b.sched.get_num_new_matched_tokens(req, 0))
            return said[-1][0] is not None

        b.run_until(answered)
        assert said[-1] == (2 * BLOCK, True)
    finally:
        for e in made:
            e.close()
