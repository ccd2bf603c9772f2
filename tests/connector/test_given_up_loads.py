"""A load given up at its deadline while its chunks are still read (a disk that stopped
answering): vLLM has the request's ``finished_recving`` before the scheduler half has the
job's acknowledgement, which comes only once the read ends. The request must not stay
tied to that load meanwhile: one that finishes has its blocks freed, and is forgotten."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ._steps import BLOCK, allocated, request
from .test_disk_both_halves import LAYERS, Engine, HeldReads, store_and_write_down


@pytest.fixture
def make_engine(
    make_vllm_config: Any, kv_cache_config: Any, tmp_path: Path
) -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(runtime: str = "stepped", **kw: Any) -> Engine:
        made.append(Engine(make_vllm_config, kv_cache_config, tmp_path / "disk", runtime, **kw))
        return made[-1]

    yield make
    for e in made:
        if e.worker.runtime is not None:
            e.close()


def give_up_b(e: Engine, now: list[float]) -> tuple[Any, HeldReads, set[str]]:
    """``a`` written down and evicted; ``b`` (the same prompt) loads it from disk, its
    reads held; its deadline passes and the worker answers vLLM. The finished_sending
    every step reports is collected in the set returned."""
    sending: set[str] = set()
    get_finished = e.worker.get_finished

    def recorded() -> tuple[set[str] | None, set[str] | None]:
        s, r = get_finished()
        sending.update(s or ())
        return s, r

    e.worker.get_finished = recorded  # type: ignore[method-assign]
    a, b = request("a", 3 * BLOCK + 8), request("b", 3 * BLOCK + 8)
    store_and_write_down(e, a, [1, 2, 3, 4])
    for n in LAYERS:
        e.kv[n][:, [9, 10, 11]] = 0
    reads = HeldReads()
    assert e.worker.disk is not None
    e.worker.disk._ops = reads
    e.sched.on_new_request(b)
    assert e.sched.get_num_new_matched_tokens(b, 0) == (3 * BLOCK, True)
    e.sched.update_state_after_alloc(b, allocated([9, 10, 11, 12]), 3 * BLOCK)
    e.step()  # the reads start, and are held
    now[0] += e.sched.cfg.job_timeout_s + 1
    e.step()  # the scheduler ends the load; the worker gives it up
    assert "b" in e.recving and e.load_errors == {9, 10, 11}
    assert e.sched._expired  # its ack waits for the read's end
    return b, reads, sending


@pytest.mark.parametrize("runtime", ["stepped", "thread"])
def test_a_request_given_up_and_recomputed_that_finishes_has_its_blocks_freed(
    make_engine: Callable[..., Engine], runtime: str
) -> None:
    """vLLM recomputes b (every block invalid: num_computed_tokens 0, blocks freed and
    allocated again) and b finishes while the hung read still runs. request_finished
    answered True (delay the free: "aborted while its load runs") while the load was
    still b's, yet no worker would report b in finished_sending: vLLM kept b and its
    blocks forever (finished_recving, the other way vLLM frees a delayed request, was
    spent by the give-up)."""
    now = [0.0]
    e = make_engine(runtime, clock=lambda: now[0])
    b, reads, sending = give_up_b(e, now)
    try:
        # vLLM schedules b again from nothing: no hit (its load failed), recomputed.
        assert e.sched.get_num_new_matched_tokens(b, 0) == (0, False)
        e.sched.update_state_after_alloc(b, allocated([13, 14, 15, 5]), 0)
        e.step({"b": ([13, 14, 15, 5],)}, {"b": b.num_tokens})
        b.num_computed_tokens = b.num_tokens
        delay, _ = e.sched.request_finished(b, ([13, 14, 15, 5],))
    finally:
        reads.released.set()
    e.run_until(lambda: not e.sched._expired and not e.sched._jobs)  # everything ended
    e.step()
    # Either its blocks are free at once, or vLLM is told (finished_sending) later.
    assert not delay or "b" in sending, "vLLM holds b's blocks for a finished_sending never sent"


@pytest.mark.parametrize("runtime", ["stepped", "thread"])
def test_a_request_aborted_while_its_load_is_given_up_is_forgotten(
    make_engine: Callable[..., Engine], runtime: str
) -> None:
    """b is aborted after the give-up's finished_recving: the scheduler half kept b tied
    to its load until the read ended, and then let it go without dropping b: its state
    stayed for the life of the engine."""
    now = [0.0]
    e = make_engine(runtime, clock=lambda: now[0])
    b, reads, _ = give_up_b(e, now)
    try:
        e.sched.request_finished(b, ([9, 10, 11, 12],))  # aborted after the give-up
    finally:
        reads.released.set()
    e.run_until(lambda: not e.sched._expired and not e.sched._jobs)
    e.step()
    assert "b" not in set(e.sched._reqs), "the finished request's state is kept forever"


def test_control_the_same_request_finishing_after_the_read_ended_is_freed(
    make_engine: Callable[..., Engine],
) -> None:
    """b finishes only once the read ended and was acknowledged: nothing holds its
    blocks, and its state is dropped (the two tests above finish it while the read
    still runs)."""
    now = [0.0]
    e = make_engine("stepped", clock=lambda: now[0])
    b, reads, sending = give_up_b(e, now)
    reads.released.set()
    e.run_until(lambda: not e.sched._expired and not e.sched._jobs)
    delay, _ = e.sched.request_finished(b, ([9, 10, 11, 12],))
    e.run_until(lambda: not e.sched._jobs)
    e.step()
    assert not delay or "b" in sending
    assert "b" not in set(e.sched._reqs)


@pytest.mark.parametrize("runtime", ["stepped", "thread"])
def test_a_request_aborted_while_it_loads_is_let_go_when_its_load_is_given_up(
    make_engine: Callable[..., Engine], runtime: str
) -> None:
    """b is aborted while its read is held: vLLM delays freeing its blocks until
    finished_recving, which the give-up sends at the deadline; the scheduler half then
    forgets b, though the read has not ended."""
    now = [0.0]
    e = make_engine(runtime, clock=lambda: now[0])
    a, b = request("a", 3 * BLOCK + 8), request("b", 3 * BLOCK + 8)
    store_and_write_down(e, a, [1, 2, 3, 4])
    reads = HeldReads()
    assert e.worker.disk is not None
    e.worker.disk._ops = reads
    try:
        e.sched.on_new_request(b)
        assert e.sched.get_num_new_matched_tokens(b, 0) == (3 * BLOCK, True)
        e.sched.update_state_after_alloc(b, allocated([9, 10, 11, 12]), 3 * BLOCK)
        e.step()  # the reads start, and are held
        assert e.sched.request_finished(b, ([9, 10, 11, 12],))[0] is True  # loading: delay
        now[0] += e.sched.cfg.job_timeout_s + 1
        e.step()  # ended at its deadline, given up: finished_recving
        assert "b" in e.recving
        assert "b" not in e.sched._reqs
        assert e.sched._expired  # its host slots still wait for the read
    finally:
        reads.released.set()
    e.run_until(lambda: not e.sched._expired)
