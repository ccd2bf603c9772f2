"""How RedisStore reads replies, against a real redis-server: streamed from the
connection straight into their slots (hiredis connections, the default), or parsed whole
by the client's parser first (any other parser); the same outcomes either way, the
connection in step after every kind of bad value, and no slot written after its read
ended."""

from __future__ import annotations

from typing import Any

import anyio
import attrs
import numpy as np
import pytest
from anyio.abc import SocketAttribute

from kvferry._private_api import PUBLIC_ONLY_ENV
from kvferry.tiers import Outcome, RedisStore

from .conftest import FP, key, payload
from .redis_servers import RedisServer

OTHER_FP = attrs.evolve(FP, model="another-model")
SIZES = [1, 4096, 256 << 10, 3 * 4096 + 100, 1 << 20]


async def open_store(url: str, way: str, **kwargs: Any) -> RedisStore:
    """A store whose reads take ``way``: "streamed" (hiredis, as made), "parsed" (the
    pure-Python parser, which keeps bytes of its own: every reply is parsed first), or
    "public" (the store's reads send plain GETs)."""
    kwargs.setdefault("fingerprint", FP)
    store = RedisStore(url=url, **kwargs)
    if way == "parsed":
        from redis._parsers import _AsyncRESP2Parser

        store.client.connection_pool.connection_kwargs["parser_class"] = _AsyncRESP2Parser
    assert store.streams_reads == (way != "public")
    await store.connect()
    return store


@pytest.fixture(params=["streamed", "parsed", "public"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """ "public": ``KVFERRY_PUBLIC_API_ONLY=1``, where the store reads through the parser
    (its reads never touch the connection's stream: kvferry/_private_api.py)."""
    if request.param == "public":
        monkeypatch.setenv(PUBLIC_ONLY_ENV, "1")
    return str(request.param)


@pytest.mark.anyio
async def test_chunks_of_every_size_read_back_bit_for_bit_either_way(
    redis_url: str, way: str, streamed: list[int]
) -> None:
    store = await open_store(redis_url, way)
    try:
        keys = [key(i) for i in range(len(SIZES))]
        data = [payload(i, n) for i, n in enumerate(SIZES)]
        assert list(await store.write(keys, data)) == [Outcome.OK] * len(SIZES)
        into = [np.zeros(n, np.uint8) for n in SIZES]
        assert list(await store.read(keys, into)) == [Outcome.OK] * len(SIZES)
        for got, want in zip(into, data, strict=True):
            assert np.array_equal(got, want)
        assert len(streamed) == (len(SIZES) if way == "streamed" else 0)
        stats = store.statistics()
        assert stats.reads == len(SIZES) and stats.bytes_read == sum(SIZES)
    finally:
        await store.aclose()


@pytest.mark.anyio
async def test_bad_values_in_the_middle_of_a_read_leave_the_replies_after_them_good(
    redis_url: str, way: str, streamed: list[int]
) -> None:
    """Each kind of bad value between good ones, in one pipeline: a header that fails
    (its payload is skipped on the wire), a payload that fails its checksum, a value of
    another length (read whole), a missing key, a key of another type (an error reply)."""
    import redis.asyncio

    store = await open_store(redis_url, way)
    other = RedisStore(url=redis_url, fingerprint=OTHER_FP)  # only to encode its values
    raw = redis.asyncio.Redis.from_url(redis_url)
    try:
        n = 256 << 10
        keys = [key(i) for i in range(12)]
        data = [payload(i, n) for i in range(12)]
        await store.write(keys, data)
        rk = [store.redis_key(k) for k in keys]
        good = [await raw.get(r) for r in rk]
        await raw.set(rk[1], b"garbage" * 1000)  # magic
        await raw.set(rk[3], good[5])  # another key's value: its header names that key
        await raw.set(rk[5], other.encode_value(keys[5], data[5]))  # another engine's
        flipped = bytearray(good[7])
        flipped[len(flipped) // 2] ^= 1
        await raw.set(rk[7], bytes(flipped))  # checksum
        await raw.set(rk[8], good[8][:-10])  # truncated: length
        await raw.delete(rk[9])  # absent
        await raw.delete(rk[10])
        await raw.hset(rk[10], "field", b"value")  # WRONGTYPE: an error reply
        into = [np.zeros(n, np.uint8) for _ in keys]
        outcomes = await store.read(keys, into)
        C, OK = Outcome.CORRUPT, Outcome.OK
        assert list(outcomes) == [
            OK,
            C,
            OK,
            C,
            OK,
            C,
            OK,
            C,
            C,
            Outcome.ABSENT,
            Outcome.IO_ERROR,
            OK,
        ]
        for i in (0, 2, 4, 6, 11):
            assert np.array_equal(into[i], data[i])
        stats = store.statistics()
        assert dict(stats.corrupt_by_field) == {
            "magic": 1,
            "key": 1,
            "fingerprint": 1,
            "checksum": 1,
            "length": 1,
        }
        # The connection is in step: the next read on it is right too.
        again = [np.zeros(n, np.uint8) for _ in range(3)]
        assert list(await store.read([keys[0], keys[6], keys[11]], again)) == [OK] * 3
        assert all(np.array_equal(a, data[i]) for a, i in zip(again, (0, 6, 11), strict=True))
        if way == "streamed":
            assert len(streamed) == 12 - 2 + 3  # every value: not the absent, not the error
    finally:
        await store.aclose()
        await other.aclose()
        await raw.aclose()


@pytest.mark.anyio
async def test_a_resp3_connection_reads_values_and_absent_keys(
    redis_url: str, streamed: list[int]
) -> None:
    store = await open_store(redis_url.replace("/0", "/0?protocol=3"), "streamed")
    try:
        data = [payload(1, 4096), payload(2, 256 << 10)]
        await store.write([key(1), key(2)], data)
        into = [np.zeros(4096, np.uint8), np.zeros(5, np.uint8), np.zeros(256 << 10, np.uint8)]
        outcomes = await store.read([key(1), key(99), key(2)], into)
        assert list(outcomes) == [Outcome.OK, Outcome.ABSENT, Outcome.OK]
        assert np.array_equal(into[0], data[0]) and np.array_equal(into[2], data[1])
        assert len(streamed) == 2
    finally:
        await store.aclose()


class StallingProxy:
    """A TCP proxy in front of the server: everything from the client goes on; from the
    server, only ``budget`` bytes (then nothing, until :meth:`release`)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.budget: float = float("inf")
        self.released = anyio.Event()
        self.listener: Any = None

    async def serve(self, task_group: Any) -> int:
        self.listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        task_group.start_soon(self.listener.serve, self._handle)
        return int(self.listener.extra(SocketAttribute.local_port))

    async def _handle(self, client: Any) -> None:
        async with client, await anyio.connect_tcp("127.0.0.1", self.port) as server:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._pump, client, server, False)
                await self._pump(server, client, True)
                tg.cancel_scope.cancel()

    async def _pump(self, src: Any, dst: Any, limited: bool) -> None:
        try:
            async for data in src:
                if limited and len(data) > self.budget:
                    head, data = data[: int(self.budget)], data[int(self.budget) :]
                    if head:
                        await dst.send(head)
                    self.budget = 0
                    await self.released.wait()
                elif limited:
                    self.budget -= len(data)
                await dst.send(data)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass

    def release(self) -> None:
        self.budget = float("inf")
        self.released.set()


@pytest.mark.anyio
async def test_a_read_cut_short_inside_a_reply_writes_no_slot_after_it_ended(
    redis_server: RedisServer, redis_url: str, streamed: list[int]
) -> None:
    n = 1 << 20
    data = [payload(i, n) for i in range(3)]
    writer = await open_store(redis_url, "streamed")
    await writer.write([key(i) for i in range(3)], data)
    await writer.aclose()
    proxy = StallingProxy(redis_server.port)
    async with anyio.create_task_group() as tg:
        port = await proxy.serve(tg)
        store = await open_store(f"redis://127.0.0.1:{port}/0", "streamed", op_timeout_s=0.5)
        try:
            proxy.budget = n + n // 2  # the first value whole, half of the second
            into = [np.zeros(n, np.uint8) for _ in range(3)]
            outcomes = await store.read([key(i) for i in range(3)], into)
            assert list(outcomes) == [Outcome.TIMEOUT] * 3
            assert len(streamed) == 2  # it was inside the second value
            seen = [a.copy() for a in into]
            proxy.release()  # the rest of the replies reach the client's old socket
            # A read after it, on a fresh connection, is right; the old one's bytes were
            # never read into the slots of the read that ended.
            again = [np.zeros(n, np.uint8) for _ in range(3)]
            assert list(await store.read([key(i) for i in range(3)], again)) == [Outcome.OK] * 3
            assert all(np.array_equal(a, d) for a, d in zip(again, data, strict=True))
            assert all(np.array_equal(a, s) for a, s in zip(into, seen, strict=True))
        finally:
            await store.aclose()
            tg.cancel_scope.cancel()
    await proxy.listener.aclose()
