from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # No GPU: the CUDA engine's Triton kernel runs on CPU tensors, interpreted. Set before
    # anything imports kvferry.transfer._triton (triton.jit reads it at definition).
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
