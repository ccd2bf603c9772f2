"""setup() exports over OTLP/HTTP; the in-process receiver decodes the protobuf."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from kvferry.traces import (
    SPAN_COPY,
    SPAN_LOAD,
    SPAN_LOOKUP,
    SPAN_REQUEST,
    SchedulerTracer,
    setup,
)
from kvferry.traces._testing import OTLPReceiver, decode_request

# A worker process that learns where to export from the environment only.
WORKER = """
import sys, time
from kvferry.traces import WorkerTracer, setup
provider = setup(role="worker")
assert provider is not None, "OTEL_* variables did not turn tracing on"
end = time.time_ns()
WorkerTracer(provider, rank=0).record_copy(
    sys.argv[1], job_id=1, direction="load", nbytes=1_000_000, blocks=2,
    start_ns=end - 1_000_000, end_ns=end)
provider.shutdown()
"""


@pytest.fixture
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver() as rx:
        yield rx


def test_setup_otlp_http_exports_spans_the_receiver_decodes(receiver: OTLPReceiver) -> None:
    provider = setup(
        {"otlp": receiver.endpoint, "service_name": "kvferry-test"}, role="scheduler", environ={}
    )
    assert provider is not None
    sched = SchedulerTracer(provider)
    sched.request_started("r1")
    sched.lookup("r1", tokens_asked=512, tokens_hit=256)
    sched.job_planned("r1", 1, direction="load", blocks=2, tokens=256)
    sched.job_ended(1, ok=False, error="boom")
    sched.request_finished("r1")
    # force_flush returns once the export was answered, so the spans are stored.
    assert provider.force_flush()
    spans = {s.name: s for s in receiver.spans()}
    assert set(spans) == {SPAN_REQUEST, SPAN_LOOKUP, SPAN_LOAD}
    root, lookup, load = spans[SPAN_REQUEST], spans[SPAN_LOOKUP], spans[SPAN_LOAD]
    assert root.parent_span_id is None
    assert lookup.parent_span_id == load.parent_span_id == root.span_id
    assert len({s.trace_id for s in spans.values()}) == 1
    assert load.attributes["kvferry.job_id"] == 1
    assert load.status_code == "ERROR" and load.status_message == "boom"
    assert load.events == (("failed", {"kvferry.reason": "boom", "kvferry.workers_failed": 0}),)
    assert root.service_name == "kvferry-test"
    assert root.resource["kvferry.role"] == "scheduler"
    assert root.start_ns <= lookup.start_ns <= lookup.end_ns <= root.end_ns
    provider.shutdown()


def test_a_worker_process_joins_the_trace_through_otel_variables(receiver: OTLPReceiver) -> None:
    provider = setup({"otlp": receiver.endpoint}, role="scheduler", environ={})
    assert provider is not None
    sched = SchedulerTracer(provider)
    tp = sched.job_planned("r1", 1, direction="load", blocks=2, tokens=256)
    assert tp is not None
    env = dict(
        os.environ,
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.base_endpoint,
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
    )
    env.pop("OTEL_TRACES_EXPORTER", None)
    env.pop("OTEL_SDK_DISABLED", None)
    subprocess.run([sys.executable, "-c", WORKER, tp], check=True, env=env, timeout=120)
    sched.job_ended(1, ok=True)
    sched.request_finished("r1")
    provider.shutdown()
    # The worker's spans came from another process: wait on the receiver, not a sleep.
    spans = receiver.wait_for(lambda ss: {s.name for s in ss} >= {SPAN_COPY, SPAN_REQUEST})
    by_name = {s.name: s for s in spans}
    copy, load = by_name[SPAN_COPY], by_name[SPAN_LOAD]
    assert copy.trace_id == load.trace_id == by_name[SPAN_REQUEST].trace_id
    assert copy.parent_span_id == load.span_id
    assert copy.resource["kvferry.role"] == "worker"
    assert copy.resource["process.pid"] != load.resource["process.pid"]
    assert copy.attributes["kvferry.gb_per_s"] == pytest.approx(1.0)
    assert set(receiver.traces()) == {load.trace_id}


def test_receiver_accepts_gzip_and_rejects_garbage(receiver: OTLPReceiver) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    body = ExportTraceServiceRequest().SerializeToString()

    def post(data: bytes, path: str = "/v1/traces", **headers: str) -> int:
        req = urllib.request.Request(
            receiver.base_endpoint + path,
            data=data,
            method="POST",
            headers={"Content-Type": "application/x-protobuf", **headers},
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    assert post(gzip.compress(body), **{"Content-Encoding": "gzip"}) == 200
    assert post(b"\xff\xff not protobuf") == 400
    assert post(body, path="/v1/metrics") == 404
    assert receiver.requests == 1 and len(receiver.errors) == 1
    with pytest.raises(TimeoutError, match="0 spans received"):
        receiver.wait_for(lambda ss: bool(ss), timeout=0.01)


def test_decode_request_reads_otlp_json() -> None:
    body = (
        b'{"resourceSpans":[{"resource":{"attributes":[{"key":"service.name",'
        b'"value":{"stringValue":"s"}}]},"scopeSpans":[{"spans":[{"traceId":'
        b'"5B8EFFF798038103D269B633813FC60C","spanId":"EEE19B7EC3C1B174","name":"x",'
        b'"startTimeUnixNano":"1","endTimeUnixNano":"2","attributes":[{"key":"k",'
        b'"value":{"intValue":"3"}}]}]}]}]}'
    )
    (span,) = decode_request(body, "application/json")
    assert (span.name, span.service_name, span.attributes, span.parent_span_id) == (
        "x",
        "s",
        {"k": 3},
        None,
    )
    assert (span.trace_id, span.span_id) == ("5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174")
