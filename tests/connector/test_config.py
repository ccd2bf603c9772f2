"""A bad configuration fails when the connector is built (engine start), naming the key."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvferry import ConfigError, FerryConfig
from kvferry._config import available_host_bytes


def build(
    make_vllm_config: Any,
    kv_cache_config: Any,
    extra: dict[str, Any],
    role: str = "SCHEDULER",
    **kw: Any,
) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvferry.connector import KVFerryConnector

    return KVFerryConnector(make_vllm_config(extra, **kw), KVConnectorRole[role], kv_cache_config)


@pytest.mark.parametrize(
    ("extra", "key", "why"),
    [
        ({"cpu_bytes_to_use": 10**7, "cpu_byte_to_use": 1}, "cpu_byte_to_use", "unknown key"),
        ({}, "cpu_bytes_to_use", "is required"),
        ({"cpu_bytes_to_use": 0}, "cpu_bytes_to_use", "must be > 0"),
        ({"cpu_bytes_to_use": -5}, "cpu_bytes_to_use", "must be > 0"),
        ({"cpu_bytes_to_use": "lots"}, "cpu_bytes_to_use", "whole number"),
        ({"cpu_bytes_to_use": 1 << 60}, "cpu_bytes_to_use", "machine has only"),
        ({"cpu_bytes_to_use": 1000}, "cpu_bytes_to_use", "hold no offloaded block"),
        (
            {"cpu_bytes_to_use": 10**7, "block_size": 100},
            "block_size",
            "not a multiple of vLLM's block size",
        ),
        ({"cpu_bytes_to_use": 10**7, "block_size": 0}, "block_size", "must be > 0"),
        ({"cpu_bytes_to_use": 10**7, "runtime": "fast"}, "runtime", "must be one of"),
        (
            {"cpu_bytes_to_use": 10**7, "on_load_failure": "ignore"},
            "on_load_failure",
            "'recompute' or 'fail'",
        ),
        (
            {"cpu_bytes_to_use": 10**7, "copy_engine": "no.such.module:f"},
            "copy_engine",
            "cannot import",
        ),
        ({"cpu_bytes_to_use": 10**7, "eviction_policy": "fifo"}, "eviction_policy", "fifo"),
        (
            {"cpu_bytes_to_use": 10**7, "eviction_watermarks": [0.9, 0.5]},
            "eviction_watermarks",
            "low <= high",
        ),
        ({"cpu_bytes_to_use": 10**7, "store_threshold": 0}, "store_threshold", ">= 1"),
        ({"cpu_bytes_to_use": 10**7, "traces": {"otlp": 5}}, "traces", "otlp"),
        ({"cpu_bytes_to_use": 10**7, "store_decoded": "no"}, "store_decoded", "true or false"),
        (
            {
                "cpu_bytes_to_use": 10**7,
                "tiers": [{"kind": "disk", "path": "/tmp", "bytes_to_use": 1, "write": "back"}],
            },
            "tiers[0]",  # the check compares the key's first part: tiers[0].write
            "'tiers\\[0\\].write': must be 'through' or 'on_evict'",
        ),
    ],
)
@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_bad_config_names_the_key(
    make_vllm_config: Any,
    kv_cache_config: Any,
    extra: dict[str, Any],
    key: str,
    why: str,
    role: str,
) -> None:
    with pytest.raises(ConfigError, match=why) as info:
        build(make_vllm_config, kv_cache_config, extra, role)
    assert info.value.key.split(".")[0] == key
    assert f"'{info.value.key}'" in str(info.value)


def test_good_config_builds_both_halves(make_vllm_config: Any, kv_cache_config: Any) -> None:
    extra = {"cpu_bytes_to_use": 10**7, "block_size": 256}
    scheduler = build(make_vllm_config, kv_cache_config, extra)
    try:
        stats = scheduler.statistics()
        # 2 layers x 64 KiB per engine block, 2 engine blocks per offloaded block
        assert stats.directory.capacity == 10**7 // (2 * 65536 * 2)
    finally:
        scheduler.shutdown()
    worker = build(make_vllm_config, kv_cache_config, extra, "WORKER")
    worker.shutdown()


@pytest.mark.parametrize(
    ("vllm_policy", "ours", "level"),
    [
        ("fail", "recompute", "INFO"),  # vLLM's default replaced: noted
        ("recompute", "fail", "WARNING"),  # the user's own value replaced: warned
        ("fail", "fail", None),  # nothing replaced: nothing said
    ],
)
def test_replacing_vllms_load_failure_policy_is_said(
    make_vllm_config: Any,
    kv_cache_config: Any,
    caplog: pytest.LogCaptureFixture,
    vllm_policy: str,
    ours: str,
    level: str | None,
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvferry.connector import KVFerryConnector

    config = make_vllm_config({"cpu_bytes_to_use": 10**7, "on_load_failure": ours})
    config.kv_transfer_config.kv_load_failure_policy = vllm_policy
    caplog.set_level("INFO", logger="kvferry.connector")
    scheduler = KVFerryConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    scheduler.shutdown()
    assert config.kv_transfer_config.kv_load_failure_policy == ours
    said = [r for r in caplog.records if "kv_load_failure_policy_replaced" in r.getMessage()]
    assert [r.levelname for r in said] == ([level] if level else [])
    if level:
        message = said[0].getMessage()
        assert f"was='{vllm_policy}'" in message and f"now='{ours}'" in message


def test_cpu_bytes_is_checked_against_available_memory() -> None:
    too_much = available_host_bytes() * 2
    with pytest.raises(ConfigError, match="cpu_bytes_to_use"):
        FerryConfig.from_dict({"cpu_bytes_to_use": too_much})


def test_a_tier_written_on_eviction_keeps_host_room_free_unless_told_otherwise() -> None:
    disk = {"kind": "disk", "path": "/tmp", "bytes_to_use": 1 << 30}
    through = FerryConfig.from_dict({"cpu_bytes_to_use": 10**7, "tiers": [disk]})
    on_evict = FerryConfig.from_dict(
        {"cpu_bytes_to_use": 10**7, "tiers": [{**disk, "write": "on_evict"}]}
    )
    told = FerryConfig.from_dict(
        {
            "cpu_bytes_to_use": 10**7,
            "tiers": [{**disk, "write": "on_evict"}],
            "eviction_watermarks": [1.0, 1.0],
        }
    )
    assert through.eviction_watermarks == (1.0, 1.0)
    assert on_evict.tiers[0].write == "on_evict" and on_evict.eviction_watermarks == (0.9, 0.95)
    assert told.eviction_watermarks == (1.0, 1.0)


REDIS = {"kind": "redis", "url": "redis://127.0.0.1:6379/0"}
DISK = {"kind": "disk", "path": "/tmp/kvferry-cfg", "bytes_to_use": 1 << 30}


@pytest.mark.parametrize(
    ("tiers", "key", "why"),
    [
        ([{"kind": "s3"}], "tiers[0].kind", "'disk' or 'redis'"),
        ([{"kind": "redis"}], "tiers[0].url", "either url or cluster"),
        ([{**REDIS, "cluster": ["redis://a:1"]}], "tiers[0].url", "either url or cluster"),
        ([{"kind": "redis", "cluster": "redis://a:1"}], "tiers[0].cluster", "non-empty list"),
        ([{**REDIS, "ttl_s": 0}], "tiers[0].ttl_s", "must be > 0"),
        ([{**REDIS, "lookup_wait_ms": -1}], "tiers[0].lookup_wait_ms", ">= 0"),
        ([{**REDIS, "op_timeout_s": 0}], "tiers[0].op_timeout_s", "> 0"),
        ([{**REDIS, "encrypt_key": 7}], "tiers[0].encrypt_key", "hex string"),
        ([{**REDIS, "max_queued_writes": -1}], "tiers[0].max_queued_writes", ">= 0"),
        ([{**REDIS, "breaker_threshold": 0}], "tiers[0].breaker_threshold", "> 0"),
        ([{**REDIS, "urls": "x"}], "tiers[0].urls", "unknown key"),
        ([REDIS, DISK], "tiers[1]", "disk tier comes before the redis tier"),
        ([DISK, DISK], "tiers[1]", "at most one disk tier and one redis tier"),
        ([DISK, REDIS, REDIS], "tiers[2]", "at most one disk tier and one redis tier"),
    ],
)
def test_a_bad_tiers_entry_names_its_key(tiers: list[Any], key: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as info:
        FerryConfig.from_dict({"cpu_bytes_to_use": 10**7, "tiers": tiers})
    assert info.value.key == key


def test_a_disk_and_a_redis_tier_parse_in_that_order() -> None:
    cfg = FerryConfig.from_dict(
        {"cpu_bytes_to_use": 10**7, "tiers": [DISK, {**REDIS, "lookup_wait_ms": 0}]}
    )
    assert [t.kind for t in cfg.tiers] == ["disk", "redis"]
    assert cfg.tiers[1].index == 1 and cfg.tiers[1].lookup_wait_ms == 0.0


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"cpu_bytes_to_use": math.inf}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": math.nan}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 10**7, "block_size": math.inf}, "block_size"),
        (
            {"cpu_bytes_to_use": 10**7, "store_threshold_tracker_size": -math.inf},
            "store_threshold_tracker_size",
        ),
        ({"cpu_bytes_to_use": 10**7, "tiers": [{**DISK, "bytes_to_use": math.nan}]},
         "tiers[0].bytes_to_use"),
    ],
)  # fmt: skip
def test_an_infinite_or_nan_whole_number_names_its_key(extra: dict[str, Any], key: str) -> None:
    # json.loads reads Infinity and NaN; int() of them raises naming no key.
    with pytest.raises(ConfigError, match="must be a whole number") as info:
        FerryConfig.from_dict(extra)
    assert info.value.key == key


@pytest.mark.parametrize("value", [math.nan, math.inf, 10**400], ids=["nan", "inf", "10**400"])
@pytest.mark.parametrize(
    ("name", "tier"),
    [
        ("job_timeout_s", None),
        ("op_timeout_s", REDIS),
        ("connect_timeout_s", REDIS),
        ("lookup_wait_ms", REDIS),
        ("breaker_cooldown_s", REDIS),
        ("scan_budget_s", DISK),
    ],
)
def test_a_duration_must_be_finite(name: str, tier: dict[str, Any] | None, value: float) -> None:
    # NaN passed the range checks (NaN <= 0 is false): a deadline of now + NaN never
    # passes. No key documents infinity as "never" (ttl_s says so with null).
    extra = {name: value} if tier is None else {"tiers": [{**tier, name: value}]}
    with pytest.raises(ConfigError, match="must be a finite number") as info:
        FerryConfig.from_dict({"cpu_bytes_to_use": 10**7, **extra})
    assert info.value.key == (name if tier is None else f"tiers[0].{name}")


@pytest.mark.parametrize(
    ("entry", "key", "why"),
    [
        ({"url": "http://127.0.0.1:6379"}, "tiers[0].url", "redis://"),
        ({"url": "redis://127.0.0.1:notaport"}, "tiers[0].url", "does not parse"),
        ({"url": "redis://"}, "tiers[0].url", "redis://"),
        ({"cluster": ["redis://a:7000", "ftp://b"]}, "tiers[0].cluster", "redis://"),
        ({**REDIS, "encrypt_key": "zz"}, "tiers[0].encrypt_key", "hex string"),
        ({**REDIS, "encrypt_key": "00" * 5}, "tiers[0].encrypt_key", "16, 24 or 32 bytes, got 5"),
    ],
)
def test_a_redis_url_or_key_is_checked_when_parsed_not_only_at_engine_start(
    entry: dict[str, Any], key: str, why: str
) -> None:
    # The same checks RedisStore makes when it is built: no server, no redis package.
    with pytest.raises(ConfigError, match=why) as info:
        FerryConfig.from_dict({"cpu_bytes_to_use": 10**7, "tiers": [{"kind": "redis", **entry}]})
    assert info.value.key == key


def test_a_good_encrypt_key_and_cluster_parse() -> None:
    tier = {"kind": "redis", "cluster": ["redis://a:7000", "rediss://u:p@b"]}
    cfg = FerryConfig.from_dict(
        {"cpu_bytes_to_use": 10**7, "tiers": [{**tier, "encrypt_key": "ab" * 32}]}
    )
    assert cfg.tiers[0].encrypt_key == "ab" * 32
