"""A broken invariant of the scheduler half's bookkeeping (a bug) fails the load it
concerns — the workers report its blocks invalid, vLLM recomputes them — and is logged;
the engine keeps running (nothing is asserted, so ``python -O`` changes nothing)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvferry.cache import GetStatistics
from kvferry.connector._metadata import KVFerryWorkerMetadata

from ._steps import BLOCK, allocated, key, request, scheduler_side, step, store_keys


@pytest.fixture
def scheduler(make_vllm_config: Any, kv_cache_config: Any) -> Iterator[Any]:
    with scheduler_side(make_vllm_config, kv_cache_config) as side:
        yield side


def failed_ack(job_id: int, req_id: str) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(
        kv_connector_worker_meta=KVFerryWorkerMetadata(acks={job_id: [1, 1]}, stats={}),
        finished_sending=None,
        finished_recving={req_id},
    )


def test_an_allocation_for_tokens_never_announced_fails_that_load(
    scheduler: Any, caplog: pytest.LogCaptureFixture
) -> None:
    a = request("a", 2 * BLOCK + 8)
    scheduler.on_new_request(a)
    scheduler.update_state_after_alloc(a, allocated([0, 5, 6]), 2 * BLOCK)  # no lookup
    assert "load_without_lookup" in caplog.text
    meta = scheduler.build_connector_meta(step({}, {}))
    [load] = meta.loads
    assert meta.failed_load_job_ids == [load.copy.job_id]  # the workers fail it, no copy
    assert [list(p.device_blocks) for p in load.copy.parts] == [[5, 6]]  # null block left out
    assert scheduler.request_finished(a, ([0, 5, 6],))[0] is True  # vLLM waits for it
    scheduler.update_connector_output(failed_ack(load.copy.job_id, "a"))
    stats = scheduler.statistics()
    assert (stats.loads_failed, stats.loads_failed_unplanned, stats.loads_failed_copy) == (1, 1, 0)
    assert "a" not in scheduler._reqs


def test_an_allocation_for_other_tokens_than_the_hit_fails_the_load_and_frees_the_lease(
    scheduler: Any, caplog: pytest.LogCaptureFixture
) -> None:
    a = request("a", 4 * BLOCK + 8)
    store_keys(scheduler, [key(a, c) for c in range(4)])
    scheduler.on_new_request(a)
    assert scheduler.get_num_new_matched_tokens(a, 0) == (4 * BLOCK, True)
    scheduler.update_state_after_alloc(a, allocated([1, 2]), 2 * BLOCK)
    assert "load_of_other_tokens" in caplog.text
    assert scheduler.build_connector_meta(step({}, {})).failed_load_job_ids != []
    assert scheduler._ask(GetStatistics).pinned == 0


def test_a_second_load_while_one_runs_fails_alone(scheduler: Any) -> None:
    a = request("a", 2 * BLOCK + 8)
    store_keys(scheduler, [key(a, 0), key(a, 1)])
    scheduler.on_new_request(a)
    assert scheduler.get_num_new_matched_tokens(a, 0) == (2 * BLOCK, True)
    scheduler.update_state_after_alloc(a, allocated([1, 2]), 2 * BLOCK)
    first = scheduler._reqs["a"].load_job
    assert scheduler.get_num_new_matched_tokens(a, 0) == (None, False)  # its own load runs
    scheduler.update_state_after_alloc(a, allocated([1, 2]), 2 * BLOCK)
    meta = scheduler.build_connector_meta(step({}, {}))
    assert [s.copy.job_id for s in meta.loads] == [first, first + 1]
    assert meta.failed_load_job_ids == [first + 1]
    assert scheduler._reqs["a"].load_job == first  # the first one still tracked
