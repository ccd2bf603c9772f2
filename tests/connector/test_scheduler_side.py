"""The scheduler half, driven by hand: duplicate loads, and which blocks are stored."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from ._steps import BLOCK, acked, allocated, key, request, scheduler_side, step, store_keys


@pytest.fixture
def scheduler(make_vllm_config: Any, kv_cache_config: Any) -> Iterator[Any]:
    with scheduler_side(make_vllm_config, kv_cache_config) as side:
        yield side


def test_a_request_waits_for_another_loading_its_blocks(scheduler: Any) -> None:
    """Two requests needing the same offloaded blocks load them once: the second waits
    (vLLM asks it again next step) until the first's load ended, then finds them in the
    engine's own prefix cache."""
    a, b = request("a", 4 * BLOCK + 8), request("b", 4 * BLOCK + 8)  # the same prompt
    other = request("c", 4 * BLOCK + 8, seed=9)
    store_keys(scheduler, [key(r, c) for r in (a, other) for c in range(4)])
    for r in (a, b, other):
        scheduler.on_new_request(r)

    assert scheduler.get_num_new_matched_tokens(a, 0) == (4 * BLOCK, True)
    scheduler.update_state_after_alloc(a, allocated([1, 2, 3, 4]), 4 * BLOCK)
    [load] = scheduler._pending_loads

    assert scheduler.get_num_new_matched_tokens(b, 0) == (None, False)
    assert scheduler.get_num_new_matched_tokens(b, 0) == (None, False)  # asked again
    # A request needing other blocks is not held back.
    assert scheduler.get_num_new_matched_tokens(other, 0) == (4 * BLOCK, True)
    # Blocks the engine holds already are not looked up: no wait for them.
    assert scheduler.get_num_new_matched_tokens(b, 4 * BLOCK) == (0, False)

    scheduler.update_connector_output(acked(load.copy.job_id))
    assert scheduler.get_num_new_matched_tokens(b, 0) == (4 * BLOCK, True)
    stats = scheduler.statistics()
    assert stats.lookups_deferred == 2
    # Counted once, when admitted: a's and b's asks, not b's deferred ones.
    scheduler.update_state_after_alloc(b, allocated([5, 6, 7, 8]), 4 * BLOCK)
    assert scheduler.statistics().tokens_hit == 2 * 4 * BLOCK


@pytest.mark.parametrize(("store_decoded", "stored"), [(True, 3), (False, 2)])
def test_store_decoded_switch(
    make_vllm_config: Any, kv_cache_config: Any, store_decoded: bool, stored: int
) -> None:
    with scheduler_side(make_vllm_config, kv_cache_config, store_decoded=store_decoded) as side:
        a = request("a", 2 * BLOCK + 8)  # a prompt of 2 full blocks and 8 tokens
        side.on_new_request(a)
        assert side.get_num_new_matched_tokens(a, 0) == (0, False)
        meta = side.build_connector_meta(step({"a": ([1, 2, 3],)}, {"a": a.num_tokens}))
        assert [len(s.copy.parts[0].device_blocks) for s in meta.stores] == [2]
        # Decoding filled the third block: it has a hash, and its last token runs now.
        a.num_computed_tokens, a.num_tokens = 3 * BLOCK - 1, 3 * BLOCK
        a.block_hashes.append(b"decoded-block-hash".ljust(32, b"."))
        meta = side.build_connector_meta(step({}, {"a": 1}))
        assert sum(len(s.copy.parts[0].device_blocks) for s in meta.stores) == stored - 2


@pytest.mark.parametrize("store_decoded", [False, True])
def test_a_stored_prompt_is_offered_again_after_a_reset_or_a_preemption(
    make_vllm_config: Any, kv_cache_config: Any, store_decoded: bool
) -> None:
    """Decode steps pass over a request whose prompt is stored (without a look, prompt
    blocks only); a reset (the host tier emptied) or a preemption (vLLM hands the resumed
    request new blocks) makes its chunks offered again."""
    with scheduler_side(make_vllm_config, kv_cache_config, store_decoded=store_decoded) as side:
        _offered_again(side)


def _offered_again(scheduler: Any) -> None:
    a = request("a", 2 * BLOCK + 8)  # a prompt of 2 full blocks and 8 tokens
    scheduler.on_new_request(a)
    assert scheduler.get_num_new_matched_tokens(a, 0) == (0, False)
    meta = scheduler.build_connector_meta(step({"a": ([1, 2, 3],)}, {"a": a.num_tokens}))
    [store] = meta.stores
    scheduler.update_connector_output(acked(store.copy.job_id))
    a.num_computed_tokens = a.num_tokens
    decode = step({}, {"a": 1}, cached={"a": None})
    assert scheduler.build_connector_meta(decode).stores == []

    assert scheduler.reset()
    [again] = scheduler.build_connector_meta(decode).stores
    assert again.copy.parts[0].device_blocks.tolist() == [1, 2]
    scheduler.update_connector_output(acked(again.copy.job_id))
    assert scheduler.build_connector_meta(decode).stores == []

    skipped = scheduler.statistics().directory.stores_skipped_present
    resume = step({}, {"a": a.num_tokens}, cached={"a": ([7, 8, 9],)}, resumed=("a",))
    assert scheduler.build_connector_meta(resume).stores == []  # both held: skipped as present
    assert scheduler.statistics().directory.stores_skipped_present == skipped + 2
    assert scheduler.build_connector_meta(decode).stores == []


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_request_resumed_after_preemption_stores_from_its_new_blocks(
    scheduler: Any, runner: str
) -> None:
    """vLLM frees a preempted request's blocks and gives it a whole new table when it is
    scheduled again: Model Runner V1 names it among the resumed cached requests, V2 (vLLM
    0.32's default where Triton is) sends it among the new requests. Either way its later
    chunks are stored from the new blocks, never from the old ones (other requests' now)."""
    a = request("a", 4 * BLOCK + 8)  # a prompt of 4 full blocks and 8 tokens
    scheduler.on_new_request(a)
    assert scheduler.get_num_new_matched_tokens(a, 0) == (0, False)
    # A chunked prefill: the first 2 blocks this step.
    meta = scheduler.build_connector_meta(step({"a": ([1, 2, 3, 4, 5],)}, {"a": 2 * BLOCK}))
    [store] = meta.stores
    assert store.copy.parts[0].device_blocks.tolist() == [1, 2]
    scheduler.update_connector_output(acked(store.copy.job_id))
    a.num_computed_tokens = 2 * BLOCK

    assert scheduler.build_connector_meta(step({}, {}, preempted=("a",))).stores == []
    # Scheduled again: its first 2 blocks are in vLLM's own prefix cache still.
    a.num_computed_tokens = 0
    assert scheduler.get_num_new_matched_tokens(a, 2 * BLOCK) == (0, False)
    a.num_computed_tokens = 2 * BLOCK
    table = ([1, 2, 9, 10, 11],)
    if runner == "v2":
        again = step({"a": table}, {"a": 2 * BLOCK + 8})
    else:
        again = step({}, {"a": 2 * BLOCK + 8}, cached={"a": table}, resumed=("a",))
    meta = scheduler.build_connector_meta(again)
    stored = [b for s in meta.stores for b in s.copy.parts[0].device_blocks.tolist()]
    assert stored == [9, 10]  # chunks 0 and 1 are held: skipped as present


def test_a_lookup_that_asks_nothing_counts_nothing(scheduler: Any) -> None:
    """A lookup's counts are taken when vLLM admits the request. When vLLM could not
    allocate a hit and asks again once its own prefix cache holds the whole prompt (another
    request computed it), that lookup asks kvferry nothing, and nothing is counted."""
    a = request("a", 4 * BLOCK + 8)
    store_keys(scheduler, [key(a, c) for c in range(4)])
    scheduler.on_new_request(a)
    assert scheduler.get_num_new_matched_tokens(a, 0) == (4 * BLOCK, True)
    scheduler.build_connector_meta(step({}, {}))  # vLLM could not allocate it this pass
    assert scheduler.get_num_new_matched_tokens(a, 4 * BLOCK) == (0, False)
    scheduler.update_state_after_alloc(a, allocated([1, 2, 3, 4, 5]), 0)
    stats = scheduler.statistics()
    assert (stats.tokens_looked_up, stats.tokens_hit, stats.tokens_missed) == (0, 0, 0)


def test_a_request_whose_load_failed_loads_nothing_more(scheduler: Any) -> None:
    """vLLM recomputes a failed load's blocks; a request with no valid prefix left is
    scheduled again from nothing and asks again. Its hit is not loaded again (a load that
    fails every time would never let it end): it recomputes. Other requests still hit."""
    from kvferry.connector._metadata import KVFerryWorkerMetadata

    a, b = request("a", 4 * BLOCK + 8), request("b", 4 * BLOCK + 8)  # the same prompt
    store_keys(scheduler, [key(a, c) for c in range(4)])
    scheduler.on_new_request(a)
    assert scheduler.get_num_new_matched_tokens(a, 0) == (4 * BLOCK, True)
    scheduler.update_state_after_alloc(a, allocated([1, 2, 3, 4]), 4 * BLOCK)
    [load] = scheduler.build_connector_meta(step({}, {})).loads
    failed = KVFerryWorkerMetadata(acks={load.copy.job_id: [1, 1]}, stats={})
    scheduler.update_connector_output(
        SimpleNamespace(
            kv_connector_worker_meta=failed, finished_sending=None, finished_recving={"a"}
        )
    )
    stats = scheduler.statistics()
    assert (stats.loads_failed, stats.loads_failed_copy, stats.loads_failed_deadline) == (1, 1, 0)
    assert scheduler.get_num_new_matched_tokens(a, 0) == (0, False)
    scheduler.on_new_request(b)
    assert scheduler.get_num_new_matched_tokens(b, 0) == (4 * BLOCK, True)


def test_a_store_in_flight_at_a_reset_never_becomes_a_hit_nor_counts_as_stored(
    scheduler: Any,
) -> None:
    a = request("a", 2 * BLOCK + 8)
    scheduler.on_new_request(a)
    assert scheduler.get_num_new_matched_tokens(a, 0) == (0, False)
    [store] = scheduler.build_connector_meta(step({"a": ([1, 2, 3],)}, {"a": a.num_tokens})).stores
    assert scheduler.reset()
    scheduler.update_connector_output(acked(store.copy.job_id))
    b = request("b", 2 * BLOCK + 8)  # the same prompt
    scheduler.on_new_request(b)
    assert scheduler.get_num_new_matched_tokens(b, 0) == (0, False)
    stats = scheduler.statistics()
    assert (stats.stores_done, stats.tokens_stored) == (1, 0)


def test_a_store_planned_when_a_request_finishes_ends_in_its_one_journey(
    make_vllm_config: Any, kv_cache_config: Any
) -> None:
    """A request aborted with chunks still to store (here: offered again after a reset)
    gets its last store in request_finished: that job is in the request's journey, which
    ends with it — no second journey, no span left open."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvferry.traces import SchedulerTracer

    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with scheduler_side(make_vllm_config, kv_cache_config) as side:
        side.trace = SchedulerTracer(provider)
        a = request("a", 2 * BLOCK + 8)
        side.on_new_request(a)
        assert side.get_num_new_matched_tokens(a, 0) == (0, False)
        meta = side.build_connector_meta(step({"a": ([1, 2, 3],)}, {"a": a.num_tokens}))
        a.num_computed_tokens = a.num_tokens
        side.update_connector_output(acked(*[s.copy.job_id for s in meta.stores]))
        assert side.reset()
        assert side.request_finished(a, ([1, 2, 3],))[0] is True  # a store planned at finish
        meta = side.build_connector_meta(step({}, {}))
        side.update_connector_output(acked(*[s.copy.job_id for s in meta.stores]))
        assert side.trace.open_spans() == 0
    spans = exporter.get_finished_spans()
    [journey] = [s for s in spans if s.name == "kvferry"]
    stores = [s for s in spans if s.name == "store kv_blocks"]
    assert len(stores) == 2
    assert {s.context.trace_id for s in stores} == {journey.context.trace_id}
