"""Traces end to end: vLLM (CPU) with kvferry exporting over OTLP/HTTP to an in-process
receiver that decodes the protobuf. A request that hits has one trace: its kvferry
journey, with lookup and load spans from the scheduler process and the copy span from
the worker process joined under the load span."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvferry.testing import OTLPReceiver, ReceivedSpan, close_engine, engine_args, long_doc_prompts
from kvferry.traces import SPAN_COPY, SPAN_LOAD, SPAN_LOOKUP, SPAN_REQUEST, SPAN_STORE

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver() as rx:
        yield rx


def run(model: Path, traces: dict[str, object] | None, docs: list[list[int]]) -> list[list[int]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kvferry: dict[str, object] = {"cpu_bytes_to_use": 32 << 20}
    if traces is not None:
        kvferry["traces"] = traces
    llm = LLM(**engine_args(model, kvferry=kvferry, enforce_eager=True))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = []
    for doc in docs:
        [out] = llm.generate([TokensPrompt(prompt_token_ids=doc)], params, use_tqdm=False)
        outs.append(list(out.outputs[0].token_ids))
        llm.reset_prefix_cache()  # the next identical prompt must come from kvferry
    close_engine(llm)  # flushes the exporters of both processes
    return outs


def test_a_request_that_hit_has_one_trace_across_processes(
    tiny_model: Path, receiver: OTLPReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    [doc] = long_doc_prompts(1, 600, seed=21)
    reference = run(tiny_model, None, [doc])
    outs = run(tiny_model, {"otlp": receiver.endpoint, "service_name": "kvferry-e2e"}, [doc, doc])
    assert outs == reference * 2

    def has_copy_of_load(spans: list[ReceivedSpan]) -> bool:
        return any(
            s.name == SPAN_COPY and s.attributes.get("kvferry.direction") == "load" for s in spans
        )

    receiver.wait_for(has_copy_of_load, timeout=60)
    traces = receiver.traces()
    hit_traces = [t for t in traces.values() if any(s.name == SPAN_LOAD for s in t)]
    assert len(hit_traces) == 1  # only the second request hit, and it has exactly one trace
    spans = hit_traces[0]
    by_id = {s.span_id: s for s in spans}
    [root] = [s for s in spans if s.name == SPAN_REQUEST]
    assert root.parent_span_id is None
    [lookup] = [s for s in spans if s.name == SPAN_LOOKUP]
    [load] = [s for s in spans if s.name == SPAN_LOAD]
    [copy] = [s for s in spans if s.name == SPAN_COPY]
    assert lookup.parent_span_id == root.span_id
    assert load.parent_span_id == root.span_id
    assert copy.parent_span_id == load.span_id and by_id[copy.parent_span_id] is load
    # lookup and load come from the scheduler process, the copy from the worker process
    assert root.resource.get("kvferry.role") == "scheduler"
    assert copy.resource.get("kvferry.role") == "worker"
    assert copy.attributes["kvferry.bytes"] > 0
    assert load.status_code != "ERROR"
    # the first request stored its blocks: a store span with its worker copy
    first = [t for t in traces.values() if any(s.name == SPAN_STORE for s in t)]
    assert first and any(s.name == SPAN_COPY for s in first[0])
