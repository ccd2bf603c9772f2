from __future__ import annotations

import pytest

from kvferry._private_api import PUBLIC_ONLY_ENV


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """The actor runtime uses anyio only: every async test runs on both backends."""
    return str(request.param)


@pytest.fixture(autouse=True, params=["private", "public"])
def api_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every actor test runs on both paths of kvferry._private_api: the probed private
    shortcuts (asyncio's ``_run_once``, anyio's backend event class, structlog's own
    variable) and the public fallbacks (``KVFERRY_PUBLIC_API_ONLY=1``)."""
    if request.param == "public":
        monkeypatch.setenv(PUBLIC_ONLY_ENV, "1")
    else:
        monkeypatch.delenv(PUBLIC_ONLY_ENV, raising=False)
    return str(request.param)
