from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvferry.tiers import DiskStore, Fingerprint
from kvferry.tiers import _redis as redis_module

from .redis_servers import RedisServer

FP = Fingerprint(
    model="tiny-llama",
    dtype="bfloat16",
    layout="LBHNC",
    block_size=16,
    tp_rank=0,
    tp_world_size=1,
    block_hash_algorithm="sha256_cbor",
)


def key(i: int) -> bytes:
    """A key shaped like kvferry's: 32 bytes of block hash, 4 of group index."""
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def payload(i: int, nbytes: int = 3 * 4096 + 100) -> npt.NDArray[np.uint8]:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.fixture
def make_store(tmp_path: Path) -> Any:
    def make(**kwargs: Any) -> DiskStore:
        kwargs.setdefault("bytes_to_use", 64 << 20)
        kwargs.setdefault("fingerprint", FP)
        path = kwargs.pop("path", tmp_path / "disk")
        return DiskStore(path, **kwargs)

    return make


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The module's server, emptied."""
    redis_server.cli("flushall")
    return redis_server.url


@pytest.fixture
def streamed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The length of each reply a RedisStore streamed into its slot, in order."""
    calls: list[int] = []
    stream_in = redis_module._Target.stream_in

    async def counted(self: Any, stream: Any, n: int) -> Any:
        calls.append(n)
        return await stream_in(self, stream, n)

    monkeypatch.setattr(redis_module._Target, "stream_in", counted)
    yield calls
