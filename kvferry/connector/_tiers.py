"""What both halves of the connector derive from vLLM's config for the disk tier.

The fingerprint (:class:`~kvferry.tiers.Fingerprint`) names everything that makes a
chunk's bytes valid for an engine; a chunk written under another fingerprint is never
read. Both halves compute it from the same configs, so the scheduler can find (at start,
by scanning) the files the workers wrote in an earlier run, rank by rank.

``layout`` covers what decides the bytes of a host row: every KV-cache group's spec
(kind, block size, heads, head size, dtype, page bytes, window, its layers), the
attention backend asked for, the platform, vLLM's version (a version may change a
backend's layout) and the host row format of this kvferry. The worker also records the
layout it observed on its tensors beside its files, and clears its files if that
changed (see :class:`~kvferry.connector._worker.WorkerSide`).

With pipeline parallelism the workers' KV-cache configs differ in their layers (each
stage holds its own), and the scheduler is given stage 0's (vLLM's
``generate_scheduler_kv_cache_config``: "the same kv_cache_config except layer names"):
named by their layers, a later stage's fingerprint as the scheduler computes it would
not be its worker's, and the scheduler would find none of that stage's chunks (a disk
tier's restart deleting every chunk as held by some ranks only, a Redis tier never
hitting). So with more than one stage a group names no layers, and the layout names the
rank's stage by the range of the model's layers it holds, which both halves compute
from the config alone (vLLM's ``get_pp_indices``, which ``VLLM_PP_LAYER_PARTITION``
moves too). With one stage the layers are named as before (fingerprints unchanged).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from .._errors import ConfigError
from ..tiers import Fingerprint
from ._geometry import stage_ranges

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

HOST_ROW_FORMAT = 1
"""Bump when the bytes of a host row (a slot) change meaning for the same engine."""

_RANDOM_SEEDED_ALGOS = ("xxhash", "xxhash_cbor")
"""vLLM seeds these with random bytes per process unless ``PYTHONHASHSEED`` is set
(vllm/v1/core/kv_cache_utils.py: resolve_none_hash_seed)."""


def check_hash_algo(vllm_config: VllmConfig) -> str:
    """vLLM's block-hash algorithm; a :class:`ConfigError` if its hashes differ per process.

    A disk tier keeps keys across restarts: they must be the same in every process.
    """
    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
    if algo in _RANDOM_SEEDED_ALGOS and os.environ.get("PYTHONHASHSEED") is None:
        raise ConfigError(
            "tiers",
            f"a disk or redis tier needs block hashes that are the same in every process, but "
            f"prefix_caching_hash_algo={algo!r} is seeded at random per process: set "
            "prefix_caching_hash_algo='sha256' (or 'sha256_cbor') in vLLM's cache config "
            "(--prefix-caching-hash-algo), or set PYTHONHASHSEED to one shared value",
        )
    return algo


def _spec_of(group: Any, *, layers: bool = True) -> dict[str, Any]:
    spec = group.kv_cache_spec
    doc: dict[str, Any] = {"kind": type(spec).__name__}
    if layers:
        doc["layers"] = list(group.layer_names)
    for name in (
        "block_size",
        "num_kv_heads",
        "head_size",
        "head_size_v",
        "dtype",
        "page_size_bytes",
        "sliding_window",
        "attention_chunk_size",
        "cache_dtype_str",
        "kv_quant_mode",
    ):
        value = getattr(spec, name, None)
        if value is not None:
            doc[name] = str(value)
    return doc


def _attention_backend(vllm_config: VllmConfig) -> str:
    attention = getattr(vllm_config, "attention_config", None)
    backend = getattr(attention, "backend", None) if attention is not None else None
    return str(backend if backend is not None else os.environ.get("VLLM_ATTENTION_BACKEND", ""))


def disk_leader(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, chunk_tokens: int, rank: int
) -> Fingerprint | None:
    """The fingerprint of rank 0, whose disk namespace index worker ``rank`` takes too (see
    :class:`~kvferry.tiers.DiskStore`, ``leader``), as the scheduler side computes it (it
    derives every rank's fingerprint from one config: the ranks of a tensor-parallel
    engine differ only by their rank, the stages of a pipeline by their layers, which the
    fingerprint names by the stage's range: see the module docstring). None where there
    is nothing to follow: rank 0, one rank; and where rank 0's namespace cannot be found,
    so that the rank would only wait for it: an engine spanning nodes (``nnodes``: rank
    0's namespace is on another machine's ``path``)."""
    parallel = vllm_config.parallel_config
    nodes = getattr(parallel, "nnodes_within_dp", getattr(parallel, "nnodes", 1))
    if rank == 0 or parallel.world_size <= 1 or nodes > 1:
        return None
    return disk_fingerprint(vllm_config, kv_cache_config, chunk_tokens, 0)


def stage_layers(vllm_config: VllmConfig, rank: int) -> list[int] | None:
    """With pipeline parallelism, the model's layers [start, end) worker ``rank`` holds
    (vLLM orders ranks DP x PP x TP, as ``ModelConfig.get_layers_start_end_indices``
    reads them); None with one stage."""
    ranges = stage_ranges(vllm_config)
    if ranges is None:
        return None
    start, end = ranges[(rank // vllm_config.parallel_config.tensor_parallel_size) % len(ranges)]
    return [start, end]


def disk_fingerprint(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, chunk_tokens: int, rank: int
) -> Fingerprint:
    """The fingerprint of worker ``rank``'s chunks (each rank holds its own bytes)."""
    import vllm
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    stage = stage_layers(vllm_config, rank)
    layout: dict[str, Any] = {
        "host_row_format": HOST_ROW_FORMAT,
        # One stage: each group's layers by name; more: the stage's range (module doc).
        "groups": [_spec_of(g, layers=stage is None) for g in kv_cache_config.kv_cache_groups],
        "attention_backend": _attention_backend(vllm_config),
        "platform": str(current_platform.device_type),
        "vllm": str(vllm.__version__),
    }
    if stage is not None:
        layout["stage_layers"] = stage
    return Fingerprint(
        model=f"{model.model}@{model.revision or ''}",
        dtype=f"{model.dtype}/{vllm_config.cache_config.cache_dtype}",
        layout=json.dumps(layout, sort_keys=True, separators=(",", ":")),
        block_size=chunk_tokens,
        tp_rank=rank,
        tp_world_size=parallel.world_size,
        block_hash_algorithm=check_hash_algo(vllm_config),
        extra={
            "pipeline_parallel_size": parallel.pipeline_parallel_size,
            "tensor_parallel_size": parallel.tensor_parallel_size,
        },
    )
