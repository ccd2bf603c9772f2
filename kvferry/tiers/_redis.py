"""RedisStore: chunks in a shared Redis (one server, or a Redis Cluster), verified on
every read.

Keys: ``kvferry:v{FORMAT_VERSION}:{fingerprint digest hex}:{key hex}``, with
``encrypt_key`` ``kvferry:v{FORMAT_VERSION}:{fingerprint digest hex}:e{key id}:{key
hex}`` (the key id: 8 bytes of HMAC-SHA256 of a fixed label under the AES key, which
names the key without revealing it). Engines with another fingerprint (model, dtype,
layout, block size, rank, hash algorithm) or another ``encrypt_key`` (or none) never see
each other's chunks, so never delete them as values they cannot open; engines with the
same ones always do. On a cluster the keys
spread over every slot (no hash tag): each operation is one pipeline of single-key
commands, which the cluster client splits by node; no command spans two slots.

Values describe themselves: the chunk header of :mod:`._format` in its compact spelling
(no padding) followed by the payload. A write sends the two as pieces of one value (the
client's connections pack :class:`_Joined` values), the payload a view of the caller's
buffer: no copy behind its header. With ``encrypt_key``, the whole value (header and
payload) is sealed with AES-GCM (``cryptography``), a fresh 12-byte nonce first, and the
Redis key as associated data: a value that does not decrypt (tampered with, written
under another key or with another key) is corrupt (field ``"auth"``).

A read's replies go straight from the connection into their slots as they arrive (the
same connections read the replies to GETs of :class:`_Into` keys themselves), the
payload hashed piece by piece while it is in the CPU's cache, with no bytes object of
the whole value made (through a connection's stream and parser: a private use of
redis-py, probed in :mod:`kvferry._private_api`); a sealed value, one on a connection
whose parser is not hiredis, or every value on the public path, is read whole by the
parser first.

Every read verifies the header (magic, version, header checksum, fingerprint, key,
length) and the payload's xxh3 checksum. A value that fails is a miss, counted by the
check that failed, logged once per check, and deleted. Failures are misses, never errors
the caller must handle: no answer within ``op_timeout_s`` is ``TIMEOUT``; a connection
or server error is ``IO_ERROR`` (a write refused for ``maxmemory`` is ``FULL``); an
open :class:`~._breaker.CircuitBreaker` sends nothing (``UNAVAILABLE``).

Who owns what: a store lives on one asyncio event loop (the ``redis`` client's); its
counters and breaker are touched only from that loop, so need no lock. The ``redis``
package is imported when a store is made, never by ``import kvferry``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
import urllib.parse
from collections import deque
from collections.abc import Sequence
from typing import Any, cast

import anyio
import attrs
import numpy as np
import numpy.typing as npt
import xxhash

from .._config import encrypt_key_bytes, parse_redis_url, redact_url
from .._errors import ConfigError
from .._logging import get_logger
from .._private_api import redis_streams_replies, reply_error, reply_stream
from ._breaker import BreakerStatistics, CircuitBreaker
from ._disk import BufferLike, Outcome, _byte_view
from ._format import (
    FORMAT_VERSION,
    MAX_KEY_BYTES,
    ChunkCorrupt,
    ChunkHeader,
    Fingerprint,
    compact_header_size,
    decode_header,
    payload_checksum,
)

_NONCE_BYTES = 12
_TAG_BYTES = 16
_FREE_BUFFERS = 8
"""Write buffers kept for reuse (one per write in flight: the actor's ``io_depth``)."""


@attrs.frozen(kw_only=True)
class RedisStatistics:
    """A snapshot of a :class:`RedisStore`'s counters (bytes are payload bytes)."""

    reads: int
    """Chunks loaded and verified (hits)."""
    bytes_read: int
    read_seconds: float
    """Wall time of the read operations (each a pipeline), summed."""
    writes: int
    bytes_written: int
    write_seconds: float
    absent: int
    corrupt: int
    corrupt_by_field: tuple[tuple[str, int], ...]
    """Per failed check: ``magic``, ``version``, ``header_checksum``, ``fingerprint``,
    ``key``, ``length``, ``checksum``, ``auth`` (did not decrypt)."""
    writes_skipped: int
    writes_skipped_by_outcome: tuple[tuple[str, int], ...]
    """Stores not made, by :class:`Outcome` name (``UNAVAILABLE``: the breaker was open)."""
    exists_checked: int
    exists_found: int
    deleted: int
    timeouts: int
    """Operations that got no answer within their timeout."""
    errors: int
    """Operations that failed on a connection or server error."""
    breaker: BreakerStatistics


_KEY_ID_LABEL = b"kvferry redis encrypt_key id"


def _aead(encrypt_key: bytes | str | None, key: str) -> tuple[Any, str]:
    """The AES-GCM sealer of ``encrypt_key`` and the key's id for Redis keys (``""``
    without a key)."""
    raw = encrypt_key_bytes(encrypt_key, key)
    if raw is None:
        return None, ""
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as exc:
        raise ConfigError(
            key, "needs the cryptography package: pip install 'kvferry[redis]'"
        ) from exc
    key_id = hmac.new(raw, _KEY_ID_LABEL, hashlib.sha256).hexdigest()[:16]
    return AESGCM(raw), f"e{key_id}:"


@attrs.frozen
class _Joined:
    """One Redis value sent as two buffers: a chunk's header, then a view of its payload
    where it lies. What a SET of ``header + payload`` sends, without making that value."""

    header: bytes
    payload: memoryview


def _pack_joined(encoder: Any, args: tuple[Any, ...]) -> list[bytes | memoryview]:
    """The RESP of one command whose arguments may be :class:`_Joined` values (the rest
    encoded as ``redis`` does): each payload its own piece, so that the client's
    ``pack_commands`` passes it on as it is, like any value it would send as a view."""
    out: list[bytes | memoryview] = []
    pending: list[bytes | memoryview] = [b"*%d\r\n" % len(args)]
    for arg in args:
        if type(arg) is _Joined:
            size = len(arg.header) + len(arg.payload)
            pending += (b"$%d\r\n" % size, arg.header)
            out += (b"".join(pending), arg.payload)
            pending = [b"\r\n"]
        else:
            value = encoder.encode(arg)
            pending += (b"$%d\r\n" % len(value), value, b"\r\n")
    out.append(b"".join(pending))
    return out


class _Into(bytes):
    """A GET's key (its bytes) that carries ``sink``, which takes the reply: the
    connection that packs the command queues the sink, and hands it its reply as it
    reads it (:func:`_joining_connection`). Bytes, so that a cluster client routes it
    like any key."""

    sink: _Target


def _into(key: bytes, sink: _Target) -> _Into:
    k = _Into(key)
    k.sink = sink
    return k


@attrs.define(eq=False)
class _Sink:
    """Where one read's replies go as they are read: ``take(i)`` is the
    :class:`_Target` of reply ``i``, which verifies it into ``views[i]``. ``open`` is
    cleared when the read ends, so that a reply read after that (none is: a read cut
    short disconnects) writes into no slot."""

    store: RedisStore
    keys: Sequence[bytes]
    rkeys: list[bytes]
    views: list[memoryview]
    open: bool = True

    def take(self, i: int) -> _Target:
        return _Target(self, i)


@attrs.define(eq=False)
class _Target:
    """Reply ``i`` of a read (:class:`_Sink`). Either way it is taken, it returns a
    marker in the reply's place: :data:`_VERIFIED` (the payload is in its slot), a
    :class:`_Rejected` (what it found is returned, never raised: an exception would
    leave the connection's later replies unread, and a pipeline takes an exception in
    a reply's place for the server's error), or None (no such key)."""

    sink: _Sink
    i: int

    def __call__(self, value: Any) -> Any:
        """The whole reply, as the parser returned it."""
        sink, i = self.sink, self.i
        if not sink.open or value is None or isinstance(value, Exception):
            return value
        try:
            sink.store._decode_into(sink.keys[i], sink.rkeys[i], value, sink.views[i])
        except ChunkCorrupt as exc:
            return _Rejected(exc)
        return _VERIFIED

    async def stream_in(self, stream: Any, n: int) -> Any:
        """The reply's ``n`` bytes and its CRLF, read from ``stream`` (an asyncio
        ``StreamReader``) as they arrive: the header, verified; then the payload a piece
        at a time, each copied into the slot and hashed while it is in the CPU's cache.
        A value that cannot stream (sealed, or not of the slot's length) is read whole
        and verified as one. Reads exactly the reply's bytes, or raises (the connection
        is then dropped)."""
        sink, i = self.sink, self.i
        store, view = sink.store, sink.views[i]
        start = compact_header_size(len(sink.keys[i]))
        total = len(view)
        if store._aead is not None or n != start + total or not sink.open:
            data = await stream.readexactly(n + 2)
            _check_crlf(data[-2:])
            return self(memoryview(data)[:n])
        piece = await stream.readexactly(start)
        try:
            header = decode_header(
                piece,
                fingerprint=store.fingerprint.digest,
                key=sink.keys[i],
                payload_length=total,
                compact=True,
            )
        except ChunkCorrupt as exc:
            await _skip(stream, total + 2)
            return _Rejected(exc)
        hasher = xxhash.xxh3_64()
        pos = 0
        while pos < total:
            piece = await stream.read(min(total - pos, _PIECE))
            if not piece:
                raise EOFError("the server closed the connection inside a reply")
            view[pos : pos + len(piece)] = piece
            hasher.update(piece)
            pos += len(piece)
        _check_crlf(await stream.readexactly(2))
        if hasher.intdigest() != header.payload_checksum:
            return _Rejected(ChunkCorrupt("checksum", "payload bytes do not match their checksum"))
        return _VERIFIED


_PIECE = 1 << 16
"""The most of a payload taken from the stream at once: a piece stays in the CPU's
cache from its copy into the slot to its hash."""


def _check_crlf(end: bytes) -> None:
    if end != b"\r\n":
        raise EOFError(f"a bulk reply ends in {end!r}, not CRLF")


async def _skip(stream: Any, n: int) -> None:
    """Read and drop ``n`` bytes of ``stream``, a piece at a time."""
    while n > 0:
        piece = await stream.read(min(n, _PIECE))
        if not piece:
            raise EOFError("the server closed the connection inside a reply")
        n -= len(piece)


@attrs.frozen
class _Rejected:
    """A reply that failed verification as it was read."""

    error: ChunkCorrupt


_VERIFIED = object()
"""A reply verified and copied into its slot as it was read (:class:`_Sink`)."""

_JOINING: dict[type[Any], type[Any]] = {}


def _joining_connection(base: type[Any]) -> type[Any]:
    """``base`` (a ``redis.asyncio`` connection class) that also packs :class:`_Joined`
    values, and streams the reply of a GET of an :class:`_Into` key into its sink; one
    class per base.

    Replies come back in the order commands were sent, so a connection keeps the sinks
    of the commands it packed (a new batch, ``pack_commands``, starts afresh) and queues
    them once they are sent: replies read before that (the handshake of a connection
    opened to send them, a health check) are not theirs. A disconnect forgets them. A
    reply with a sink waiting is read here when the parser holds no bytes of its own
    (hiredis between replies: always, in a batch of such GETs): its length line, then
    the value, through :meth:`_Target.stream_in`, taken from the stream's buffer a
    piece at a time; the parser would have copied it three times first (its reads, its
    own buffer, the reply's bytes). Otherwise the parser reads it, and the sink takes
    what it returns. An error reply raises what the parser's would (``MOVED`` on a
    cluster); a read that fails, or is cancelled, disconnects, as the base class's
    does."""
    joining = _JOINING.get(base)
    if joining is None:
        from redis.exceptions import ConnectionError as RedisConnectionError

        def pack_command(self: Any, *args: Any) -> Any:
            joined = False
            for a in args:
                t = type(a)
                if t is _Into:
                    packed = self.__dict__.setdefault("_kvferry_packed", deque())
                    packed.append(a.sink)
                elif t is _Joined:
                    joined = True
            if joined:
                return _pack_joined(self.encoder, args)
            return base.pack_command(self, *args)

        def pack_commands(self: Any, commands: Any) -> Any:
            self.__dict__.pop("_kvferry_packed", None)  # a new batch
            return base.pack_commands(self, commands)

        async def send_packed_command(self: Any, *args: Any, **kwargs: Any) -> Any:
            # The sinks wait for the replies from when the commands are sent: replies read
            # before (a connection's handshake, a health check) are not theirs.
            packed = self.__dict__.pop("_kvferry_packed", None)
            await base.send_packed_command(self, *args, **kwargs)
            if packed:
                self._kvferry_sinks = packed

        async def disconnect(self: Any, *args: Any, **kwargs: Any) -> Any:
            self.__dict__.pop("_kvferry_packed", None)
            self.__dict__.pop("_kvferry_sinks", None)
            return await base.disconnect(self, *args, **kwargs)

        async def read_response(self: Any, *args: Any, **kwargs: Any) -> Any:
            sinks = self.__dict__.get("_kvferry_sinks")
            if not sinks:
                return await base.read_response(self, *args, **kwargs)
            sink = sinks.popleft()
            stream = reply_stream(self)
            if stream is None:
                return sink(await base.read_response(self, *args, **kwargs))
            # No timeout of its own: only RedisStore.read sends such GETs, inside its
            # operation's (which cancels the read, and so disconnects, when it passes).
            try:
                line = await stream.readline()
                if line[:1] == b"$" and line[-2:] == b"\r\n":
                    n = int(line[1:-2])
                    return sink(None) if n < 0 else await sink.stream_in(stream, n)
                if line == b"_\r\n":  # RESP3's null
                    return sink(None)
            except (OSError, EOFError) as exc:  # EOFError: asyncio's IncompleteReadError
                await self.disconnect(nowait=True)
                raise RedisConnectionError(f"Error while reading from the server: {exc}") from exc
            except BaseException:
                await self.disconnect(nowait=True)
                raise
            if line[:1] == b"-" and line[-2:] == b"\r\n":
                raise reply_error(self, line[1:-2].decode(errors="replace"))
            await self.disconnect(nowait=True)
            raise RedisConnectionError(f"unexpected reply to a GET: {line[:32]!r}")

        joining = type(
            f"Joining{base.__name__}",
            (base,),
            {
                "pack_command": pack_command,
                "pack_commands": pack_commands,
                "send_packed_command": send_packed_command,
                "disconnect": disconnect,
                "read_response": read_response,
            },
        )
        _JOINING[base] = joining
    return joining


def _make_joining(client: Any) -> bool:
    """Make every connection ``client`` opens pack :class:`_Joined` values; whether it
    could. A single server's pool names its connection class (``rediss://`` chose its
    TLS one); a cluster client gives its connection arguments to the nodes it finds
    (and had given them to its startup nodes). False, and nothing changed, when this
    ``redis`` keeps them elsewhere: writes then copy each value whole."""
    from redis.asyncio.connection import Connection

    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        base = getattr(pool, "connection_class", None)
        if not (isinstance(base, type) and issubclass(base, Connection)):
            return False
        pool.connection_class = _joining_connection(base)
        return True
    given = getattr(client, "connection_kwargs", None)
    manager = getattr(client, "nodes_manager", None)
    found = getattr(manager, "startup_nodes", None)
    if not isinstance(given, dict) or not isinstance(found, dict):
        return False
    kwargs = cast(dict[str, Any], given)
    nodes = cast(dict[str, Any], found)
    base = kwargs.get("connection_class")
    if (
        getattr(manager, "connection_kwargs", None) is not kwargs
        or any(getattr(n, "connection_class", None) is not base for n in nodes.values())
        or not (isinstance(base, type) and issubclass(base, Connection))
    ):
        return False
    kwargs["connection_class"] = joining = _joining_connection(base)
    for node in nodes.values():
        node.connection_class = joining
    return True


class RedisStore:
    """Chunks of one engine (one :class:`Fingerprint`) in a Redis server or cluster.

    Give ``url`` (``redis://[user:password@]host:port/db``, ``rediss://`` for TLS) or
    ``cluster`` (a list of such URLs, any of the cluster's nodes; user, password and TLS
    from the first). ``tier_index`` names the configuration keys in errors
    (``tiers[i].url``, ``tiers[i].cluster``). ``ttl_s``: each chunk expires this long
    after its write (None: never; the server's ``maxmemory`` policy still evicts).
    ``op_timeout_s`` bounds every operation (connect; a pipeline, with the breaker's
    probe before it when it asks for one); ``connect_timeout_s`` the first connection
    (:meth:`connect`). ``breaker``: the circuit breaker (a default one if None).
    ``max_connections``: the client's pool (an operation beyond it fails).

    Call :meth:`connect` once (it raises :class:`~kvferry.ConfigError` when the server
    cannot be reached or refuses the credentials), then the operations; :meth:`aclose`
    at the end. Every operation is batched (one pipeline) and ends within its timeout.
    """

    def __init__(
        self,
        *,
        fingerprint: Fingerprint,
        url: str | None = None,
        cluster: Sequence[str] | None = None,
        tier_index: int = 0,
        ttl_s: int | None = 24 * 3600,
        op_timeout_s: float = 1.0,
        connect_timeout_s: float = 5.0,
        encrypt_key: bytes | str | None = None,
        breaker: CircuitBreaker | None = None,
        max_connections: int = 16,
    ) -> None:
        self._tier = f"tiers[{tier_index}]"
        if (url is None) == (cluster is None):
            raise ConfigError(f"{self._tier}.url", "give either url or cluster, not both")
        bad_ttl = isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s < 1
        if ttl_s is not None and bad_ttl:
            raise ConfigError(f"{self._tier}.ttl_s", f"whole seconds >= 1 or None, got {ttl_s!r}")
        if not op_timeout_s > 0 or not connect_timeout_s > 0:
            raise ConfigError(f"{self._tier}.op_timeout_s", "timeouts must be > 0")
        self.config_key = f"{self._tier}.url" if url is not None else f"{self._tier}.cluster"
        urls: list[str]
        if url is not None:
            urls = [url]
        elif isinstance(cluster, str) or not cluster:
            raise ConfigError(self.config_key, "a non-empty list of redis:// URLs")
        else:
            urls = list(cluster)
        parsed = [parse_redis_url(u, self.config_key) for u in urls]
        self.is_cluster = cluster is not None
        self.url = redact_url(urls[0]) if url is not None else ",".join(map(redact_url, urls))
        self.fingerprint = fingerprint
        self.ttl_s = ttl_s
        self.op_timeout_s = op_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.breaker = breaker or CircuitBreaker()
        self._secrets = [p.password for p in parsed if p.password]
        self._aead, key_id = _aead(encrypt_key, f"{self._tier}.encrypt_key")
        self._prefix = f"kvferry:v{FORMAT_VERSION}:{fingerprint.digest.hex()}:{key_id}".encode()
        self._log = get_logger("kvferry.tiers", tier=tier_index, redis=self.url)
        self._logged: set[str] = set()
        self.joins_values = False
        """Whether writes send each value as its header and a view of its payload (every
        connection of the client packs :class:`_Joined` values), not a copy of both."""
        self.streams_reads = False
        """Whether reads take each reply from the connection's stream into its slot (the
        store's own connections, and redis-py as :func:`redis_streams_replies` probed);
        else the parser reads each reply whole, and it is verified and copied after."""
        self._client = self._make_client(urls, parsed, max_connections)
        self._counts: dict[str, int] = dict.fromkeys(
            (
                "reads",
                "bytes_read",
                "writes",
                "bytes_written",
                "absent",
                "exists_checked",
                "exists_found",
                "deleted",
                "timeouts",
                "errors",
            ),
            0,
        )
        self._seconds = {"read": 0.0, "write": 0.0}
        self._corrupt: dict[str, int] = {}
        self._skipped: dict[str, int] = {}
        self._free: list[bytearray] = []

    # ---------------------------------------------------------------- start, stop

    def _make_client(
        self, urls: list[str], parsed: list[urllib.parse.SplitResult], max_connections: int
    ) -> Any:
        # Imported here: `import kvferry` never needs the redis package.
        try:
            import redis.asyncio as aioredis
            from redis.asyncio.cluster import ClusterNode, RedisCluster
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff
            from redis.exceptions import ConnectionError as RedisConnectionError
        except ImportError as exc:
            raise ConfigError(
                self.config_key, "needs the redis package: pip install 'kvferry[redis]'"
            ) from exc
        common: dict[str, Any] = {
            "socket_timeout": self.op_timeout_s,
            "socket_connect_timeout": self.connect_timeout_s,
            # Retries are the breaker's business, with one exception: a pooled connection
            # the server closed (it restarted, or failed over) is reconnected once, at
            # once, within the same operation's timeout (_pipeline bounds it).
            "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            "retry_on_error": [RedisConnectionError],  # redis < 6 reads this one too
            "max_connections": max_connections,
        }
        try:
            client: Any
            if not self.is_cluster:
                client = aioredis.Redis.from_url(urls[0], **common)
            else:
                first = parsed[0]
                client = RedisCluster(
                    startup_nodes=[ClusterNode(str(p.hostname), p.port or 6379) for p in parsed],
                    username=first.username,
                    password=first.password,
                    ssl=first.scheme == "rediss",
                    **common,
                )
        except (ValueError, TypeError) as exc:
            raise ConfigError(self.config_key, f"{self.url}: {self._scrub(exc)}") from None
        self.joins_values = _make_joining(client)
        self.streams_reads = self.joins_values and redis_streams_replies()
        return client

    async def connect(self) -> None:
        """Reach the server (a PING; on a cluster, its slot map) within
        ``connect_timeout_s``; a :class:`~kvferry.ConfigError` naming the tier's key if
        it cannot (no server, wrong password, TLS refused)."""
        error: str = "no answer"
        with anyio.move_on_after(self.connect_timeout_s):
            try:
                if self.is_cluster:
                    await self._client.initialize()
                await self._client.ping()
                self._log.info("redis_connected", cluster=self.is_cluster, ttl_s=self.ttl_s)
                return
            except Exception as exc:  # any failure to reach it is the configuration's
                error = self._scrub(exc)
        raise ConfigError(
            self.config_key,
            f"cannot reach {self.url} within {self.connect_timeout_s} s: {error}",
        )

    async def aclose(self) -> None:
        """Close the client's connections."""
        with anyio.move_on_after(self.op_timeout_s):
            await self._client.aclose()

    async def __aenter__(self) -> RedisStore:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def client(self) -> Any:
        """The ``redis`` client underneath (``redis.asyncio.Redis`` or ``RedisCluster``),
        for diagnostics and benchmarks; operations go through the store."""
        return self._client

    def _scrub(self, exc: BaseException | str) -> str:
        """An error's text without any password of the configuration."""
        text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    # ---------------------------------------------------------------- keys

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key of chunk ``key`` (see the module docstring)."""
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"a key is 1 to {MAX_KEY_BYTES} bytes, got {len(key)}")
        return self._prefix + key.hex().encode()

    def _header(self, key: bytes, body: memoryview) -> bytes:
        return ChunkHeader(
            fingerprint=self.fingerprint.digest,
            key=key,
            payload_length=len(body),
            payload_checksum=payload_checksum(body),
        ).encode(compact=True)

    def encode_value(self, key: bytes, payload: BufferLike) -> bytes:
        """The value stored for ``key``: compact header + payload (sealed with
        ``encrypt_key`` if given)."""
        body = _byte_view(payload, writable=False)
        value = b"".join((self._header(key, body), body))
        if self._aead is None:
            return value
        nonce = os.urandom(_NONCE_BYTES)
        return nonce + bytes(self._aead.encrypt(nonce, value, self.redis_key(key)))

    def _encode_batch(
        self, keys: Sequence[bytes], payloads: Sequence[BufferLike]
    ) -> tuple[list[bytes | memoryview | _Joined], bytearray | None]:
        """The values of a write, and the buffer they lie in, if any (give it back with
        :meth:`_give_back` once the pipeline ended).

        Unsealed values go out as :class:`_Joined` pairs when the client's connections
        pack them (:func:`_joining_connection`): the header and a view of the payload
        where it lies, no copy. Otherwise (a ``redis`` whose cluster client would not
        take the connection class) they are built in a reused buffer and sent as views
        of it: a fresh bytes object per value would cost the machine a page fault per 4
        KiB touched (measured: writes of 256 KiB chunks at half the raw SET rate)."""
        if self._aead is not None:
            return [self.encode_value(k, p) for k, p in zip(keys, payloads, strict=True)], None
        bodies = [_byte_view(p, writable=False) for p in payloads]
        headers = [self._header(k, b) for k, b in zip(keys, bodies, strict=True)]
        if self.joins_values:
            return [_Joined(h, b) for h, b in zip(headers, bodies, strict=True)], None
        total = sum(len(h) + len(b) for h, b in zip(headers, bodies, strict=True))
        buf = next((b for b in self._free if len(b) >= total), None)
        if buf is None:
            buf = bytearray(total)
        else:
            self._free.remove(buf)
        view = memoryview(buf)
        values: list[bytes | memoryview | _Joined] = []
        at = 0
        for header, body in zip(headers, bodies, strict=True):
            end = at + len(header) + len(body)
            view[at : at + len(header)] = header
            view[at + len(header) : end] = body
            values.append(view[at:end])
            at = end
        return values, buf

    def _give_back(self, buf: bytearray | None) -> None:
        # The pipeline ended (answered, failed or cancelled). Answered, the server has
        # every byte, so the client holds no view of the buffer (or of a payload) any
        # more. Failed or cancelled, a transport may still hold one and send what it
        # reads there later: a value whose payload no longer matches its header's
        # checksum, a miss to whoever reads it (and deleted), never a wrong chunk.
        if buf is not None and len(self._free) < _FREE_BUFFERS:
            self._free.append(buf)

    def _decode_into(
        self, key: bytes, rkey: bytes, value: bytes | memoryview, into: memoryview
    ) -> None:
        """Verify ``value`` as ``key``'s chunk and copy its payload into ``into``, or
        raise :class:`ChunkCorrupt` (field ``"auth"``: it did not decrypt)."""
        if self._aead is not None:
            from cryptography.exceptions import InvalidTag

            if len(value) < _NONCE_BYTES + _TAG_BYTES:
                raise ChunkCorrupt("length", f"sealed value of {len(value)} bytes")
            try:
                value = self._aead.decrypt(bytes(value[:_NONCE_BYTES]), value[_NONCE_BYTES:], rkey)
            except InvalidTag:
                raise _AuthFailed() from None
        n = len(into)
        header = decode_header(
            value, fingerprint=self.fingerprint.digest, key=key, payload_length=n, compact=True
        )
        start = compact_header_size(len(key))
        if len(value) != start + n:
            raise ChunkCorrupt("length", f"value of {len(value)} bytes, {start + n} expected")
        payload = memoryview(value)[start:]
        if payload_checksum(payload) != header.payload_checksum:
            raise ChunkCorrupt("checksum", "payload bytes do not match their checksum")
        into[:] = payload

    # ---------------------------------------------------------------- operations

    async def _pipeline(
        self, op: str, commands: list[tuple[Any, ...]], timeout_s: float | None
    ) -> list[Any] | Outcome:
        """Run ``commands`` as one pipeline through the breaker: the replies (an
        exception per command that failed on the server), or the :class:`Outcome` of
        every command when none got an answer. The breaker's probe, when it asks for one,
        comes out of the same time: the pipeline gets what the probe left of it."""
        if not commands:
            return []
        admission = self.breaker.begin()
        if admission == "reject":
            return Outcome.UNAVAILABLE
        timeout = self.op_timeout_s if timeout_s is None else min(timeout_s, self.op_timeout_s)
        deadline = anyio.current_time() + timeout
        if admission == "probe":
            ok = False
            try:
                ok = await self._probe(deadline)
            finally:
                # Reported however the probe ends, a caller's cancellation too (a failed
                # probe: another cool-down): half-open, the breaker rejects everything else.
                self.breaker.probed(ok)
            if not ok:
                return Outcome.UNAVAILABLE
            self._log.info("redis_breaker_closed")
        failure: Outcome = Outcome.TIMEOUT
        with anyio.CancelScope(deadline=deadline):
            try:
                pipe = self._client.pipeline(transaction=False)
                for cmd in commands:
                    pipe.execute_command(*cmd)
                replies: list[Any] = await pipe.execute(raise_on_error=False)
            except Exception as exc:  # connection refused, reset, cluster down...
                failure = Outcome.IO_ERROR
                self._log_once(f"error:{op}", "redis_op_failed", op=op, error=self._scrub(exc))
            else:
                self.breaker.succeeded()
                return replies
        if failure == Outcome.TIMEOUT:
            self._counts["timeouts"] += 1
            self._log_once(f"timeout:{op}", "redis_op_timed_out", op=op, timeout_s=timeout)
        else:
            self._counts["errors"] += 1
        was = self.breaker.state
        self.breaker.failed()
        if was == "closed" and self.breaker.state == "open":
            self._log.warning(
                "redis_breaker_opened",
                failures=self.breaker.threshold,
                cooldown_s=self.breaker.cooldown_s,
            )
        return failure

    async def _probe(self, deadline: float) -> bool:
        with anyio.CancelScope(deadline=deadline):
            try:
                await self._client.ping()
                return True
            except Exception:
                return False
        return False

    async def exists(
        self, keys: Sequence[bytes], *, timeout_s: float | None = None
    ) -> npt.NDArray[np.bool_]:
        """Which of ``keys`` the store holds now (one pipeline of EXISTS). A key it
        cannot answer for (timeout, error, breaker open) is False: a miss."""
        found = await self.check(keys, timeout_s=timeout_s)
        return np.zeros(len(keys), dtype=np.bool_) if isinstance(found, Outcome) else found

    async def check(
        self, keys: Sequence[bytes], *, timeout_s: float | None = None
    ) -> npt.NDArray[np.bool_] | Outcome:
        """:meth:`exists`, telling a question without an answer apart: its
        :class:`Outcome` (``TIMEOUT``, ``IO_ERROR``, ``UNAVAILABLE`` while the breaker is
        open) instead of an answer."""
        found = np.zeros(len(keys), dtype=np.bool_)
        replies = await self._pipeline(
            "exists", [("EXISTS", self.redis_key(k)) for k in keys], timeout_s
        )
        if isinstance(replies, Outcome):
            return replies
        for i, r in enumerate(replies):
            found[i] = isinstance(r, int) and r > 0
        self._counts["exists_checked"] += len(keys)
        self._counts["exists_found"] += int(found.sum())
        return found

    async def write(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[BufferLike],
        *,
        timeout_s: float | None = None,
    ) -> npt.NDArray[np.int8]:
        """Store ``payloads[i]`` as ``keys[i]``'s chunk (SET with EX ``ttl_s``; replaces
        any), all in one pipeline. One :class:`Outcome` per chunk: ``OK``, or why it was
        skipped (``FULL``: the server's ``maxmemory``; ``IO_ERROR``; ``TIMEOUT``;
        ``UNAVAILABLE``). A skipped store is only a future miss."""
        if len(keys) != len(payloads):
            raise ValueError(f"{len(keys)} keys for {len(payloads)} payloads")
        start = time.perf_counter()
        values, buf = self._encode_batch(keys, payloads)
        ttl: tuple[Any, ...] = ("EX", self.ttl_s) if self.ttl_s is not None else ()
        try:
            replies = await self._pipeline(
                "write",
                [("SET", self.redis_key(k), v, *ttl) for k, v in zip(keys, values, strict=True)],
                timeout_s,
            )
        finally:
            del values
            self._give_back(buf)
        outcomes = np.full(len(keys), Outcome.OK, dtype=np.int8)
        if isinstance(replies, Outcome):
            outcomes[:] = replies
        else:
            for i, r in enumerate(replies):
                if isinstance(r, Exception):
                    # maxmemory reached (with a policy that does not evict, or nothing
                    # left to evict): redis-py's OutOfMemoryError, "OOM ..." on the wire.
                    full = type(r).__name__ == "OutOfMemoryError" or str(r).startswith("OOM")
                    outcomes[i] = Outcome.FULL if full else Outcome.IO_ERROR
                    self._log_once(
                        f"write:{outcomes[i]}", "redis_store_refused", error=self._scrub(r)
                    )
        ok = outcomes == Outcome.OK
        self._counts["writes"] += int(ok.sum())
        self._counts["bytes_written"] += sum(
            len(_byte_view(p, writable=False)) for p, good in zip(payloads, ok, strict=True) if good
        )
        self._seconds["write"] += time.perf_counter() - start
        for o in outcomes[~ok]:
            name = Outcome(int(o)).name
            self._skipped[name] = self._skipped.get(name, 0) + 1
        return outcomes

    async def read(
        self, keys: Sequence[bytes], into: Sequence[BufferLike], *, timeout_s: float | None = None
    ) -> npt.NDArray[np.int8]:
        """Load ``keys[i]``'s chunk into ``into[i]`` (writable, contiguous, exactly the
        chunk's length), all in one pipeline, and verify each. One :class:`Outcome` per
        chunk: ``OK`` only when every check passed; else ``ABSENT``, ``CORRUPT``
        (counted by field, deleted), ``TIMEOUT``, ``IO_ERROR``, ``UNAVAILABLE``. After a
        miss ``into[i]`` holds nothing valid."""
        if len(keys) != len(into):
            raise ValueError(f"{len(keys)} keys for {len(into)} buffers")
        start = time.perf_counter()
        views = [_byte_view(b, writable=True) for b in into]
        rkeys = [self.redis_key(k) for k in keys]
        sink = _Sink(self, keys, rkeys, views)
        try:
            gets: list[tuple[Any, ...]]
            if self.streams_reads:
                gets = [("GET", _into(rk, sink.take(i))) for i, rk in enumerate(rkeys)]
            else:
                gets = [("GET", rk) for rk in rkeys]
            replies = await self._pipeline("read", gets, timeout_s)
        finally:
            sink.open = False
        outcomes = np.full(len(keys), Outcome.OK, dtype=np.int8)
        if isinstance(replies, Outcome):
            outcomes[:] = replies
            return outcomes
        corrupt: list[bytes] = []
        for i, value in enumerate(replies):
            if value is _VERIFIED:
                self._counts["reads"] += 1
                self._counts["bytes_read"] += len(views[i])
                continue
            if value is None:
                outcomes[i] = Outcome.ABSENT
                self._counts["absent"] += 1
                continue
            if not isinstance(value, (bytes, _Rejected)):  # an error reply
                outcomes[i] = Outcome.IO_ERROR
                self._log_once("read:reply", "redis_read_failed", error=self._scrub(str(value)))
                continue
            try:
                if isinstance(value, _Rejected):  # found as it was read
                    raise value.error
                self._decode_into(keys[i], rkeys[i], value, views[i])
            except ChunkCorrupt as exc:
                field = "auth" if isinstance(exc, _AuthFailed) else exc.field
                self._corrupt[field] = self._corrupt.get(field, 0) + 1
                self._log_once(
                    f"corrupt:{field}", "redis_chunk_corrupt", key=keys[i].hex(), error=str(exc)
                )
                outcomes[i] = Outcome.CORRUPT
                corrupt.append(rkeys[i])
                continue
            self._counts["reads"] += 1
            self._counts["bytes_read"] += len(views[i])
        self._seconds["read"] += time.perf_counter() - start
        if corrupt:
            # Deleted so that no engine trips over it again (and the key is free for a
            # good write), within what is left of the read's time; a failure here only
            # leaves it for the next reader.
            left = (self.op_timeout_s if timeout_s is None else timeout_s) - (
                time.perf_counter() - start
            )
            replies = await self._pipeline(
                "delete", [("DEL", rk) for rk in corrupt], max(left, 1e-3)
            )
            if not isinstance(replies, Outcome):
                self._counts["deleted"] += sum(r for r in replies if isinstance(r, int))
        return outcomes

    async def delete(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        """Remove the chunks of ``keys`` (one pipeline of DEL); how many were there (0
        when the store could not be reached: they expire by ``ttl_s`` or the server's
        eviction anyway)."""
        replies = await self._pipeline(
            "delete", [("DEL", self.redis_key(k)) for k in keys], timeout_s
        )
        if isinstance(replies, Outcome):
            return 0
        deleted = sum(r for r in replies if isinstance(r, int))
        self._counts["deleted"] += deleted
        return deleted

    # ---------------------------------------------------------------- state

    def _log_once(self, kind: str, event: str, **fields: Any) -> None:
        if kind in self._logged:
            self._log.debug(event, **fields)
            return
        self._logged.add(kind)
        self._log.warning(event, **fields, note="logged once; later ones are counted")

    def statistics(self) -> RedisStatistics:
        c = self._counts
        return RedisStatistics(
            reads=c["reads"],
            bytes_read=c["bytes_read"],
            read_seconds=self._seconds["read"],
            writes=c["writes"],
            bytes_written=c["bytes_written"],
            write_seconds=self._seconds["write"],
            absent=c["absent"],
            corrupt=sum(self._corrupt.values()),
            corrupt_by_field=tuple(sorted(self._corrupt.items())),
            writes_skipped=sum(self._skipped.values()),
            writes_skipped_by_outcome=tuple(sorted(self._skipped.items())),
            exists_checked=c["exists_checked"],
            exists_found=c["exists_found"],
            deleted=c["deleted"],
            timeouts=c["timeouts"],
            errors=c["errors"],
            breaker=self.breaker.statistics(),
        )


class _AuthFailed(ChunkCorrupt):
    """A sealed value that did not decrypt (counted as field ``"auth"``)."""

    def __init__(self) -> None:
        super().__init__("checksum", "the value does not decrypt with this key and Redis key")
