"""RedisStore against a real redis-server: round trips, namespacing, verification,
TTL, encryption, configuration errors."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import attrs
import numpy as np
import pytest

from kvferry import ConfigError
from kvferry.tiers import Outcome, RedisStore

from .conftest import FP, key, payload
from .redis_servers import RedisServer, free_port

OTHER_FP = attrs.evolve(FP, model="another-model")
AES_KEY = bytes(range(32))


async def open_store(url: str, **kwargs: Any) -> RedisStore:
    kwargs.setdefault("fingerprint", FP)
    store = RedisStore(url=url, **kwargs)
    await store.connect()
    return store


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[RedisStore]:
    s = await open_store(redis_url)
    yield s
    await s.aclose()


async def raw_client(url: str) -> Any:
    import redis.asyncio

    return redis.asyncio.Redis.from_url(url)


@pytest.mark.anyio
async def test_chunks_written_are_read_back_bit_for_bit(store: RedisStore) -> None:
    sizes = [1, 4096, 256 << 10, 3 * 4096 + 100]
    keys = [key(i) for i in range(len(sizes))]
    data = [payload(i, n) for i, n in enumerate(sizes)]
    assert list(await store.write(keys, data)) == [Outcome.OK] * 4
    into = [np.zeros(n, dtype=np.uint8) for n in sizes]
    assert list(await store.read(keys, into)) == [Outcome.OK] * 4
    for got, want in zip(into, data, strict=True):
        assert np.array_equal(got, want)
    stats = store.statistics()
    assert stats.reads == stats.writes == 4
    assert stats.bytes_read == stats.bytes_written == sum(sizes)
    assert stats.read_seconds > 0 and stats.write_seconds > 0


@pytest.mark.anyio
async def test_exists_answers_per_key(store: RedisStore) -> None:
    await store.write([key(1), key(3)], [payload(1), payload(3)])
    found = await store.exists([key(i) for i in range(5)])
    assert found.tolist() == [False, True, False, True, False]
    assert store.statistics().exists_found == 2


@pytest.mark.anyio
async def test_a_missing_chunk_is_absent(store: RedisStore) -> None:
    outcomes = await store.read([key(9)], [np.zeros(10, dtype=np.uint8)])
    assert list(outcomes) == [Outcome.ABSENT] and store.statistics().absent == 1


@pytest.mark.anyio
async def test_deleted_chunks_are_gone(store: RedisStore) -> None:
    await store.write([key(1), key(2)], [payload(1), payload(2)])
    assert await store.delete([key(1), key(2), key(3)]) == 2
    assert not (await store.exists([key(1), key(2)])).any()


@pytest.mark.anyio
@pytest.mark.parametrize("joins", [True, False], ids=["joined", "copied"])
async def test_a_value_written_is_its_header_then_its_payload_sent_whole_or_copied(
    redis_url: str, joins: bool
) -> None:
    # Joined (the default): the header and a view of the payload go out as two pieces
    # of one value; copied (a redis whose connections would not take the packing): one
    # buffer. Either way the server holds exactly encode_value's bytes.
    store = await open_store(redis_url)
    raw = await raw_client(redis_url)
    try:
        assert store.joins_values
        store.joins_values = joins
        sizes = [1, 6000, 256 << 10]
        keys = [key(i) for i in range(len(sizes))]
        data = [payload(i, n) for i, n in enumerate(sizes)]
        assert list(await store.write(keys, data)) == [Outcome.OK] * len(sizes)
        for k, d in zip(keys, data, strict=True):
            assert await raw.get(store.redis_key(k)) == store.encode_value(k, d)
            assert 86000 < await raw.ttl(store.redis_key(k)) <= 24 * 3600
    finally:
        await store.aclose()
        await raw.aclose()


def test_a_joined_value_packs_to_the_bytes_of_the_whole_value() -> None:
    from redis.asyncio.connection import Connection, SSLConnection

    from kvferry.tiers._redis import _Joined, _joining_connection, _make_joining

    joining = _joining_connection(Connection)
    assert _joining_connection(Connection) is joining  # one class per base
    conn, plain = joining(), Connection()
    body = payload(1, 100_000)
    joined = b"".join(conn.pack_command("SET", b"k", _Joined(b"head", body.data), "EX", 60))
    whole = b"".join(plain.pack_command("SET", b"k", b"head" + body.tobytes(), "EX", 60))
    assert joined == whole
    # A command without one packs as the client's own, and a pipeline of both as well.
    assert conn.pack_command("GET", b"k") == plain.pack_command("GET", b"k")
    cmds = [("SET", b"a", _Joined(b"h", memoryview(b"xy")), "EX", 1), ("GET", b"a")]
    assert b"".join(conn.pack_commands(cmds)) == b"".join(
        plain.pack_commands([("SET", b"a", b"hxy", "EX", 1), ("GET", b"a")])
    )
    assert issubclass(_joining_connection(SSLConnection), SSLConnection)
    assert not _make_joining(object())  # a client it does not know: values copied whole


def test_a_tls_url_keeps_its_tls_connections_and_joins_values() -> None:
    from redis.asyncio.connection import SSLConnection

    store = RedisStore(url="rediss://user:pw@localhost:6390/0", fingerprint=FP)
    assert store.joins_values
    assert issubclass(store.client.connection_pool.connection_class, SSLConnection)


@pytest.mark.anyio
async def test_keys_are_namespaced_by_format_version_and_fingerprint(store: RedisStore) -> None:
    assert store.redis_key(b"\x01\xab") == f"kvferry:v1:{FP.digest.hex()}:01ab".encode()


@pytest.mark.anyio
async def test_engines_with_other_fingerprints_never_see_each_others_chunks(
    redis_url: str,
) -> None:
    a = await open_store(redis_url)
    other = await open_store(redis_url, fingerprint=OTHER_FP)
    same = await open_store(redis_url)  # another engine with the same fingerprint
    try:
        await a.write([key(1)], [payload(1)])
        await other.write([key(2)], [payload(2)])
        assert (await other.exists([key(1)])).tolist() == [False]
        assert list(await other.read([key(1)], [np.zeros(3 * 4096 + 100, np.uint8)])) == [
            Outcome.ABSENT
        ]
        assert (await a.exists([key(2)])).tolist() == [False]
        into = np.zeros(3 * 4096 + 100, np.uint8)
        assert list(await same.read([key(1)], [into])) == [Outcome.OK]
        assert np.array_equal(into, payload(1))
    finally:
        for s in (a, other, same):
            await s.aclose()


@pytest.mark.anyio
async def test_every_chunk_gets_the_ttl(redis_url: str) -> None:
    store = await open_store(redis_url, ttl_s=1234)
    raw = await raw_client(redis_url)
    try:
        await store.write([key(1)], [payload(1)])
        ttl = await raw.ttl(store.redis_key(key(1)))
        assert 1200 < ttl <= 1234
    finally:
        await store.aclose()
        await raw.aclose()


@pytest.mark.anyio
async def test_values_that_fail_verification_are_misses_counted_by_field_and_deleted(
    redis_url: str,
) -> None:
    store = await open_store(redis_url)
    other = RedisStore(url=redis_url, fingerprint=OTHER_FP)  # only to encode its values
    raw = await raw_client(redis_url)
    try:
        n = 3 * 4096 + 100
        keys = [key(i) for i in range(6)]
        await store.write(keys, [payload(i, n) for i in range(6)])
        rk = [store.redis_key(k) for k in keys]
        good = [await raw.get(r) for r in rk]
        await raw.set(rk[0], b"garbage" * 100)
        await raw.set(rk[1], good[1][:-10])  # truncated
        await raw.set(rk[2], good[3])  # another key's value swapped in
        await raw.set(rk[3], other.encode_value(keys[3], payload(3, n)))  # another engine's
        flipped = bytearray(good[4])
        flipped[-1] ^= 1
        await raw.set(rk[4], bytes(flipped))  # a bit flipped in the payload
        into = [np.zeros(n, np.uint8) for _ in keys]
        outcomes = await store.read(keys, into)
        assert list(outcomes) == [Outcome.CORRUPT] * 5 + [Outcome.OK]
        stats = store.statistics()
        assert dict(stats.corrupt_by_field) == {
            "checksum": 1,
            "fingerprint": 1,
            "key": 1,
            "length": 1,
            "magic": 1,
        }
        assert stats.corrupt == 5 and stats.reads == 1 and stats.deleted == 5
        assert [await raw.exists(r) for r in rk] == [0, 0, 0, 0, 0, 1]
    finally:
        await store.aclose()
        await other.aclose()
        await raw.aclose()


@pytest.mark.anyio
async def test_encrypted_values_round_trip_and_hide_the_payload(redis_url: str) -> None:
    store = await open_store(redis_url, encrypt_key=AES_KEY)
    raw = await raw_client(redis_url)
    try:
        data = payload(1, 8192)
        await store.write([key(1)], [data])
        at_rest = await raw.get(store.redis_key(key(1)))
        assert data[:64].tobytes() not in at_rest and b"KVFCHUNK" not in at_rest
        into = np.zeros(8192, np.uint8)
        assert list(await store.read([key(1)], [into])) == [Outcome.OK]
        assert np.array_equal(into, data)
    finally:
        await store.aclose()
        await raw.aclose()


@pytest.mark.anyio
async def test_a_sealed_value_under_another_key_or_another_aes_key_does_not_decrypt(
    redis_url: str,
) -> None:
    store = await open_store(redis_url, encrypt_key=AES_KEY)
    wrong = await open_store(redis_url, encrypt_key=bytes(32))
    raw = await raw_client(redis_url)
    try:
        await store.write([key(1), key(2)], [payload(1, 100), payload(2, 100)])
        sealed = await raw.get(store.redis_key(key(1)))
        await raw.set(store.redis_key(key(2)), sealed)
        assert list(await store.read([key(2)], [np.zeros(100, np.uint8)])) == [Outcome.CORRUPT]
        # Moved into the other AES key's names (only someone who can write Redis can).
        await raw.set(wrong.redis_key(key(1)), sealed)
        assert list(await wrong.read([key(1)], [np.zeros(100, np.uint8)])) == [Outcome.CORRUPT]
        assert dict(store.statistics().corrupt_by_field) == {"auth": 1}
        assert dict(wrong.statistics().corrupt_by_field) == {"auth": 1}
    finally:
        for s in (store, wrong):
            await s.aclose()
        await raw.aclose()


@pytest.mark.anyio
async def test_stores_with_another_aes_key_or_none_never_see_nor_delete_the_values(
    redis_url: str,
) -> None:
    """Each AES key (and no key) names its values apart: another key's store finds
    nothing (a miss) and so never deletes a value it could not open."""
    store = await open_store(redis_url, encrypt_key=AES_KEY)
    again = await open_store(redis_url, encrypt_key=AES_KEY)
    others = [await open_store(redis_url, encrypt_key=bytes(32)), await open_store(redis_url)]
    try:
        assert list(await store.write([key(1)], [payload(1, 100)])) == [Outcome.OK]
        names = {s.redis_key(key(1)) for s in (store, *others)}
        assert len(names) == 3 and again.redis_key(key(1)) == store.redis_key(key(1))
        for other in others:
            assert not (await other.exists([key(1)])).any()
            assert list(await other.read([key(1)], [np.zeros(100, np.uint8)])) == [Outcome.ABSENT]
            assert other.statistics().corrupt == 0
        into = np.zeros(100, np.uint8)
        assert list(await again.read([key(1)], [into])) == [Outcome.OK]
        assert np.array_equal(into, payload(1, 100))
        assert AES_KEY.hex() not in store.redis_key(key(1)).decode()
    finally:
        for s in (store, again, *others):
            await s.aclose()


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:6379", "redis://127.0.0.1:notaport", "redis://", "not a url"],
)
def test_a_url_that_does_not_parse_names_the_key(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        RedisStore(url=url, fingerprint=FP, tier_index=2)
    assert info.value.key == "tiers[2].url"


def test_a_cluster_that_is_not_a_list_of_urls_names_the_key() -> None:
    for cluster in ([], "redis://127.0.0.1:7000", ["redis://127.0.0.1:7000", "ftp://x"]):
        with pytest.raises(ConfigError) as info:
            RedisStore(cluster=cluster, fingerprint=FP, tier_index=1)  # type: ignore[arg-type]
        assert info.value.key == "tiers[1].cluster"


def test_an_encrypt_key_of_the_wrong_length_names_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        RedisStore(url="redis://127.0.0.1:1", fingerprint=FP, encrypt_key=b"short")
    assert info.value.key == "tiers[0].encrypt_key"


@pytest.mark.anyio
async def test_a_server_that_cannot_be_reached_at_start_names_the_key() -> None:
    store = RedisStore(url=f"redis://127.0.0.1:{free_port()}/0", fingerprint=FP, tier_index=3)
    with pytest.raises(ConfigError) as info:
        await store.connect()
    assert info.value.key == "tiers[3].url"
    await store.aclose()


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Any:
    server = RedisServer(tmp_path_factory.mktemp("secured"), password="s3cret-Pa55word")
    server.start()
    yield server
    server.kill()


@pytest.mark.anyio
async def test_the_password_is_never_logged_nor_in_errors(
    secured: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    password = "s3cret-Pa55word"
    wrong = f"redis://default:{password}-wrong@127.0.0.1:{secured.port}/0"
    store = RedisStore(url=wrong, fingerprint=FP)
    with pytest.raises(ConfigError) as info:
        await store.connect()
    await store.aclose()
    assert password not in str(info.value) and "***" in str(info.value)
    bad = f"redis://default:{password}@127.0.0.1:notaport/0"
    with pytest.raises(ConfigError) as info:
        RedisStore(url=bad, fingerprint=FP)
    assert password not in str(info.value)
    good = await open_store(secured.url)
    try:
        assert list(await good.write([key(1)], [payload(1)])) == [Outcome.OK]
        assert password not in good.url
    finally:
        await good.aclose()
    assert "redis_connected" in caplog.text
    assert password not in caplog.text


@pytest.mark.anyio
async def test_a_server_full_refuses_stores_as_full(tmp_path: Any) -> None:
    server = RedisServer(tmp_path / "full", extra=("--maxmemory", "2mb"))
    server.start()
    store = await open_store(server.url)
    try:
        outcomes = await store.write(
            [key(i) for i in range(8)], [payload(i, 1 << 20) for i in range(8)]
        )
        assert Outcome.FULL in outcomes.tolist()
        assert dict(store.statistics().writes_skipped_by_outcome)["FULL"] >= 1
    finally:
        await store.aclose()
        server.kill()
