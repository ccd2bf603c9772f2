"""Pipeline parallelism: the stages' KV-cache configs differ in their layers, and vLLM
gives the scheduler stage 0's. Both halves must still count the same host slots (a slot
is one id on every rank)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
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


@pytest.fixture(scope="module")
def two_layer_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvferry.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("draft-2"), num_hidden_layers=2)


def layers(*numbers: int, draft: int = 0) -> Any:
    """A KV-cache config of the model's layers ``numbers`` and ``draft`` layers of a
    drafter (vLLM's KV-cache config of a stage names both)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in numbers]
    names += [f"draft_model.model.layers.{i}.self_attn.attn" for i in range(draft)]
    return KVCacheConfig(
        num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
    )


def with_drafter(config: Any, draft: Path) -> Any:
    """``config`` with a draft model (speculative decoding) that keeps a KV cache."""
    from vllm.config import SpeculativeConfig

    config = copy.deepcopy(config)
    config.speculative_config = SpeculativeConfig(
        model=str(draft),
        method="draft_model",
        num_speculative_tokens=2,
        target_model_config=config.model_config,
        target_parallel_config=config.parallel_config,
    )
    return config


def kv_of(config: Any) -> dict[str, Any]:
    import torch

    names = config.kv_cache_groups[0].layer_names
    return {n: torch.zeros(2, 16, BLOCK, 2, 64, dtype=torch.bfloat16) for n in names}


@pytest.fixture
def workers() -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    for side in made:
        side.shutdown()


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


def test_a_drafters_layers_on_the_last_stage_count_in_every_slot(
    three_layers: Path,
    two_layer_draft: Path,
    workers: list[Any],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM places a drafter's layers (EAGLE, MTP, a draft model) on the last stage,
    beyond the model's split: slots were sized by the split alone (2 layers, stage 0's),
    so the last stage, with 1 layer of the model and 2 of the drafter, held rows half as
    large again, and its host memory went past its share of ``cpu_bytes_to_use``."""
    from kvferry import FerryConfig
    from kvferry.connector._geometry import draft_layers, largest_stage
    from kvferry.connector._scheduler import SchedulerSide
    from kvferry.connector._worker import WorkerSide

    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "2,1")
    page = layers(0).kv_cache_groups[0].kv_cache_spec.page_size_bytes
    extra = {"cpu_bytes_to_use": 40 * 3 * 2 * page}  # 40 slots of 3-layer rows, 2 ranks
    cfg = FerryConfig.from_dict(extra)
    stage0, stage1 = (
        with_drafter(stage_config(three_layers, extra, 2, r), two_layer_draft) for r in (0, 1)
    )
    assert draft_layers(stage0) == 2
    assert largest_stage(stage0) == 3  # the last stage's: 1 + 2
    scheduler = SchedulerSide(stage0, layers(0, 1), cfg)
    try:
        last = WorkerSide(stage1, layers(2, draft=2), cfg)
        workers.append(last)
        last.register_kv_caches(kv_of(layers(2, draft=2)))
        assert scheduler.geometry.num_slots == last.geometry.num_slots == 40
        pool = last.pool
        assert pool is not None
        assert pool.num_slots * pool.blocks_per_chunk * pool.row_bytes <= cfg.cpu_bytes_to_use // 2
        assert "host_row_beyond_share" not in caplog.text
    finally:
        scheduler.shutdown()


def test_no_drafter_that_keeps_no_kv_cache_counts() -> None:
    """ngram proposes from the prompt: no layers (vLLM still gives it a model config)."""
    from types import SimpleNamespace

    from kvferry.connector._geometry import draft_layers

    ngram = SimpleNamespace(draft_model_config=object(), uses_draft_kv_cache=lambda: False)
    assert draft_layers(SimpleNamespace(speculative_config=ngram)) == 0
    assert draft_layers(SimpleNamespace(speculative_config=None)) == 0


def test_a_stage_whose_rows_exceed_the_slots_says_so(
    three_layers: Path,
    workers: list[Any],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Layers on a stage beyond what every rank counts alike (here: two more than its
    split gives it, as a drafter whose pages were larger than the model's would make)
    put its host memory beyond its share: the worker says so, with the figures."""
    from kvferry import FerryConfig
    from kvferry.connector._worker import WorkerSide

    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "2,1")
    page = layers(0).kv_cache_groups[0].kv_cache_spec.page_size_bytes
    extra = {"cpu_bytes_to_use": 40 * 2 * 2 * page}
    cfg = FerryConfig.from_dict(extra)
    last = WorkerSide(stage_config(three_layers, extra, 2, 1), layers(2, draft=2), cfg)
    workers.append(last)
    last.register_kv_caches(kv_of(layers(2, draft=2)))
    assert "host_row_beyond_share" in caplog.text
    assert f"share_bytes={40 * 2 * page}" in caplog.text
    assert f"host_bytes={40 * 3 * page}" in caplog.text
