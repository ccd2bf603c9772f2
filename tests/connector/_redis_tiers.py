"""Scheduler-side Redis tiers on a real redis-server, for the tests of their answers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvferry._config import RedisTierConfig
from kvferry.connector._redis_tier import RedisTier, make_store

from ..tiers.conftest import FP
from ..tiers.redis_servers import RedisServer


@contextmanager
def tiers(redis_server: RedisServer) -> Iterator[Callable[[Callable[[], float]], RedisTier]]:
    """``make(clock)``: a tier of fingerprint ``FP`` on ``redis_server`` (emptied first);
    every tier made is closed at the end."""
    redis_server.cli("flushall")
    made: list[RedisTier] = []

    def make(clock: Callable[[], float]) -> RedisTier:
        config = RedisTierConfig(index=0, url=redis_server.url)
        made.append(RedisTier(config, [FP], events=False, clock=clock))
        return made[-1]

    try:
        yield make
    finally:
        for tier in made:
            tier.close()


def redis_name(redis_server: RedisServer, k: bytes) -> str:
    """The Redis key under which the tier's checker looks chunk ``k`` up."""
    return make_store(RedisTierConfig(index=0, url=redis_server.url), FP).redis_key(k).decode()
