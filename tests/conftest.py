from __future__ import annotations

from collections.abc import Iterator

import pytest

from .tiers.redis_servers import RedisServer


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: run `pytest -m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real redis-server for the module's tests (those of the Redis tier flush it)."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.kill()
