"""Pipeline parallelism: the stages' KV-cache configs differ in their layers, and vLLM
gives the scheduler stage 0's. Both halves must still count the same host slots (a slot
is one id on every rank)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ._configs import model_config, pipeline_stage, vllm_config

BLOCK = 128


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvferry.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-3"), num_hidden_layers=3)


def stage_config(model: Path, extra: dict[str, Any], stages: int, rank: int) -> Any:
    return pipeline_stage(vllm_config(model_config(model), extra), stages, rank)


def layers(*numbers: int) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in numbers]
    return KVCacheConfig(
        num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
    )


def test_every_stage_counts_the_host_slots_the_scheduler_counts(
    three_layers: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stage 1 holds two layers, stage 0 (whose config the scheduler is given) one: each
    half sized a slot by the layers of the config it holds, so stage 1's workers counted
    half the scheduler's slots, and every copy job naming a slot beyond their pool
    failed. Now both count the slots by the largest stage."""
    from kvferry import FerryConfig
    from kvferry.connector._geometry import largest_stage
    from kvferry.connector._scheduler import SchedulerSide
    from kvferry.connector._worker import WorkerSide

    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,2")
    page = layers(0).kv_cache_groups[0].kv_cache_spec.page_size_bytes
    extra = {"cpu_bytes_to_use": 40 * 2 * 2 * page}  # 40 slots of the largest stage's rows
    cfg = FerryConfig.from_dict(extra)
    assert largest_stage(stage_config(three_layers, extra, 2, 0)) == 2
    scheduler = SchedulerSide(stage_config(three_layers, extra, 2, 0), layers(0), cfg)
    try:
        worker0 = WorkerSide(stage_config(three_layers, extra, 2, 0), layers(0), cfg)
        worker1 = WorkerSide(stage_config(three_layers, extra, 2, 1), layers(1, 2), cfg)
        slots = scheduler.geometry.num_slots
        assert (worker0.geometry.num_slots, worker1.geometry.num_slots) == (slots, slots)
        assert slots == 40
        # Each worker still holds its own tensors to its own config.
        assert (worker0.geometry.row_bytes, worker1.geometry.row_bytes) == (page, 2 * page)
    finally:
        scheduler.shutdown()


def test_one_stage_sizes_slots_by_its_own_layers(three_layers: Path) -> None:
    """Without pipeline parallelism nothing changes: a slot holds the config's layers."""
    from kvferry import FerryConfig
    from kvferry.connector._geometry import largest_stage, plan_geometry

    config = stage_config(three_layers, {}, 1, 0)
    assert largest_stage(config) is None
    page = layers(0).kv_cache_groups[0].kv_cache_spec.page_size_bytes
    cfg = FerryConfig.from_dict({"cpu_bytes_to_use": 30 * 3 * page})
    geo = plan_geometry(cfg, layers(0, 1, 2), BLOCK, 1, stage_layers=largest_stage(config))
    assert (geo.num_slots, geo.row_bytes, geo.slot_row_bytes) == (30, 3 * page, 3 * page)
