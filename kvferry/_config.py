"""kvferry's configuration: the keys of ``kv_connector_extra_config``, validated.

Every error names the key at fault (:class:`~kvferry.ConfigError`). Validation that needs
vLLM's numbers (its block size) takes them as arguments, so this module imports no vLLM.
"""

from __future__ import annotations

import importlib
import math
import os
import urllib.parse
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from ._errors import ConfigError

RuntimeKind = Literal["auto", "stepped", "thread"]
_RUNTIMES: tuple[str, ...] = ("auto", "stepped", "thread")


def available_host_bytes() -> int:
    """Bytes of host memory the machine can still give (``MemAvailable``)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def load_object(key: str, path: Any) -> Any:
    """Import ``"package.module:name"``; a :class:`ConfigError` naming ``key`` if it fails."""
    if not isinstance(path, str) or path.count(":") != 1:
        raise ConfigError(key, f"must be an import path 'package.module:name', got {path!r}")
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(key, f"cannot import module {module_name!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(key, f"module {module_name!r} has no {attr!r}") from None


def _positive_int(key: str, value: Any) -> int:
    # json.loads reads Infinity and NaN: int() of either would raise naming no key.
    whole = isinstance(value, int) or (
        isinstance(value, float) and math.isfinite(value) and value.is_integer()
    )
    if isinstance(value, bool) or not whole:
        raise ConfigError(key, f"must be a whole number, got {value!r}")
    if value <= 0:
        raise ConfigError(key, f"must be > 0, got {value!r}")
    return int(value)


def _finite(value: Any) -> float | None:
    """``value`` as a float if it is a finite number, else None (json.loads reads
    Infinity and NaN; NaN compares false with everything, so a range check lets it by)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        return None
    return number if math.isfinite(number) else None


def _positive_float(key: str, value: Any) -> float:
    number = _finite(value)
    if number is None or number <= 0:
        raise ConfigError(key, f"must be a finite number > 0, got {value!r}")
    return number


def _non_negative_float(key: str, value: Any) -> float:
    number = _finite(value)
    if number is None or number < 0:
        raise ConfigError(key, f"must be a finite number >= 0, got {value!r}")
    return number


_REDIS_SCHEMES = ("redis", "rediss")
_AES_KEY_BYTES = (16, 24, 32)


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for errors and logs)."""
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.password is None:
            return url
        userinfo, _, hostport = parts.netloc.rpartition("@")
        netloc = f"{userinfo.split(':', 1)[0]}:***@{hostport}"  # the host as written
        return urllib.parse.urlunsplit(
            (parts.scheme, netloc, parts.path, parts.query, parts.fragment)
        )
    except ValueError:
        return "<a URL that does not parse; not shown, it may hold a password>"


def parse_redis_url(url: object, key: str) -> urllib.parse.SplitResult:
    """``url`` split, if it is a ``redis://`` or ``rediss://`` URL with a host (and a
    port, if any, that is a number); else a :class:`ConfigError` naming ``key``.

    The check the Redis tier makes when it is built, here so that the configuration's
    parse (and ``kvferry check-config``) makes it too, with no ``redis`` package.
    """
    if not isinstance(url, str):
        raise ConfigError(key, f"must be a redis:// or rediss:// URL, got {type(url).__name__}")
    try:
        parts = urllib.parse.urlsplit(url)
        _ = parts.port  # parsed on access: a ValueError if it is not a number
    except ValueError as exc:
        raise ConfigError(key, f"{redact_url(url)} does not parse: {exc}") from None
    if parts.scheme not in _REDIS_SCHEMES or not parts.hostname:
        raise ConfigError(
            key,
            "must be a redis://[user:password@]host[:port][/db] or rediss:// URL, "
            f"got {redact_url(url)}",
        )
    return parts


def encrypt_key_bytes(encrypt_key: bytes | str | None, key: str) -> bytes | None:
    """The AES key of ``encrypt_key`` (hex, or bytes), or None without one; a
    :class:`ConfigError` naming ``key`` unless it is 16, 24 or 32 bytes."""
    if encrypt_key is None:
        return None
    if isinstance(encrypt_key, str):
        try:
            raw = bytes.fromhex(encrypt_key)
        except ValueError:
            raise ConfigError(key, "must be a hex string of 16, 24 or 32 bytes") from None
    else:
        raw = bytes(encrypt_key)
    if len(raw) not in _AES_KEY_BYTES:
        raise ConfigError(key, f"must be an AES key of 16, 24 or 32 bytes, got {len(raw)}")
    return raw


ON_EVICT_WATERMARKS = (0.9, 0.95)
"""``eviction_watermarks`` unless set, with a tier written on eviction (``on_evict``)."""


@attrs.frozen(kw_only=True)
class DiskTierConfig:
    """One ``{"kind": "disk", ...}`` entry of ``tiers``: a local directory of chunk files."""

    index: int
    """Its place in ``tiers`` (errors name ``tiers[index].<key>``)."""
    path: str
    bytes_to_use: int
    """Bytes of files for the tier, in total across all workers of the engine."""
    write: Literal["through", "on_evict"] = "through"
    """"through": every block stored to host memory is written down in the background;
    "on_evict": a block is written down when host memory evicts it (its host slot is
    freed once the write ended), so blocks re-used while in host memory never reach
    the disk."""
    eviction_policy: str = "lru"
    store_threshold: int = 1
    """Write a block only once it was offered this many times (limits an SSD's wear)."""
    fsync: Literal["never", "always"] = "never"
    io_depth: int = 2
    """Worker threads doing the tier's file I/O, per worker."""
    scan_budget_s: float = 60.0
    """At start, the index is rebuilt from the files within this many seconds."""
    kind: Literal["disk"] = "disk"

    KEYS = (
        "kind",
        "path",
        "bytes_to_use",
        "write",
        "eviction_policy",
        "store_threshold",
        "fsync",
        "io_depth",
        "scan_budget_s",
    )


@attrs.frozen(kw_only=True)
class RedisTierConfig:
    """One ``{"kind": "redis", ...}`` entry of ``tiers``: chunks shared through a Redis
    server (``url``) or a Redis Cluster (``cluster``) by every engine of one fingerprint."""

    index: int
    url: str | None = None
    """``redis://[user:password@]host:port/db`` (``rediss://`` for TLS)."""
    cluster: tuple[str, ...] | None = None
    """URLs of any of a Redis Cluster's nodes (user, password, TLS from the first)."""
    ttl_s: int | None = 24 * 3600
    """Each chunk expires this long after its write (None: never)."""
    lookup_wait_ms: float = 50.0
    """How long a lookup may say "ask again" while the tier's existence check is out;
    then chunks not yet answered for are misses."""
    op_timeout_s: float = 1.0
    """Bound on every Redis operation (a pipeline of a batch)."""
    connect_timeout_s: float = 5.0
    """Bound on the first connection, at engine start."""
    encrypt_key: str | None = None
    """AES-GCM key (hex of 16, 24 or 32 bytes): values sealed at rest."""
    io_depth: int = 4
    """Batches in flight at once, per worker."""
    max_queued_writes: int = 256
    """Writes queued per worker beyond which stores are dropped (counted), never waited for."""
    breaker_threshold: int = 5
    """Consecutive failed operations that open the circuit breaker."""
    breaker_cooldown_s: float = 5.0
    """How long an open breaker stops sending before it probes the server again."""
    bytes_to_use: int | None = None
    """Informational: the server's ``maxmemory`` decides what Redis keeps."""
    kind: Literal["redis"] = "redis"

    KEYS = (
        "kind",
        "url",
        "cluster",
        "ttl_s",
        "lookup_wait_ms",
        "op_timeout_s",
        "connect_timeout_s",
        "encrypt_key",
        "io_depth",
        "max_queued_writes",
        "breaker_threshold",
        "breaker_cooldown_s",
        "bytes_to_use",
    )

    @property
    def write(self) -> Literal["through"]:
        """Every block stored to host memory is written to Redis in the background."""
        return "through"


TierConfig = DiskTierConfig | RedisTierConfig


def _parse_redis(i: int, entry: Mapping[str, Any]) -> RedisTierConfig:
    name = f"tiers[{i}]"
    unknown = sorted(set(entry) - set(RedisTierConfig.KEYS))
    if unknown:
        raise ConfigError(
            f"{name}.{unknown[0]}",
            f"unknown key (known keys: {', '.join(RedisTierConfig.KEYS)})",
        )
    url, cluster = entry.get("url"), entry.get("cluster")
    if (url is None) == (cluster is None):
        raise ConfigError(f"{name}.url", "give either url or cluster (a list of URLs), not both")
    if url is not None and (not isinstance(url, str) or not url):
        raise ConfigError(f"{name}.url", "must be a redis:// or rediss:// URL")
    if url is not None:
        parse_redis_url(url, f"{name}.url")
    nodes: tuple[str, ...] | None = None
    if cluster is not None:
        if isinstance(cluster, str) or not isinstance(cluster, list | tuple) or not cluster:
            raise ConfigError(f"{name}.cluster", "must be a non-empty list of redis:// URLs")
        if not all(isinstance(u, str) and u for u in cluster):
            raise ConfigError(f"{name}.cluster", "must be a non-empty list of redis:// URLs")
        for node in cluster:
            parse_redis_url(node, f"{name}.cluster")
        nodes = tuple(cluster)
    ttl = entry.get("ttl_s", 24 * 3600)
    if ttl is not None:
        ttl = _positive_int(f"{name}.ttl_s", ttl)
    key = entry.get("encrypt_key")
    if key is not None and not isinstance(key, str):
        raise ConfigError(f"{name}.encrypt_key", "must be a hex string of 16, 24 or 32 bytes")
    encrypt_key_bytes(key, f"{name}.encrypt_key")
    size = entry.get("bytes_to_use")
    if size is not None:
        size = _positive_int(f"{name}.bytes_to_use", size)
    queued = entry.get("max_queued_writes", 256)
    if isinstance(queued, bool) or not isinstance(queued, int) or queued < 0:
        raise ConfigError(
            f"{name}.max_queued_writes", f"must be a whole number >= 0, got {queued!r}"
        )
    return RedisTierConfig(
        index=i,
        url=url,
        cluster=nodes,
        ttl_s=ttl,
        lookup_wait_ms=_non_negative_float(
            f"{name}.lookup_wait_ms", entry.get("lookup_wait_ms", 50.0)
        ),
        op_timeout_s=_positive_float(f"{name}.op_timeout_s", entry.get("op_timeout_s", 1.0)),
        connect_timeout_s=_positive_float(
            f"{name}.connect_timeout_s", entry.get("connect_timeout_s", 5.0)
        ),
        encrypt_key=key,
        io_depth=_positive_int(f"{name}.io_depth", entry.get("io_depth", 4)),
        max_queued_writes=queued,
        breaker_threshold=_positive_int(
            f"{name}.breaker_threshold", entry.get("breaker_threshold", 5)
        ),
        breaker_cooldown_s=_non_negative_float(
            f"{name}.breaker_cooldown_s", entry.get("breaker_cooldown_s", 5.0)
        ),
        bytes_to_use=size,
    )


def parse_tiers(value: Any) -> tuple[TierConfig, ...]:
    """``tiers``: a list of dicts; every error names ``tiers[i].<key>``.

    ``path`` is checked here for its type only: whether it can be written is found when
    the tier opens it, at engine start (:class:`~kvferry.tiers.DiskStore`), naming the key.
    """
    from .cache import check_store_threshold, make_policy

    if isinstance(value, Mapping) or isinstance(value, str | bytes):
        raise ConfigError("tiers", f"must be a list of tier dicts, got {value!r}")
    try:
        entries = list(value)
    except TypeError:
        raise ConfigError("tiers", f"must be a list of tier dicts, got {value!r}") from None
    out: list[TierConfig] = []
    for i, entry in enumerate(entries):
        name = f"tiers[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(name, f"must be a dict, got {entry!r}")
        kind = entry.get("kind")
        if kind == "redis":
            out.append(_parse_redis(i, entry))
            continue
        if kind != "disk":
            raise ConfigError(
                f"{name}.kind", f"must be 'disk' or 'redis' (the kinds known), got {kind!r}"
            )
        unknown = sorted(set(entry) - set(DiskTierConfig.KEYS))
        if unknown:
            raise ConfigError(
                f"{name}.{unknown[0]}",
                f"unknown key (known keys: {', '.join(DiskTierConfig.KEYS)})",
            )
        path = entry.get("path")
        if not isinstance(path, str | os.PathLike) or not os.fspath(path):
            raise ConfigError(f"{name}.path", f"must be a directory path, got {path!r}")
        if "bytes_to_use" not in entry:
            raise ConfigError(f"{name}.bytes_to_use", "is required (bytes of files to use)")
        size = _positive_int(f"{name}.bytes_to_use", entry["bytes_to_use"])
        write = entry.get("write", "through")
        if write not in ("through", "on_evict"):
            raise ConfigError(f"{name}.write", f"must be 'through' or 'on_evict', got {write!r}")
        policy = entry.get("eviction_policy", "lru")
        if not isinstance(policy, str):
            raise ConfigError(
                f"{name}.eviction_policy", f"must be a name or an import path, got {policy!r}"
            )
        try:
            make_policy(policy, 1)
        except ConfigError as exc:
            raise ConfigError(f"{name}.eviction_policy", exc.detail) from None
        try:
            threshold = check_store_threshold(entry.get("store_threshold", 1))
        except ConfigError as exc:
            raise ConfigError(f"{name}.store_threshold", exc.detail) from None
        fsync = entry.get("fsync", "never")
        if fsync not in ("never", "always"):
            raise ConfigError(f"{name}.fsync", f"must be 'never' or 'always', got {fsync!r}")
        io_depth = _positive_int(f"{name}.io_depth", entry.get("io_depth", 2))
        budget = _positive_float(f"{name}.scan_budget_s", entry.get("scan_budget_s", 60.0))
        out.append(
            DiskTierConfig(
                index=i,
                path=os.fspath(path),
                bytes_to_use=size,
                write=write,
                eviction_policy=policy,
                store_threshold=threshold,
                fsync=fsync,
                io_depth=io_depth,
                scan_budget_s=budget,
            )
        )
    kinds = [t.kind for t in out]
    if len(out) > 2 or len(set(kinds)) != len(kinds):
        raise ConfigError(
            f"tiers[{len(out) - 1}]",
            f"at most one disk tier and one redis tier, got kinds {kinds}",
        )
    if kinds == ["redis", "disk"]:
        raise ConfigError(
            "tiers[1]", "the disk tier comes before the redis tier (host, disk, then redis)"
        )
    return tuple(out)


@attrs.frozen(kw_only=True)
class FerryConfig:
    """What a user sets in ``kv_connector_extra_config`` (or passes to :class:`Ferry`)."""

    cpu_bytes_to_use: int
    """Bytes of host memory for the host tier, in total across all workers of the engine."""
    block_size: int | None = None
    """Tokens per offloaded block; a multiple of the engine's block size (default: equal)."""
    runtime: RuntimeKind = "auto"
    """How the sync facade drives its actors: stepped on the engine thread, or a loop thread."""
    job_timeout_s: float = 60.0
    """Deadline for waiting on a transfer job (flushes before blocks are reused)."""
    on_load_failure: Literal["recompute", "fail"] = "recompute"
    """What vLLM does with a request whose load failed: recompute its blocks, or fail it."""
    copy_engine: str | None = None
    """Import path ``"package.module:factory"`` of a copy engine factory(layout, pool)."""
    eviction_policy: str = "lru"
    """"lru", "arc", "s3fifo", or a user policy ``"package.module:Class"``."""
    eviction_watermarks: tuple[float, float] = (1.0, 1.0)
    """(low, high) occupancy between which the evictor keeps the host tier."""
    store_threshold: int = 1
    """Store a block only once it was offered this many times (1: store at once)."""
    store_threshold_tracker_size: int = 64_000
    """How many not-yet-admitted keys the admission filter remembers."""
    traces: Mapping[str, Any] | None = None
    """OpenTelemetry traces (see docs/tracing.md); off unless set or asked by ``OTEL_*``."""
    store_decoded: bool = True
    """Store blocks of generated tokens too (a conversation's next turn reuses them);
    False stores prompt blocks only, as vLLM's OffloadingConnector does by default."""
    tiers: tuple[TierConfig, ...] = ()
    """Tiers below host memory, in order: a ``"disk"``, a ``"redis"``, or both (disk first)."""

    KEYS = (
        "cpu_bytes_to_use",
        "block_size",
        "runtime",
        "job_timeout_s",
        "on_load_failure",
        "copy_engine",
        "eviction_policy",
        "eviction_watermarks",
        "store_threshold",
        "store_threshold_tracker_size",
        "traces",
        "store_decoded",
        "tiers",
    )

    @classmethod
    def from_dict(cls, extra: Mapping[str, Any] | None) -> FerryConfig:
        """Parse and validate ``kv_connector_extra_config``.

        Raises :class:`ConfigError` naming the key for an unknown key, a missing
        ``cpu_bytes_to_use``, or a value out of range.
        """
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(cls.KEYS))
        if unknown:
            raise ConfigError(unknown[0], f"unknown key (known keys: {', '.join(cls.KEYS)})")
        if "cpu_bytes_to_use" not in extra:
            raise ConfigError("cpu_bytes_to_use", "is required (bytes of host memory to use)")
        cpu_bytes = _positive_int("cpu_bytes_to_use", extra["cpu_bytes_to_use"])
        available = available_host_bytes()
        if cpu_bytes > available:
            raise ConfigError(
                "cpu_bytes_to_use",
                f"{cpu_bytes} bytes asked, but the machine has only {available} bytes available",
            )
        block_size = extra.get("block_size")
        if block_size is not None:
            block_size = _positive_int("block_size", block_size)
        runtime = extra.get("runtime", "auto")
        if runtime not in _RUNTIMES:
            raise ConfigError("runtime", f"must be one of {_RUNTIMES}, got {runtime!r}")
        timeout = _positive_float("job_timeout_s", extra.get("job_timeout_s", 60.0))
        on_load_failure = extra.get("on_load_failure", "recompute")
        if on_load_failure not in ("recompute", "fail"):
            raise ConfigError(
                "on_load_failure", f"must be 'recompute' or 'fail', got {on_load_failure!r}"
            )
        copy_engine = extra.get("copy_engine")
        if copy_engine is not None:
            load_object("copy_engine", copy_engine)
        from .cache import check_store_threshold, check_watermarks, make_policy

        policy = extra.get("eviction_policy", "lru")
        if not isinstance(policy, str):
            raise ConfigError(
                "eviction_policy", f"must be a name or an import path, got {policy!r}"
            )
        make_policy(policy, 1)  # raises a ConfigError naming eviction_policy
        tiers = parse_tiers(extra.get("tiers", ()))
        if runtime == "stepped" and any(isinstance(t, RedisTierConfig) for t in tiers):
            # The stepped runtime runs its loop only inside the engine's calls: a socket
            # would make no progress between steps.
            raise ConfigError(
                "runtime",
                "a redis tier needs the loop-thread runtime ('thread' or 'auto'), got 'stepped'",
            )
        # Written down on eviction, an evicted block frees its host slot only once its
        # write ended: the evictor keeps room free ahead of the stores that need it.
        on_evict = any(t.write == "on_evict" for t in tiers)
        default_marks = ON_EVICT_WATERMARKS if on_evict else (1.0, 1.0)
        watermarks = check_watermarks(extra.get("eviction_watermarks", default_marks))
        threshold = check_store_threshold(extra.get("store_threshold", 1))
        tracker = _positive_int(
            "store_threshold_tracker_size", extra.get("store_threshold_tracker_size", 64_000)
        )
        store_decoded = extra.get("store_decoded", True)
        if not isinstance(store_decoded, bool):
            raise ConfigError("store_decoded", f"must be true or false, got {store_decoded!r}")
        traces = extra.get("traces")
        if traces is not None:
            from .traces import resolve_config

            if not isinstance(traces, Mapping):
                raise ConfigError("traces", f"must be a dict of trace settings, got {traces!r}")
            resolve_config(traces)  # raises a ConfigError naming the bad traces.<key>
        return cls(
            tiers=tiers,
            cpu_bytes_to_use=cpu_bytes,
            eviction_policy=policy,
            eviction_watermarks=watermarks,
            store_threshold=threshold,
            store_threshold_tracker_size=tracker,
            traces=traces,
            block_size=block_size,
            runtime=runtime,
            job_timeout_s=timeout,
            on_load_failure=on_load_failure,
            copy_engine=copy_engine,
            store_decoded=store_decoded,
        )

    def blocks_per_chunk(self, engine_block_size: int) -> int:
        """Engine blocks per offloaded block; checks that ``block_size`` is a multiple."""
        if self.block_size is None:
            return 1
        if self.block_size % engine_block_size:
            raise ConfigError(
                "block_size",
                f"{self.block_size} tokens is not a multiple of vLLM's block size "
                f"({engine_block_size} tokens)",
            )
        return self.block_size // engine_block_size
