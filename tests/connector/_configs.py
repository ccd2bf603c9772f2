"""Real vLLM configs for the connector's tests (no engine)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any


def model_config(model: Path) -> Any:
    from vllm.config import ModelConfig

    return ModelConfig(
        model=str(model), skip_tokenizer_init=True, max_model_len=2048, dtype="bfloat16"
    )


def vllm_config(model: Any, extra: dict[str, Any], block_size: int = 128) -> Any:
    """A VllmConfig of ``model`` (a ModelConfig) with kvferry's extra config."""
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, VllmConfig

    return VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=block_size),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVFerryConnector",
            kv_connector_module_path="kvferry.connector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
    )


def pipeline_stage(config: Any, stages: int, rank: int) -> Any:
    """A copy of ``config`` as worker ``rank`` of ``stages`` pipeline stages sees it."""
    config = copy.deepcopy(config)
    parallel = config.parallel_config
    parallel.pipeline_parallel_size = stages
    parallel.world_size = stages * parallel.tensor_parallel_size
    parallel.rank = rank
    return config
