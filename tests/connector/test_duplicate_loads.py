"""Two requests needing the same offloaded blocks load them once: the second waits
(vLLM asks it again next step) until the first's load ended, then finds them in the
engine's own prefix cache."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ._steps import BLOCK, acked, allocated, key, request, scheduler_side, store_keys


@pytest.fixture
def scheduler(make_vllm_config: Any, kv_cache_config: Any) -> Iterator[Any]:
    with scheduler_side(make_vllm_config, kv_cache_config) as side:
        yield side


def test_a_request_waits_for_another_loading_its_blocks(scheduler: Any) -> None:
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
