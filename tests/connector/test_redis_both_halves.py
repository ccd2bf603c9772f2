"""Both halves of the Redis tier on a real redis-server, without an engine: the scheduler
half's metadata goes to a real worker half (CPU copy engine), the worker's reports come
back, step by step as vLLM passes them. A prompt stored by one engine is written through
to Redis; a second engine (its own halves, empty host memory, the same Redis) asks
"again" until its existence check is answered, then loads it from Redis bit for bit. A
value damaged in Redis fails that load on the worker (recomputed) and is deleted; a Redis
that is down or unreachable makes misses, never a hang; a URL that cannot connect fails
the start naming the key."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvferry import ConfigError, FerryConfig

from ..tiers.redis_servers import RedisServer, free_port, redis_available
from ._halves import LAYERS, SLOT_BYTES, Halves
from ._steps import BLOCK, allocated, key, request, router_replay, vllm_hashes

pytestmark = pytest.mark.skipif(not redis_available(), reason="needs redis-server (make test)")


class Engine(Halves):
    """Both halves with a Redis tier (``redis``: the tier's keys, ``url`` or ``cluster``),
    or the config ``extra``."""

    def __init__(
        self,
        make_vllm_config: Any,
        kv_cache_config: Any,
        seed: int,
        extra: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        **redis: Any,
    ) -> None:
        if extra is None:
            extra = {"cpu_bytes_to_use": 8 * SLOT_BYTES, "tiers": [{"kind": "redis", **redis}]}
        super().__init__(make_vllm_config, kv_cache_config, extra, seed, clock)

    def lookup(self, req: Any) -> tuple[int | None, bool]:
        """get_num_new_matched_tokens, stepping while it says "ask again"."""
        asked = 0
        while True:
            got = self.sched.get_num_new_matched_tokens(req, 0)
            if got[0] is not None:
                return got
            asked += 1
            assert asked < 10_000, "asked again without end"
            self.step()
            time.sleep(0.001)  # a back-off between steps; the answer decides


@pytest.fixture
def make_engine(
    make_vllm_config: Any, kv_cache_config: Any, redis_server: RedisServer
) -> Iterator[Callable[..., Engine]]:
    server = redis_server
    server.cli("flushall")
    made: list[Engine] = []

    def make(
        seed: int = 0,
        url: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        **redis: Any,
    ) -> Engine:
        if "cluster" not in redis:
            redis["url"] = url or server.url
        made.append(Engine(make_vllm_config, kv_cache_config, seed, clock=clock, **redis))
        return made[-1]

    yield make
    for e in made:
        if e.worker.runtime is not None:
            e.close()


def store(e: Engine, req: Any, blocks: list[int]) -> list[bytes]:
    """Run ``req``'s prompt: its chunks stored to host memory, then written to Redis."""
    e.sched.on_new_request(req)
    e.step({req.request_id: (blocks,)}, {req.request_id: req.num_tokens})
    keys = [key(req, c) for c in range(req.num_tokens // BLOCK)]
    e.run_until(lambda: e.sched.statistics().redis_chunks_written == len(keys))
    return keys


def load(e: Engine, req: Any, blocks: list[int], tokens: int) -> None:
    """Look ``req`` up (a hit of ``tokens``, asking again while Redis is asked) and load
    it into engine blocks ``blocks``, without a load error."""
    e.sched.on_new_request(req)
    assert e.lookup(req) == (tokens, True)
    e.sched.update_state_after_alloc(req, allocated(blocks), tokens)
    e.run_until(lambda: req.request_id in e.recving)
    assert not e.load_errors


def test_a_prompt_stored_by_one_engine_is_loaded_from_redis_by_another(
    make_engine: Callable[..., Engine],
) -> None:
    a = make_engine(seed=1)
    req = request("r1", 3 * BLOCK + 8, seed=5)
    keys = store(a, req, [1, 2, 3, 4])  # (block 0 is vLLM's null block)
    # The second engine: its own host memory (empty), other KV in its engine blocks.
    b = make_engine(seed=2)
    again = request("r2", 3 * BLOCK + 8, seed=5)
    b.sched.on_new_request(again)
    assert b.sched.get_num_new_matched_tokens(again, 0) == (None, False)  # asked Redis
    assert b.lookup(again) == (3 * BLOCK, True)
    b.sched.update_state_after_alloc(again, allocated([5, 6, 7, 8]), 3 * BLOCK)
    b.run_until(lambda: "r2" in b.recving)
    assert not b.load_errors
    for src, dst in zip([1, 2, 3], [5, 6, 7], strict=True):
        assert b.block(dst) == a.block(src)
    stats = b.sched.statistics()
    assert stats.redis_tokens_hit == 3 * BLOCK and stats.redis_read_bytes == 3 * SLOT_BYTES
    assert stats.redis is not None and stats.redis.lookups_waited >= 1
    # Read into host memory: the next lookup of the prompt is a host hit at once.
    third = request("r3", 3 * BLOCK + 8, seed=5)
    b.sched.on_new_request(third)
    assert b.sched.get_num_new_matched_tokens(third, 0) == (3 * BLOCK, True)
    assert len(keys) == 3


def test_a_prompt_nobody_stored_is_a_miss_once_redis_answered(
    make_engine: Callable[..., Engine],
) -> None:
    e = make_engine()
    req = request("r1", 2 * BLOCK, seed=9)
    e.sched.on_new_request(req)
    assert e.lookup(req) == (0, False)
    assert e.sched.statistics().redis is not None


def test_a_damaged_value_fails_the_load_and_is_deleted(
    make_engine: Callable[..., Engine], redis_server: RedisServer
) -> None:
    server = redis_server
    a = make_engine(seed=1)
    keys = store(a, request("r1", 2 * BLOCK + 8, seed=7), [1, 2, 3])
    names = server.cli("--scan", "--pattern", "kvferry:*").split()
    assert len(names) == 2
    [second] = [n for n in names if n.endswith(keys[1].hex())]
    server.cli("setrange", second, "300", "garbage")  # inside the payload
    b = make_engine(seed=2)
    req = request("r2", 2 * BLOCK + 8, seed=7)
    b.sched.on_new_request(req)
    assert b.lookup(req) == (2 * BLOCK, True)  # EXISTS cannot tell; the read does
    b.sched.update_state_after_alloc(req, allocated([3, 4, 5]), 2 * BLOCK)
    b.run_until(lambda: "r2" in b.recving)
    assert b.load_errors == {3, 4}  # recomputed by vLLM, never loaded
    stats = b.sched.statistics()
    assert stats.redis_chunks_corrupt == 1 and stats.loads_failed == 1
    assert (stats.redis_loads_failed, stats.disk_loads_failed, stats.loads_failed_copy) == (1, 0, 0)
    assert server.cli("exists", second).strip() == "0"  # deleted by the reader
    # The failed chunk is known absent now: the next lookup hits the first chunk only.
    again = request("r3", 2 * BLOCK + 8, seed=7)
    b.sched.on_new_request(again)
    assert b.lookup(again) == (BLOCK, True)


def test_a_dead_redis_makes_misses_and_dropped_stores_never_a_hang(
    make_engine: Callable[..., Engine], tmp_path: Path
) -> None:
    own = RedisServer(tmp_path / "own")
    own.start()
    try:
        e = make_engine(url=own.url, op_timeout_s=0.5, breaker_threshold=1, breaker_cooldown_s=60)
    finally:
        own.kill()
    req = request("r1", 2 * BLOCK + 8, seed=3)
    e.sched.on_new_request(req)
    assert e.lookup(req) == (0, False)
    e.step({"r1": ([1, 2, 3],)}, {"r1": 2 * BLOCK + 8})
    e.run_until(lambda: e.sched.statistics().redis_writes_failed == 2)
    assert e.sched.statistics().redis_chunks_written == 0


def test_lookup_wait_ms_bounds_the_asking_again(
    make_engine: Callable[..., Engine], tmp_path: Path
) -> None:
    import os
    import signal

    own = RedisServer(tmp_path / "own")
    own.start()
    try:
        e = make_engine(url=own.url, lookup_wait_ms=0)
    except BaseException:
        own.kill()
        raise
    assert own.proc is not None
    os.kill(own.proc.pid, signal.SIGSTOP)  # alive, answers nothing
    try:
        req = request("r1", 2 * BLOCK, seed=3)
        e.sched.on_new_request(req)
        # No wait allowed: unanswered chunks are misses at once (the check is still sent).
        assert e.sched.get_num_new_matched_tokens(req, 0) == (0, False)
        stats = e.sched.statistics().redis
        assert stats is not None and stats.lookups_unanswered == 1
    finally:
        os.kill(own.proc.pid, signal.SIGCONT)
        own.kill()


def test_a_slow_redis_never_makes_an_engine_step_wait(
    make_engine: Callable[..., Engine], tmp_path: Path
) -> None:
    """Existence checks are out two at a time at most: while Redis is slow to answer, the
    keys of later steps wait for a later check instead of piling up in the checker's
    mailbox, whose bound would make each engine step wait for an answer of Redis. The
    lookups whose keys were held back end like any other after ``lookup_wait_ms``."""
    import os
    import signal
    import threading

    own = RedisServer(tmp_path / "own")
    own.start()
    assert own.proc is not None
    now = [0.0]
    try:
        e = make_engine(url=own.url, clock=lambda: now[0], op_timeout_s=60.0, lookup_wait_ms=100)
        reqs = [request(f"r{i}", 2 * BLOCK, seed=100 + i) for i in range(100)]
        said: list[tuple[int | None, bool]] = []

        def engine_thread() -> None:
            for r in reqs:  # a new prompt every step
                e.sched.on_new_request(r)
                said.append(e.sched.get_num_new_matched_tokens(r, 0))
                e.step()

        engine = threading.Thread(target=engine_thread, daemon=True)
        os.kill(own.proc.pid, signal.SIGSTOP)  # alive, answers nothing for now
        try:
            engine.start()
            engine.join(20.0)  # a bound, not a wait: unhindered, the steps take milliseconds
            assert not engine.is_alive(), f"step {len(said)} waited for Redis"
        finally:
            os.kill(own.proc.pid, signal.SIGCONT)
            engine.join(60.0)
        assert said == [(None, False)] * len(reqs)  # each asked again: no answer yet
        tier = e.sched.redis
        assert tier is not None and tier.statistics().keys_checked == 2 * 2  # two checks
        now[0] += 0.1  # lookup_wait_ms: the chunks not answered for are misses
        assert all(e.sched.get_num_new_matched_tokens(r, 0) == (0, False) for r in reqs)
        # Redis answers: the keys held back go with a later check, every check answered.
        keys = [key(r, c) for r in reqs for c in range(2)]
        e.run_until(lambda: not tier.known(keys)[1].any())
        stats = tier.statistics()
        assert stats.keys_checked == len(keys) and stats.checks_unanswered == 0
    finally:
        own.kill()


def test_an_unreachable_url_fails_the_start_naming_the_key(
    make_vllm_config: Any, kv_cache_config: Any
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.url"):
        Engine(make_vllm_config, kv_cache_config, 0, url=url, connect_timeout_s=0.5)


def test_a_start_that_fails_leaves_no_copy_thread_behind(
    make_vllm_config: Any, kv_cache_config: Any
) -> None:
    """The worker builds its host pool and copy engine before the runtime, whose start
    connects to Redis: a start that fails there closes them (nothing else would)."""
    import threading

    from kvferry.connector._worker import WorkerSide

    url = f"redis://127.0.0.1:{free_port()}/0"
    extra = {
        "cpu_bytes_to_use": 8 * SLOT_BYTES,
        "tiers": [{"kind": "redis", "url": url, "connect_timeout_s": 0.5}],
    }
    worker = WorkerSide(make_vllm_config(extra), kv_cache_config, FerryConfig.from_dict(extra))
    kv = {n: torch.zeros(2, 16, BLOCK, 2, 64).bfloat16() for n in LAYERS}
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.url"):
        worker.register_kv_caches(kv)
    copying = [t.name for t in threading.enumerate() if t.name.startswith("kvferry-copy")]
    assert copying == []
    worker.shutdown()  # what vLLM may still call: nothing left to close twice


def test_the_stepped_runtime_is_refused_with_a_redis_tier() -> None:
    with pytest.raises(ConfigError, match="runtime"):
        FerryConfig.from_dict(
            {
                "cpu_bytes_to_use": 1 << 20,
                "runtime": "stepped",
                "tiers": [{"kind": "redis", "url": "redis://127.0.0.1:1/0"}],
            }
        )


def test_with_a_redis_tier_the_scheduler_reports_its_series(
    make_engine: Callable[..., Engine],
) -> None:
    from kvferry._metrics import COUNTERS, GAUGES, UNKNOWN_METRICS

    e = make_engine()
    first = e.sched.kv_connector_stats()
    disk = "vllm:kvferry_disk_"
    assert set(first["gauges"]) == {m.full_name for m in GAUGES if not m.full_name.startswith(disk)}
    assert set(e.sched._report.reported) == {
        m.full_name for m in COUNTERS if not m.full_name.startswith(disk)
    } - {UNKNOWN_METRICS}
    store(e, request("r1", 2 * BLOCK + 8, seed=4), [1, 2, 3])
    counters = e.sched.kv_connector_stats()["counters"]
    assert counters["vllm:kvferry_redis_blocks_written"] == 2
    assert counters["vllm:kvferry_redis_write_bytes"] == 2 * SLOT_BYTES


def share(a: Engine, b: Engine, seed: int) -> Engine:
    """``a`` stores a prompt (written to Redis), ``b`` loads it from Redis: bit for bit."""
    req = request(f"a{seed}", 2 * BLOCK + 8, seed=seed)
    store(a, req, [1, 2, 3])
    load(b, request(f"b{seed}", 2 * BLOCK + 8, seed=seed), [6, 7, 8], 2 * BLOCK)
    assert [b.block(x) for x in (6, 7)] == [a.block(x) for x in (1, 2)]
    return b


def test_service_comes_back_by_itself_when_redis_does(
    make_engine: Callable[..., Engine], tmp_path: Path
) -> None:
    own = RedisServer(tmp_path / "own")
    own.start()
    try:
        # A cool-down of 0: every operation while the breaker is open probes Redis first.
        opts = {
            "url": own.url,
            "op_timeout_s": 0.5,
            "breaker_threshold": 1,
            "breaker_cooldown_s": 0,
        }
        a, b = make_engine(seed=1, **opts), make_engine(seed=2, **opts)
        own.kill()
        req = request("down", 2 * BLOCK + 8, seed=11)
        store_failed = a.sched.statistics().redis_writes_failed
        a.sched.on_new_request(req)
        a.step({"down": ([1, 2, 3],)}, {"down": 2 * BLOCK + 8})
        a.run_until(lambda: a.sched.statistics().redis_writes_failed == store_failed + 2)
        own.start()  # the same port, empty
        share(a, b, seed=12)
    finally:
        own.kill()


def test_chunks_whose_write_failed_are_written_again_at_a_host_hit_once_redis_is_back(
    make_engine: Callable[..., Engine], tmp_path: Path
) -> None:
    from kvferry.connector._redis_tier import RETRY_S

    own = RedisServer(tmp_path / "own")
    own.start()
    now = [1000.0]
    try:
        opts = {"url": own.url, "op_timeout_s": 0.5, "breaker_threshold": 1}
        a = make_engine(seed=1, clock=lambda: now[0], breaker_cooldown_s=0, **opts)
        b = make_engine(seed=2, **opts)
        own.kill()
        # Stored while Redis is down: in a's host memory only.
        keys = store_failing(a, request("down", 2 * BLOCK + 8, seed=11), [1, 2, 3])
        tier = a.sched.redis
        assert tier is not None and tier.statistics().unwritten == 2
        # Offered again at a host hit RETRY_S later, Redis still down: failed again.
        now[0] += RETRY_S
        failed = a.sched.statistics().redis_writes_failed
        load(a, request("still", 2 * BLOCK + 8, seed=11), [4, 5, 6], 2 * BLOCK)
        a.run_until(lambda: a.sched.statistics().redis_writes_failed == failed + 2)
        stats = tier.statistics()
        assert stats.chunks_offered_again == 2 and stats.unwritten == 2
        assert a.sched.statistics().directory.pinned == 0
        own.start()  # the same port, empty
        # A host hit before RETRY_S since that failure: not offered again yet.
        load(a, request("soon", 2 * BLOCK + 8, seed=11), [4, 5, 6], 2 * BLOCK)
        assert tier.statistics().chunks_offered_again == 2
        assert a.sched.statistics().directory.pinned == 0
        now[0] += RETRY_S
        written = a.sched.statistics().redis_chunks_written
        load(a, request("later", 2 * BLOCK + 8, seed=11), [7, 8, 9], 2 * BLOCK)
        # The load ended; its host slots keep their pins for the write to Redis.
        assert a.sched.statistics().directory.pinned == 2
        a.run_until(lambda: a.sched.statistics().redis_chunks_written == written + 2)
        stats = tier.statistics()
        assert stats.chunks_offered_again == 4 and stats.unwritten == 0
        assert stats.writes_in_flight == 0
        counters = a.sched.kv_connector_stats()["counters"]
        assert counters["vllm:kvferry_redis_blocks_offered_again"] == 4
        host = a.sched.statistics().directory
        # Every pin came back, and every load counts as completed (the pins handed on too).
        assert host.pinned == 0 and host.loads_completed == host.loads_prepared == 6
        # Now another engine finds them in Redis, bit for bit.
        load(b, request("b", 2 * BLOCK + 8, seed=11), [10, 11, 12], 2 * BLOCK)
        assert [b.block(x) for x in (10, 11)] == [a.block(x) for x in (1, 2)]
        assert len(keys) == 2
    finally:
        own.kill()


def store_failing(e: Engine, req: Any, blocks: list[int]) -> list[bytes]:
    """Run ``req``'s prompt while Redis is down: stored to host memory, its writes failed."""
    failed = e.sched.statistics().redis_writes_failed
    e.sched.on_new_request(req)
    e.step({req.request_id: (blocks,)}, {req.request_id: req.num_tokens})
    keys = [key(req, c) for c in range(req.num_tokens // BLOCK)]
    e.run_until(lambda: e.sched.statistics().redis_writes_failed == failed + len(keys))
    return keys


def test_a_cluster_is_shared_like_one_server(
    make_engine: Callable[..., Engine], tmp_path: Path
) -> None:
    from ..tiers.redis_servers import RedisClusterProcs

    cluster = RedisClusterProcs(tmp_path / "cluster")
    cluster.start()
    try:
        a = make_engine(seed=1, cluster=cluster.urls)
        b = make_engine(seed=2, cluster=cluster.urls)
        share(a, b, seed=13)
        held = sum(len(n.cli("--scan", "--pattern", "kvferry:*").split()) for n in cluster.nodes)
        assert held == 2
    finally:
        cluster.stop()


def test_encrypted_values_are_shared_by_engines_with_the_key_only(
    make_engine: Callable[..., Engine], redis_server: RedisServer
) -> None:
    secret = "00112233445566778899aabbccddeeff"
    a = make_engine(seed=1, encrypt_key=secret)
    b = make_engine(seed=2, encrypt_key=secret)
    share(a, b, seed=14)
    # Sealed at rest: the payload's bytes are nowhere in the value.
    names = set(redis_server.cli("--scan", "--pattern", "kvferry:*").split())
    raw = redis_get(redis_server, min(names))
    assert len(raw) > SLOT_BYTES and a.block(1)[:64] not in raw and a.block(2)[:64] not in raw
    # An engine with another key, or none: its keys are named apart, a miss (and the
    # values it could not open are left alone for the engines that can).
    for i, other in enumerate([{"encrypt_key": "ff" * 16}, {}]):
        c = make_engine(seed=3 + i, **other)
        req = request(f"c{i}", 2 * BLOCK + 8, seed=14)
        c.sched.on_new_request(req)
        assert c.lookup(req) == (0, False)
        assert c.sched.statistics().redis_chunks_corrupt == 0
    assert set(redis_server.cli("--scan", "--pattern", "kvferry:*").split()) == names
    d = make_engine(seed=5, encrypt_key=secret)
    load(d, request("d", 2 * BLOCK + 8, seed=14), [6, 7, 8], 2 * BLOCK)
    assert [d.block(x) for x in (6, 7)] == [a.block(x) for x in (1, 2)]


def redis_get(server: RedisServer, name: str) -> bytes:
    """A value's raw bytes."""
    import redis

    with redis.Redis(port=server.port) as client:
        value = client.get(name)
    assert isinstance(value, bytes)
    return value


def test_with_a_disk_tier_too_a_load_reads_disk_then_redis_chunks(
    make_vllm_config: Any, kv_cache_config: Any, redis_server: RedisServer, tmp_path: Path
) -> None:
    from kvferry.cache import ClearAll
    from kvferry.tiers._format import file_size

    redis_server.cli("flushall")

    def engine(seed: int, path: Path) -> Engine:
        disk = {"kind": "disk", "path": str(path), "bytes_to_use": 16 * file_size(SLOT_BYTES)}
        redis = {"kind": "redis", "url": redis_server.url}
        extra = {"cpu_bytes_to_use": 8 * SLOT_BYTES, "tiers": [disk, redis]}
        return Engine(make_vllm_config, kv_cache_config, seed, extra=extra)

    a, b = engine(1, tmp_path / "a"), engine(2, tmp_path / "b")
    try:
        # A: a 2-chunk prompt, written through to its disk and to Redis.
        short = request("short", 2 * BLOCK + 8, seed=21)
        store(a, short, [1, 2, 3])
        a.run_until(lambda: a.sched.statistics().disk_chunks_written == 2)
        # B: the same prefix, 3 chunks long (its third chunk only B computed), to Redis.
        long = request("long", 3 * BLOCK + 8, seed=21)
        store(b, long, [1, 2, 3, 4])
        b.run_until(lambda: b.sched.statistics().disk_chunks_written == 3)  # B's own disk
        # A forgets its host memory; the long prompt: chunks 0-1 on A's disk, chunk 2 in
        # Redis only: one load reads the disk's, then Redis's, then copies.
        a.sched._ask(ClearAll)
        load(a, request("again", 3 * BLOCK + 8, seed=21), [9, 10, 11, 12], 3 * BLOCK)
        assert [a.block(x) for x in (9, 10)] == [a.block(x) for x in (1, 2)]
        assert a.block(11) == b.block(3)
        stats = a.sched.statistics()
        assert stats.disk_read_bytes == 2 * SLOT_BYTES and stats.redis_read_bytes == SLOT_BYTES
        assert stats.disk_tokens_hit == 2 * BLOCK and stats.redis_tokens_hit == BLOCK
    finally:
        a.close()
        b.close()


def test_with_a_disk_tier_too_chunks_read_from_redis_are_kept_on_disk(
    make_vllm_config: Any, kv_cache_config: Any, redis_server: RedisServer, tmp_path: Path
) -> None:
    """A chunk another engine wrote to Redis, once loaded, is written to this engine's
    disk too: with Redis emptied and host memory cleared, it still loads, from disk, bit
    for bit."""
    from kvferry.cache import ClearAll
    from kvferry.tiers._format import file_size

    redis_server.cli("flushall")
    disk = {"kind": "disk", "path": str(tmp_path / "a"), "bytes_to_use": 16 * file_size(SLOT_BYTES)}
    redis = {"kind": "redis", "url": redis_server.url}
    a = Engine(
        make_vllm_config,
        kv_cache_config,
        1,
        extra={"cpu_bytes_to_use": 8 * SLOT_BYTES, "tiers": [disk, redis]},
    )
    b = Engine(make_vllm_config, kv_cache_config, 2, url=redis_server.url)
    try:
        req = request("r1", 3 * BLOCK + 8, seed=41)
        store(b, req, [1, 2, 3, 4])
        load(a, request("r2", 3 * BLOCK + 8, seed=41), [5, 6, 7, 8], 3 * BLOCK)
        a.run_until(lambda: a.sched.statistics().disk_chunks_written == 3)
        stats = a.sched.statistics()
        assert stats.redis_tokens_hit == 3 * BLOCK and stats.redis_chunks_kept_on_disk == 3
        assert stats.disk is not None and stats.disk.used == 3
        # Redis forgets everything, A its host memory: the prompt loads from A's disk.
        redis_server.cli("flushall")
        a.sched._ask(ClearAll)
        load(a, request("r3", 3 * BLOCK + 8, seed=41), [9, 10, 11, 12], 3 * BLOCK)
        assert [a.block(x) for x in (9, 10, 11)] == [b.block(x) for x in (1, 2, 3)]
        stats = a.sched.statistics()
        assert stats.disk_tokens_hit == 3 * BLOCK and stats.disk_read_bytes == 3 * SLOT_BYTES
        assert stats.redis_read_bytes == 3 * SLOT_BYTES  # the first load's only
    finally:
        a.close()
        b.close()


def _with_events(make_vllm_config: Any) -> Callable[[dict[str, Any]], Any]:
    from vllm.config import KVEventsConfig

    def make(extra: dict[str, Any]) -> Any:
        config = make_vllm_config(extra)
        config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        return config

    return make


def _tokens_request(req_id: str) -> Any:
    """A 2-chunk prompt whose tokens are 1000, 1001, ... (what its events must carry)."""
    req = request(req_id, 2 * BLOCK + 8, seed=31)
    req.all_token_ids = list(range(1000, 1000 + 2 * BLOCK + 8))
    req.lora_request = None
    return req


def _stored_by_medium(e: Engine) -> dict[str, Any]:
    from vllm.distributed.kv_events import BlockStored

    stored = [ev for ev in e.sched.take_events() if isinstance(ev, BlockStored)]
    by_medium = {ev.medium: ev for ev in stored}
    assert len(by_medium) == len(stored)  # one event per medium
    return by_medium


def test_chunks_written_to_redis_are_announced_with_medium_redis(
    make_vllm_config: Any, kv_cache_config: Any, redis_server: RedisServer
) -> None:
    """A block written to Redis is a BlockStored of medium REDIS with its tokens, as the
    host tier's (routers rebuild their keys from these fields)."""
    redis_server.cli("flushall")
    e = Engine(_with_events(make_vllm_config), kv_cache_config, 0, url=redis_server.url)
    try:
        store(e, _tokens_request("r1"), [1, 2, 3])
        by_medium = _stored_by_medium(e)
        assert set(by_medium) == {"CPU", "REDIS"}
        redis = by_medium["REDIS"]
        assert redis.block_hashes == by_medium["CPU"].block_hashes
        assert redis.token_ids == list(range(1000, 1000 + 2 * BLOCK))
        assert redis.parent_block_hash is None and redis.block_size == BLOCK
    finally:
        e.close()


def test_a_reset_keeps_the_redis_blocks_in_a_routers_view(
    make_vllm_config: Any, kv_cache_config: Any, redis_server: RedisServer
) -> None:
    """A reset empties host memory, not Redis (the chunks are shared with other engines):
    its events remove the host blocks by name, and a router replaying them still holds the
    Redis blocks, which are still hits."""
    redis_server.cli("flushall")
    e = Engine(_with_events(make_vllm_config), kv_cache_config, 0, url=redis_server.url)
    router: dict[str, set[Any]] = {}
    try:
        req = _tokens_request("r1")
        held = vllm_hashes(store(e, req, [1, 2, 3]))
        router_replay(router, e.sched.take_events())
        assert router["CPU"] == router["REDIS"] == held
        assert e.sched.reset()
        router_replay(router, e.sched.take_events())
        assert router["CPU"] == set() and router["REDIS"] == held
        again = _tokens_request("r2")
        e.sched.on_new_request(again)
        assert e.lookup(again) == (2 * BLOCK, True)
    finally:
        e.close()


def test_chunks_read_from_redis_are_announced_with_their_tokens(
    make_vllm_config: Any, kv_cache_config: Any, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Blocks another engine wrote to Redis enter this engine's host memory (a CPU
    BlockStored) and its disk (DISK) when loaded: both events carry the blocks' tokens,
    taken from the request that loaded them, never vLLM's placeholder."""
    from kvferry.tiers._format import file_size

    redis_server.cli("flushall")
    disk = {"kind": "disk", "path": str(tmp_path / "a"), "bytes_to_use": 8 * file_size(SLOT_BYTES)}
    tiers = [disk, {"kind": "redis", "url": redis_server.url}]
    a = Engine(
        _with_events(make_vllm_config),
        kv_cache_config,
        1,
        extra={"cpu_bytes_to_use": 8 * SLOT_BYTES, "tiers": tiers},
    )
    b = Engine(make_vllm_config, kv_cache_config, 2, url=redis_server.url)
    try:
        store(b, _tokens_request("r1"), [1, 2, 3])
        load(a, _tokens_request("r2"), [5, 6, 7], 2 * BLOCK)
        a.run_until(lambda: a.sched.statistics().disk_chunks_written == 2)
        by_medium = _stored_by_medium(a)
        assert set(by_medium) == {"CPU", "DISK"}
        for ev in by_medium.values():
            assert ev.token_ids == list(range(1000, 1000 + 2 * BLOCK)), ev.medium
            assert ev.block_size == BLOCK and ev.parent_block_hash is None
        assert by_medium["DISK"].block_hashes == by_medium["CPU"].block_hashes
    finally:
        a.close()
        b.close()
