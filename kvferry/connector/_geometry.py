"""The sizes both halves of the connector derive from vLLM's KV-cache config.

Who owns what: pure values and functions, no state and no thread of their own. The
scheduler half (:class:`~kvferry.connector._scheduler.SchedulerSide`) and the worker half
(:class:`~kvferry.connector._worker.WorkerSide`) each call :func:`plan_geometry` once at
start, from the same ``kv_cache_config``, so they agree on the offloaded block (chunk)
size, the host slots and each group's sliding window; the scheduler's lookups measure a
hybrid model's hit with :func:`windowed_hit`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import numpy.typing as npt

from .._config import FerryConfig
from .._errors import ConfigError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


@attrs.frozen(kw_only=True)
class Geometry:
    """Sizes both halves derive from the same ``kv_cache_config``."""

    engine_block_size: int
    blocks_per_chunk: int
    hashes_per_chunk: int
    num_groups: int
    windows: tuple[int | None, ...]
    """Per group: None for full attention, else its sliding window in offloaded blocks."""
    hybrid: bool = attrs.field(
        init=False,
        default=attrs.Factory(lambda self: any(w is not None for w in self.windows), True),
    )
    """Whether a group has a sliding window (read on every lookup: computed once)."""
    chunk_tokens: int = attrs.field(
        init=False,
        default=attrs.Factory(lambda self: self.engine_block_size * self.blocks_per_chunk, True),
    )
    """Tokens of an offloaded block."""
    row_bytes: int
    """Bytes of one engine block of the largest group, on one worker."""
    num_slots: int
    slot_row_bytes: int = attrs.field(default=attrs.Factory(lambda self: self.row_bytes, True))
    """The row bytes the host slots are counted by: ``row_bytes``, or with pipeline
    parallelism a bound every rank computes alike (see :func:`plan_geometry`)."""
    frees_decoded: bool = False
    """Whether vLLM frees a group's decoded blocks while a request runs, outside any
    sliding window (R-SWA): its decoded blocks are not stored (``store_decoded`` off)."""


def group_window(spec: Any, chunk_tokens: int, group: int) -> int | None:
    """None for a full-attention group; a sliding-window group's window, in offloaded
    blocks (as vLLM's offloading counts it, trailing retained tokens included)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    if isinstance(spec, SlidingWindowSpec):
        window = spec.sliding_window
        extra = getattr(spec, "extra_retained_tokens", 0) or 0
        return max(-(-window // chunk_tokens), -(-(window - 1 + extra) // chunk_tokens))
    if isinstance(spec, FullAttentionSpec):
        return None
    raise ConfigError(
        "model",
        f"KV-cache group {group} is {type(spec).__name__}: kvferry offloads full-attention "
        "and sliding-window groups only",
    )


def _frees_decoded_blocks(spec: Any) -> bool:
    """Whether vLLM frees a group's blocks mid-request other than a sliding window's: R-SWA
    (``RSWASpec``, a full-attention spec to the rest of this module) frees the decoded
    blocks between the prompt and its window (prompt blocks stay)."""
    from vllm.v1 import kv_cache_interface

    rswa = getattr(kv_cache_interface, "RSWASpec", None)
    return rswa is not None and isinstance(spec, rswa)


def plan_geometry(
    cfg: FerryConfig,
    kv_cache_config: KVCacheConfig,
    engine_block_size: int,
    world_size: int,
    *,
    stage_layers: int | None = None,
) -> Geometry:
    """Offloaded block size and host slots, from the config and vLLM's KV-cache config.

    ``stage_layers``: with pipeline parallelism, the layers of the largest stage
    (:func:`largest_stage`). The stages' KV-cache configs differ in their layers, and the
    scheduler holds stage 0's: every rank must count the same host slots (a slot is one
    id on every rank), so there they are sized from what every rank computes alike, the
    largest stage's layers (a drafter's counted on the last stage) times the largest page:
    an upper bound of each stage's row, unless a drafter's pages are larger than the
    target model's. A worker whose row is larger still says so (``host_row_beyond_share``
    in its log), as its host memory then goes beyond its share of ``cpu_bytes_to_use``."""
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise ConfigError("block_size", "the model has no KV-cache group to offload")
    block_sizes = {g.kv_cache_spec.block_size for g in groups}
    if len(block_sizes) != 1:
        raise ConfigError(
            "block_size", f"KV-cache groups with different block sizes {sorted(block_sizes)}"
        )
    group_block = block_sizes.pop()
    bpc = cfg.blocks_per_chunk(group_block)
    hash_block = getattr(kv_cache_config, "hash_block_size", None) or group_block
    chunk_tokens = group_block * bpc
    if chunk_tokens % hash_block:
        raise ConfigError(
            "block_size",
            f"{chunk_tokens} tokens is not a multiple of vLLM's hash block size {hash_block}",
        )
    windows = tuple(group_window(g.kv_cache_spec, chunk_tokens, i) for i, g in enumerate(groups))
    row_bytes = max(len(g.layer_names) * g.kv_cache_spec.page_size_bytes for g in groups)
    sized_by = row_bytes
    if stage_layers is not None:
        sized_by = stage_layers * max(g.kv_cache_spec.page_size_bytes for g in groups)
    slot_bytes = sized_by * bpc * world_size
    num_slots = cfg.cpu_bytes_to_use // slot_bytes
    if num_slots <= 0:
        raise ConfigError(
            "cpu_bytes_to_use",
            f"{cfg.cpu_bytes_to_use} bytes hold no offloaded block ({slot_bytes} bytes each)",
        )
    return Geometry(
        engine_block_size=group_block,
        blocks_per_chunk=bpc,
        hashes_per_chunk=chunk_tokens // hash_block,
        num_groups=len(groups),
        windows=windows,
        row_bytes=row_bytes,
        slot_row_bytes=sized_by,
        num_slots=num_slots,
        frees_decoded=any(_frees_decoded_blocks(g.kv_cache_spec) for g in groups),
    )


def windowed_hit(ready: npt.NDArray[np.bool_], windows: tuple[int | None, ...]) -> int:
    """How many leading offloaded blocks of ``ready`` (blocks x groups) make a hit.

    Every full-attention group must hold each block of the hit; a sliding-window group
    only the last ``window`` blocks of it (those before the first row are on the device).
    """
    n = ready.shape[0]
    full = [g for g, w in enumerate(windows) if w is None]
    end = n
    if full:
        ok = ready[:, full].all(axis=1)
        end = n if ok.all() else int(np.argmin(ok))
    sliding = [(g, w) for g, w in enumerate(windows) if w is not None]
    while end > 0:
        for g, w in sliding:
            start = end - min(w, end)
            window = ready[start:end, g]
            if not window.all():
                # No hit whose window covers this miss: the next candidate ends at it.
                end = start + int(np.flatnonzero(~window)[-1])
                break
        else:
            return int(end)
    return 0


def stage_ranges(vllm_config: Any) -> list[tuple[int, int]] | None:
    """With pipeline parallelism, the model's layers [start, end) of each stage (vLLM's
    ``get_pp_indices``, which ``VLLM_PP_LAYER_PARTITION`` moves too); None with one
    stage."""
    stages = vllm_config.parallel_config.pipeline_parallel_size
    if stages <= 1:
        return None
    from vllm.distributed.utils import get_pp_indices

    total = vllm_config.model_config.get_total_num_hidden_layers()
    return [get_pp_indices(total, s, stages) for s in range(stages)]


def draft_layers(vllm_config: Any) -> int:
    """The layers of a speculative-decoding drafter that keeps a KV cache of its own
    (vLLM's ``uses_draft_kv_cache``: EAGLE, MTP, a draft model): vLLM places them on the
    last pipeline stage, beyond the target model's split. 0 without such a drafter."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or spec.draft_model_config is None or not spec.uses_draft_kv_cache():
        return 0
    return int(spec.draft_model_config.get_total_num_hidden_layers())


def largest_stage(vllm_config: Any) -> int | None:
    """With pipeline parallelism, the layers of the largest stage, a drafter's counted on
    the last (:func:`draft_layers`); None with one stage."""
    ranges = stage_ranges(vllm_config)
    if ranges is None:
        return None
    sizes = [end - start for start, end in ranges]
    sizes[-1] += draft_layers(vllm_config)
    return max(sizes)
