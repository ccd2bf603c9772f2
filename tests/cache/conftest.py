from __future__ import annotations

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """The host tier's actors use anyio only: every async test runs on both backends."""
    return str(request.param)
