"""The shared Redis tier's own cost: chunk writes and reads through RedisStore against raw
pipelined SET / GET of values of the same size, with the same client, on the same server.

What kvferry adds on top of the raw commands: the compact chunk header, an xxh3 checksum
of every payload on write and on read, the header's verification, and the copy of each
payload into its host slot (a raw GET leaves the value in a bytes object). The figures
(``*_vs_raw`` = kvferry GB/s / raw GB/s, the lower of the chunk sizes; target >= 0.8):

- ``redis_write_vs_raw``, ``redis_read_vs_raw``: one ``redis-server`` on loopback;
- ``cluster_write_vs_raw``, ``cluster_read_vs_raw``: a 3-master Redis Cluster on loopback.

Both start their own ``redis-server`` processes (Debian's package; ``make bench``
installs it when missing), nothing persisted. Each trial moves ``TRIAL_BYTES`` per
direction in pipelines of ``BATCH_BYTES`` (the Redis actor's batch), raw and kvferry
alternating so that both see the same machine; a figure is the median of the trials.
The last line printed is one JSON object of every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' server helpers

from kvferry.tiers import Fingerprint, Outcome, RedisStore  # noqa: E402
from tests.tiers.redis_servers import RedisClusterProcs, RedisServer  # noqa: E402

SIZES = (256 << 10, 2 << 20)
TRIAL_BYTES = 64 << 20
BATCH_BYTES = 8 << 20
TRIALS = 5
FP = Fingerprint(
    model="bench",
    dtype="bfloat16",
    layout="LBHNC",
    block_size=16,
    tp_rank=0,
    tp_world_size=1,
    block_hash_algorithm="sha256_cbor",
)


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


async def _timed(fn: Callable[[], Awaitable[None]]) -> float:
    start = time.perf_counter()
    await fn()
    return time.perf_counter() - start


async def _measure(store: RedisStore, size: int, trials: int) -> dict[str, float]:
    """GB/s of each of the four ways, median over the trials."""
    client = store.client
    count = TRIAL_BYTES // size
    per_batch = max(1, BATCH_BYTES // size)
    rng = np.random.default_rng(0)
    slots = rng.integers(0, 256, (count, size), dtype=np.uint8)
    into = np.zeros_like(slots)
    raw_values = [slots[i].tobytes() for i in range(count)]
    keys = [_key(i) for i in range(count)]
    raw_keys = [b"raw:" + k.hex().encode() for k in keys]
    batches = [range(b, min(b + per_batch, count)) for b in range(0, count, per_batch)]
    ttl = store.ttl_s

    async def raw_write() -> None:
        for batch in batches:
            pipe = client.pipeline(transaction=False)
            for i in batch:
                pipe.set(raw_keys[i], raw_values[i], ex=ttl)
            await pipe.execute()

    async def raw_read() -> None:
        for batch in batches:
            pipe = client.pipeline(transaction=False)
            for i in batch:
                pipe.get(raw_keys[i])
            got = await pipe.execute()
            assert all(len(v) == size for v in got)

    async def kv_write() -> None:
        for batch in batches:
            outcomes = await store.write([keys[i] for i in batch], [slots[i] for i in batch])
            assert (outcomes == Outcome.OK).all(), outcomes

    async def kv_read() -> None:
        for batch in batches:
            outcomes = await store.read([keys[i] for i in batch], [into[i] for i in batch])
            assert (outcomes == Outcome.OK).all(), outcomes

    seconds: dict[str, list[float]] = {
        "raw_write": [],
        "kv_write": [],
        "raw_read": [],
        "kv_read": [],
    }
    for _ in range(trials):
        seconds["raw_write"].append(await _timed(raw_write))
        seconds["kv_write"].append(await _timed(kv_write))
        seconds["raw_read"].append(await _timed(raw_read))
        seconds["kv_read"].append(await _timed(kv_read))
    assert np.array_equal(into, slots)
    await store.delete(keys)
    pipe = client.pipeline(transaction=False)
    for k in raw_keys:
        pipe.delete(k)
    await pipe.execute()
    return {name: count * size / statistics.median(s) / 1e9 for name, s in seconds.items()}


async def _run(label: str, store: RedisStore, trials: int) -> dict[str, Any]:
    await store.connect()
    rows: dict[str, Any] = {}
    try:
        for size in SIZES:
            gbs = await _measure(store, size, trials)
            rows[size] = gbs
            print(
                f"{label:8} {size >> 10:5} KiB  "
                f"write raw {gbs['raw_write']:6.2f} kvferry {gbs['kv_write']:6.2f} GB/s "
                f"({gbs['kv_write'] / gbs['raw_write']:.2f})  "
                f"read raw {gbs['raw_read']:6.2f} kvferry {gbs['kv_read']:6.2f} GB/s "
                f"({gbs['kv_read'] / gbs['raw_read']:.2f})",
                flush=True,
            )
    finally:
        await store.aclose()
    out: dict[str, Any] = {}
    for direction in ("write", "read"):
        ratios = {s: g[f"kv_{direction}"] / g[f"raw_{direction}"] for s, g in rows.items()}
        out[f"{label}_{direction}_vs_raw"] = round(min(ratios.values()), 3)
        for s, g in rows.items():
            out[f"{label}_{direction}_gbps_{s >> 10}k"] = round(g[f"kv_{direction}"], 3)
            out[f"{label}_{direction}_raw_gbps_{s >> 10}k"] = round(g[f"raw_{direction}"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=TRIALS)
    args = parser.parse_args()
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvferry-bench-redis-") as tmp:
        server = RedisServer(Path(tmp) / "single")
        cluster = RedisClusterProcs(Path(tmp) / "cluster")
        try:
            server.start()
            store = RedisStore(url=server.url, fingerprint=FP, op_timeout_s=30)
            result |= anyio.run(_run, "redis", store, args.trials)
            server.kill()
            cluster.start()
            cstore = RedisStore(cluster=cluster.urls, fingerprint=FP, op_timeout_s=30)
            result |= anyio.run(_run, "cluster", cstore, args.trials)
        finally:
            server.kill()
            cluster.stop()
    result["trial_bytes"] = TRIAL_BYTES
    result["batch_bytes"] = BATCH_BYTES
    print(json.dumps(result))


if __name__ == "__main__":
    main()
