"""Driving the connector's scheduler half by hand: requests with seeded block hashes,
keys stored straight into its directory, and the parts of vLLM's per-step objects the
connector reads. (The end-to-end tests drive it with real vLLM.)"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvferry import FerryConfig
from kvferry.cache import CompleteStore, PrepareStore
from kvferry.connector._metadata import KVFerryWorkerMetadata

BLOCK = 128


@contextmanager
def scheduler_side(vllm_config_for: Any, kv_cache_config: Any, **config: Any) -> Iterator[Any]:
    from kvferry.connector._scheduler import SchedulerSide

    extra = {"cpu_bytes_to_use": 64 << 20, **config}
    side = SchedulerSide(vllm_config_for(extra), kv_cache_config, FerryConfig.from_dict(extra))
    try:
        yield side
    finally:
        side.shutdown()


def request(req_id: str, num_tokens: int, seed: int = 0) -> Any:
    rng = np.random.default_rng(seed)
    hashes = [rng.bytes(32) for _ in range(num_tokens // BLOCK)]
    return SimpleNamespace(
        request_id=req_id,
        block_hashes=hashes,
        num_tokens=num_tokens,
        num_prompt_tokens=num_tokens,
        num_computed_tokens=0,
        kv_transfer_params=None,
        trace_headers=None,
    )


def key(req: Any, chunk: int, group: int = 0) -> bytes:
    return bytes(req.block_hashes[chunk]) + group.to_bytes(4, "big")


def store_keys(side: Any, keys: list[bytes]) -> None:
    slots = side._ask(lambda r: PrepareStore(keys=tuple(keys), reply=r))
    assert (slots >= 0).all()
    side.directory_tell(CompleteStore(slots=slots, ok=True))


def allocated(*groups: list[int]) -> Any:
    """vLLM's KVCacheBlocks as update_state_after_alloc reads it."""
    return SimpleNamespace(get_block_ids=lambda: groups)


def step(
    new: dict[str, tuple[list[int], ...]],
    scheduled: dict[str, int],
    preempted: tuple[str, ...] = (),
    cached: dict[str, tuple[list[int], ...] | None] | None = None,
    resumed: tuple[str, ...] = (),
) -> Any:
    """The parts of a SchedulerOutput the connector reads: ``new`` requests' block ids,
    ``cached`` ones' new block ids (None: none this step), those ``resumed`` among them."""
    cached = cached or {}
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=ids) for r, ids in new.items()],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(cached), new_block_ids=list(cached.values()), resumed_req_ids=set(resumed)
        ),
        num_scheduled_tokens=scheduled,
        preempted_req_ids=set(preempted),
    )


def acked(*job_ids: int) -> Any:
    """A KVConnectorOutput whose only worker reports ``job_ids`` ended well."""
    return SimpleNamespace(
        kv_connector_worker_meta=KVFerryWorkerMetadata(acks={j: [1, 0] for j in job_ids}, stats={}),
        finished_sending=None,
        finished_recving=None,
    )


def router_replay(router: dict[str, set[Any]], events: list[Any]) -> None:
    """What a KV-aware router does with vLLM's KV events: the block hashes it believes
    held, per medium (vLLM's AllBlocksCleared names no medium: every medium is emptied)."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    for ev in events:
        if isinstance(ev, BlockStored):
            router.setdefault(str(ev.medium), set()).update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            router.setdefault(str(ev.medium), set()).difference_update(ev.block_hashes)
        elif isinstance(ev, AllBlocksCleared):
            for held in router.values():
                held.clear()


def vllm_hashes(keys: list[bytes]) -> set[Any]:
    """The hashes vLLM's events carry for offload keys (block hash + 4-byte group)."""
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    return {maybe_convert_block_hash(BlockHash(k[:-4])) for k in keys}
