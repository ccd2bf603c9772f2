"""The simulated workers of benchmarks/_simulators.py (the harness of
benchmarks/scheduler_overhead.py), against real vLLM schedulers: every job they are given
ends as each connector's real worker would end it, and what they count is what moved."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

HARNESS = Path(__file__).resolve().parents[2] / "benchmarks" / "_simulators.py"
BLOCK = 16
PROMPT = 200
"""Tokens per prompt: 12 full blocks (the engine's cache holds 16, so one prompt's blocks
leave it when the next two requests run)."""


@pytest.fixture(scope="module")
def sims() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_simulators", HARNESS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hasher() -> Any:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(BLOCK, sha256)


def setup(sims: ModuleType, tiny_model: Path, **changes: Any) -> Any:
    values: dict[str, Any] = {
        "model_dir": tiny_model,
        "block": BLOCK,
        "offload_block": BLOCK,
        "num_gpu_blocks": 16,
        "host_blocks": 128,
        "max_num_seqs": 4,
        "max_batched_tokens": 512,
        "max_model_len": 2048,
    }
    return sims.Setup(**(values | changes))


def prompt(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 2048, size=PROMPT).tolist()


class Run:
    """One scheduler of ``kind`` with its simulated worker, fed one request at a time."""

    def __init__(self, sims: ModuleType, s: Any, kind: str, hasher: Any) -> None:
        self.sims = sims
        self.scheduler = sims.make_scheduler(s, kind)
        self.moved = sims.Moved()
        self.sim = sims.SIMULATORS[kind](sims.row_bytes(self.scheduler.kv_cache_config), self.moved)
        self.hasher = hasher
        self.finished = 0
        self.metadata: list[Any] = []

    def step(self) -> Any:
        so = self.scheduler.schedule()
        self.metadata.append(so.kv_connector_metadata)
        output = self.sims.model_runner_output(self.scheduler, so, self.sim)
        for eco in self.scheduler.update_from_output(so, output).values():
            self.finished += sum(1 for o in eco.outputs if o.finished)
        return output

    def serve(self, *seeds: int, max_tokens: int = 3) -> None:
        """Each prompt in turn, its request run to the end (and the workers idle) first."""
        for i, seed in enumerate(seeds):
            self.scheduler.add_request(
                self.sims.new_request(f"r{i}", prompt(seed), max_tokens, self.hasher)
            )
            for _ in range(100):
                if not self.scheduler.has_requests() and self.sim.idle():
                    break
                self.step()
            else:
                pytest.fail(f"request r{i} did not finish in 100 steps")

    def close(self) -> None:
        self.scheduler.shutdown()


@pytest.fixture
def run(sims: ModuleType, tiny_model: Path, hasher: Any) -> Any:
    runs: list[Run] = []

    def make(kind: str, **changes: Any) -> Run:
        runs.append(Run(sims, setup(sims, tiny_model, **changes), kind, hasher))
        return runs[-1]

    yield make
    for r in runs:
        r.close()


def test_kvferry_sim_acks_every_job_it_is_given(run: Any) -> None:
    r = run("kvferry")
    r.serve(0, 1, 2, 0)
    stats = r.scheduler.connector.statistics()
    assert r.finished == 4
    assert stats.jobs_in_flight == 0
    assert (stats.stores_done, stats.loads_done) == (r.moved.store_jobs, r.moved.load_jobs)
    assert stats.stores_failed == stats.loads_failed == 0
    assert not r.scheduler.connector._scheduler._reqs


def test_kvferry_sim_loads_a_prompt_the_engine_no_longer_holds(run: Any) -> None:
    r = run("kvferry")
    r.serve(0, 1, 2, 0)
    assert r.moved.load_jobs == 1
    assert r.moved.load_blocks == PROMPT // BLOCK
    assert r.scheduler.connector.statistics().tokens_loaded == r.moved.load_blocks * BLOCK


def test_kvferry_sim_reports_the_bytes_of_what_it_moved(run: Any, sims: ModuleType) -> None:
    r = run("kvferry")
    r.serve(0, 1, 2, 0)
    stats = r.scheduler.connector.statistics()
    row = sims.row_bytes(r.scheduler.kv_cache_config)
    assert stats.store_bytes == r.moved.store_blocks * row
    assert stats.load_bytes == r.moved.load_blocks * row


def test_vllm_sim_ends_every_job_and_loads_a_prompt_the_engine_no_longer_holds(
    run: Any,
) -> None:
    r = run("vllm")
    r.serve(0, 1, 2, 0)
    assert r.finished == 4
    assert not r.scheduler.connector.connector_scheduler._jobs
    assert r.moved.load_jobs == 1
    assert r.moved.load_blocks == PROMPT // BLOCK


def test_vllm_sim_reports_a_store_one_step_after_it_was_planned(run: Any) -> None:
    r = run("vllm")
    r.scheduler.add_request(r.sims.new_request("r0", prompt(0), 3, r.hasher))
    r.step()  # the whole prompt in one step: its blocks are stored
    assert r.metadata[-1].store_jobs
    assert not r.sim.idle()
    output = r.step()
    assert output.kv_connector_output.kv_connector_worker_meta.completed_jobs
    assert r.sim.idle()


def test_both_sims_move_the_same_blocks_for_the_same_requests(run: Any) -> None:
    kvferry, vllm = run("kvferry"), run("vllm")
    for r in (kvferry, vllm):
        r.serve(0, 1, 2, 0, 1)
    assert kvferry.moved.load_blocks == vllm.moved.load_blocks
    assert kvferry.moved.store_blocks == vllm.moved.store_blocks


def test_without_a_connector_the_sim_reports_nothing(run: Any) -> None:
    r = run("none")
    r.scheduler.add_request(r.sims.new_request("r0", prompt(0), 3, r.hasher))
    assert r.step().kv_connector_output is None
    assert r.sim.idle()


def test_a_partial_prefill_samples_no_token(run: Any, sims: ModuleType) -> None:
    r = run("none", max_batched_tokens=128)
    r.scheduler.add_request(r.sims.new_request("r0", prompt(0), 3, r.hasher))
    assert r.step().sampled_token_ids == [[]]
    assert r.step().sampled_token_ids == [[sims.SAMPLED_TOKEN]]
