"""RedisStore on a real 3-master Redis Cluster (redis-cli --cluster create on loopback
ports): keys spread over the nodes, round trips, a node killed and brought back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import numpy as np
import pytest

from kvferry import ConfigError
from kvferry.tiers import CircuitBreaker, Outcome, RedisStore

from .conftest import FP, key, payload
from .redis_servers import RedisClusterProcs, free_port

N = 64 << 10
OP_TIMEOUT_S = 1.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    procs = RedisClusterProcs(tmp_path_factory.mktemp("cluster"))
    procs.start()
    yield procs
    procs.stop()


async def open_store(cluster: RedisClusterProcs, **kwargs: object) -> RedisStore:
    store = RedisStore(cluster=cluster.urls, fingerprint=FP, op_timeout_s=OP_TIMEOUT_S, **kwargs)  # type: ignore[arg-type]
    await store.connect()
    return store


@pytest.mark.anyio
async def test_chunks_round_trip_across_every_node(
    cluster: RedisClusterProcs, streamed: list[int]
) -> None:
    store = await open_store(cluster)
    try:
        keys = [key(i) for i in range(24)]
        nodes = {cluster.node_of(store.redis_key(k)).port for k in keys}
        assert len(nodes) == 3  # the keys spread over every master
        assert set((await store.write(keys, [payload(i, N) for i in range(24)])).tolist()) == {
            Outcome.OK
        }
        into = [np.zeros(N, np.uint8) for _ in keys]
        assert set((await store.read(keys, into)).tolist()) == {Outcome.OK}
        for i, got in enumerate(into):
            assert np.array_equal(got, payload(i, N))
        # The values went out joined (header, then a view of the payload), through the
        # connections of every node the client found, not only of those it was given.
        assert store.joins_values
        found = store.client.get_nodes()
        assert len(found) == 3
        assert {type(c).__name__ for n in found for c in n._connections} == {"JoiningConnection"}
        assert len(streamed) == 24  # and every reply was read straight into its slot
        assert (await store.exists(keys)).all()
        assert await store.delete(keys) == 24
    finally:
        await store.aclose()


@pytest.mark.anyio
async def test_a_cluster_that_cannot_be_reached_names_the_key() -> None:
    store = RedisStore(
        cluster=[f"redis://127.0.0.1:{free_port()}"], fingerprint=FP, connect_timeout_s=2
    )
    with pytest.raises(ConfigError) as info:
        await store.connect()
    assert info.value.key == "tiers[0].cluster"


@pytest.mark.anyio
async def test_a_node_killed_makes_misses_within_the_timeout_and_service_returns(
    cluster: RedisClusterProcs, tmp_path: Path
) -> None:
    clock = Clock()
    breaker = CircuitBreaker(threshold=2, cooldown_s=10, clock=clock)
    store = await open_store(cluster, breaker=breaker)
    keys = [key(i) for i in range(24)]
    try:
        await store.write(keys, [payload(i, N) for i in range(24)])
        victim = cluster.node_of(store.redis_key(keys[0]))
        victim.kill()
        for _ in range(3):
            start = anyio.current_time()
            outcomes = await store.read(keys, [np.zeros(N, np.uint8) for _ in keys])
            assert anyio.current_time() - start < OP_TIMEOUT_S + 1.0
            assert outcomes[0] != Outcome.OK  # its node is gone: a miss
        assert breaker.state == "open"
        victim.start()  # same port and node directory: it rejoins with its slots
        cluster.wait_ok()
        clock.now += 10
        with anyio.fail_after(20):
            while list(await store.write(keys[:1], [payload(0, N)])) != [Outcome.OK]:
                # The client may need one more failed round to refresh its node map.
                clock.now += 10
                await anyio.sleep(0.1)  # the restarted node accepting connections again
        into = np.zeros(N, np.uint8)
        assert list(await store.read(keys[:1], [into])) == [Outcome.OK]
        assert np.array_equal(into, payload(0, N))
    finally:
        await store.aclose()
