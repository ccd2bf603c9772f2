"""The span API the connector calls: a journey per request, a span per job, worker copies."""

from __future__ import annotations

import pickle
import time

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import StatusCode

import kvferry.traces
from kvferry.traces import (
    EVENT_FAILED,
    SPAN_COPY,
    SPAN_LOAD,
    SPAN_LOOKUP,
    SPAN_REQUEST,
    SPAN_STORE,
    SchedulerTracer,
    WorkerTracer,
    parse_traceparent,
)

from .conftest import Recorder


def test_public_api_is_pinned() -> None:
    assert sorted(kvferry.traces.__all__) == [
        "EVENT_FAILED",
        "KEYS",
        "SPAN_COPY",
        "SPAN_LOAD",
        "SPAN_LOOKUP",
        "SPAN_REQUEST",
        "SPAN_STORE",
        "SchedulerTracer",
        "TracesConfig",
        "WorkerTracer",
        "check_document",
        "format_traceparent",
        "get_tracer",
        "merge_documents",
        "parse_traceparent",
        "resolve_config",
        "setup",
        "summarize",
    ]


def test_span_names_are_verb_object_and_low_cardinality() -> None:
    for name in (SPAN_LOOKUP, SPAN_LOAD, SPAN_STORE, SPAN_COPY):
        verb, obj = name.split(" ")
        assert verb.isalpha() and obj == "kv_blocks"
    assert SPAN_REQUEST == "kvferry"


def test_journey_has_lookup_load_and_store_as_children(
    sched: SchedulerTracer, sched_rec: Recorder
) -> None:
    sched.request_started("req-1")
    t0 = time.time_ns()
    sched.lookup("req-1", tokens_asked=512, tokens_hit=256, tokens_local=128, start_ns=t0)
    tp_load = sched.job_planned("req-1", 1, direction="load", blocks=2, tokens=256)
    tp_store = sched.job_planned("req-1", 2, direction="store", blocks=1, tokens=128)
    assert tp_load and tp_store and tp_load != tp_store
    sched.job_ended(1, ok=True)
    sched.job_ended(2, ok=True)
    sched.request_finished("req-1")

    root = sched_rec.one(SPAN_REQUEST)
    lookup, load, store = (
        sched_rec.one(SPAN_LOOKUP),
        sched_rec.one(SPAN_LOAD),
        sched_rec.one(SPAN_STORE),
    )
    assert root.parent is None
    for child in (lookup, load, store):
        assert child.parent is not None and child.parent.span_id == root.context.span_id
        assert child.context.trace_id == root.context.trace_id
        assert child.status.status_code is StatusCode.UNSET
    assert lookup.start_time == t0
    assert dict(lookup.attributes) == {
        "kvferry.request_id": "req-1",
        "kvferry.tokens_asked": 512,
        "kvferry.tokens_hit": 256,
        "kvferry.tokens_local": 128,
    }
    assert dict(load.attributes) == {
        "kvferry.request_id": "req-1",
        "kvferry.job_id": 1,
        "kvferry.direction": "load",
        "kvferry.blocks": 2,
        "kvferry.tokens": 256,
    }
    assert store.attributes["kvferry.direction"] == "store"
    assert root.attributes["kvferry.request_id"] == "req-1"
    assert root.attributes["kvferry.tokens_hit"] == 256
    assert root.attributes["kvferry.tokens_loaded"] == 256
    assert root.attributes["kvferry.tokens_stored"] == 128
    assert root.attributes["kvferry.failed_jobs"] == 0
    assert sched.open_spans() == 0


def test_each_request_is_its_own_trace(sched: SchedulerTracer, sched_rec: Recorder) -> None:
    for rid in ("a", "b"):
        sched.request_started(rid)
        sched.request_finished(rid)
    roots = sched_rec.spans(SPAN_REQUEST)
    assert len({r.context.trace_id for r in roots}) == 2


def test_journey_outlives_finish_until_its_last_job_ends(
    sched: SchedulerTracer, sched_rec: Recorder
) -> None:
    sched.request_started("r")
    sched.job_planned("r", 7, direction="store", blocks=4, tokens=512)
    sched.request_finished("r")
    assert sched_rec.spans(SPAN_REQUEST) == []  # the store still reads its blocks
    sched.job_ended(7, ok=True)
    root = sched_rec.one(SPAN_REQUEST)
    assert root.end_time >= sched_rec.one(SPAN_STORE).end_time


def test_a_request_first_seen_at_lookup_or_planning_gets_a_journey(
    sched: SchedulerTracer, sched_rec: Recorder
) -> None:
    sched.lookup("late", tokens_asked=10, tokens_hit=0)
    sched.job_planned("later", 1, direction="store", blocks=1, tokens=16)
    sched.job_ended(1, ok=True)
    sched.request_finished("late")
    sched.request_finished("later")
    assert {r.attributes["kvferry.request_id"] for r in sched_rec.spans(SPAN_REQUEST)} == {
        "late",
        "later",
    }
    assert sched.open_spans() == 0


def test_unknown_ids_are_ignored(sched: SchedulerTracer, sched_rec: Recorder) -> None:
    sched.job_ended(99, ok=False)
    sched.request_finished("nobody")
    sched.failed(reason="x", req_id="nobody", job_id=99)
    assert sched_rec.spans() == []


def test_traceparent_across_a_process_boundary_parents_the_copy_span(
    sched: SchedulerTracer, sched_rec: Recorder, worker_rec: Recorder
) -> None:
    sched.request_started("req-1")
    tp = sched.job_planned("req-1", 3, direction="load", blocks=2, tokens=256)
    # What crosses to the worker: the string inside pickled job metadata.
    carried = pickle.loads(pickle.dumps({"job_id": 3, "traceparent": tp}))

    worker = WorkerTracer(worker_rec.provider, rank=1)  # another provider: another process
    start = time.time_ns()
    worker.record_copy(
        carried["traceparent"],
        job_id=3,
        direction="load",
        nbytes=2_000_000,
        blocks=2,
        start_ns=start,
        end_ns=start + 1_000_000,
        queued_ns=start - 500_000,
    )
    sched.job_ended(3, ok=True)
    sched.request_finished("req-1")

    job = sched_rec.one(SPAN_LOAD)
    copy = worker_rec.one(SPAN_COPY)
    assert copy.context.trace_id == job.context.trace_id
    assert copy.parent is not None and copy.parent.span_id == job.context.span_id
    assert copy.parent.is_remote
    assert (copy.start_time, copy.end_time) == (start, start + 1_000_000)
    assert dict(copy.attributes) == {
        "kvferry.job_id": 3,
        "kvferry.direction": "load",
        "kvferry.bytes": 2_000_000,
        "kvferry.blocks": 2,
        "kvferry.gb_per_s": 2.0,
        "kvferry.rank": 1,
        "kvferry.queue_wait_s": 0.0005,
    }


def test_traceparent_is_w3c(sched: SchedulerTracer, sched_rec: Recorder) -> None:
    tp = sched.job_planned("r", 1, direction="load", blocks=1, tokens=1)
    assert tp is not None
    version, trace_id, span_id, flags = tp.split("-")
    assert (version, len(trace_id), len(span_id), len(flags)) == ("00", 32, 16, 2)
    assert int(flags, 16) & 1  # sampled (the SDK may also set 0x02, "random trace id")
    assert parse_traceparent(tp) is not None
    assert parse_traceparent("00-zz-yy-01") is None
    sched.close_all()


def test_failed_job_has_error_status_and_a_failed_event(
    sched: SchedulerTracer, sched_rec: Recorder
) -> None:
    sched.request_started("r")
    sched.job_planned("r", 1, direction="load", blocks=2, tokens=256)
    sched.job_ended(1, ok=False, error="copy thread died", workers_failed=1)
    sched.request_finished("r")
    job = sched_rec.one(SPAN_LOAD)
    assert job.status.status_code is StatusCode.ERROR
    assert job.status.description == "copy thread died"
    (ev,) = job.events
    assert ev.name == EVENT_FAILED
    assert dict(ev.attributes) == {
        "kvferry.reason": "copy thread died",
        "kvferry.workers_failed": 1,
    }
    root = sched_rec.one(SPAN_REQUEST)
    assert root.attributes["kvferry.failed_jobs"] == 1
    assert root.attributes["kvferry.tokens_loaded"] == 0


def test_failed_copy_has_error_status(
    worker: WorkerTracer, worker_rec: Recorder, sched: SchedulerTracer
) -> None:
    tp = sched.job_planned("r", 1, direction="store", blocks=1, tokens=1)
    worker.record_copy(
        tp,
        job_id=1,
        direction="store",
        nbytes=0,
        blocks=1,
        start_ns=10**18,
        end_ns=10**18,
        ok=False,
        error="boom",
    )
    copy = worker_rec.one(SPAN_COPY)
    assert copy.status.status_code is StatusCode.ERROR
    assert [e.name for e in copy.events] == [EVENT_FAILED]
    assert copy.attributes["kvferry.gb_per_s"] == 0.0
    sched.close_all()


def test_a_failure_goes_on_the_job_it_concerns_else_on_the_journey(
    sched: SchedulerTracer, sched_rec: Recorder
) -> None:
    sched.request_started("r")
    sched.job_planned("r", 1, direction="store", blocks=4, tokens=512)
    sched.failed(reason="invariant", req_id="r", job_id=1)
    sched.job_ended(1, ok=True)
    sched.failed(reason="store rejected: host tier full", req_id="r", job_id=1)  # job ended
    sched.request_finished("r")
    store, root = sched_rec.one(SPAN_STORE), sched_rec.one(SPAN_REQUEST)
    assert [(e.name, dict(e.attributes)) for e in store.events] == [
        (EVENT_FAILED, {"kvferry.reason": "invariant"})
    ]
    assert [(e.name, e.attributes["kvferry.reason"]) for e in root.events] == [
        (EVENT_FAILED, "store rejected: host tier full"),
    ]


def test_close_all_ends_every_open_span(sched: SchedulerTracer, sched_rec: Recorder) -> None:
    sched.request_started("a")
    sched.job_planned("a", 1, direction="load", blocks=1, tokens=1)
    sched.job_planned("b", 2, direction="store", blocks=1, tokens=1)
    sched.request_finished("a")  # waits for job 1
    assert sched.open_spans() == 4
    sched.close_all()
    assert sched.open_spans() == 0
    spans = sched_rec.spans()
    assert len(spans) == 4
    assert all(
        s.end_time is not None and s.attributes["kvferry.unfinished"] == "shutdown" for s in spans
    )
    sched.close_all()  # idempotent
    assert len(sched_rec.spans()) == 4


def test_a_reused_job_id_ends_the_first_span(sched: SchedulerTracer, sched_rec: Recorder) -> None:
    sched.job_planned("r", 1, direction="store", blocks=1, tokens=1)
    sched.job_planned("r", 1, direction="store", blocks=1, tokens=1)
    (first,) = sched_rec.spans(SPAN_STORE)
    assert first.status.description == "job id reused"
    sched.close_all()


def test_journey_joins_the_incoming_trace_of_the_request(
    sched: SchedulerTracer, sched_rec: Recorder
) -> None:
    incoming = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    sched.request_started("r", trace_headers={"traceparent": incoming})
    sched.request_finished("r")
    root = sched_rec.one(SPAN_REQUEST)
    assert f"{root.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
    assert root.parent is not None and f"{root.parent.span_id:016x}" == "b7ad6b7169203331"


def test_unsampled_jobs_carry_no_traceparent_and_workers_record_nothing(
    worker_rec: Recorder,
) -> None:
    provider = TracerProvider(sampler=ALWAYS_OFF, shutdown_on_exit=False)
    sched = SchedulerTracer(provider)
    assert sched.enabled
    tp = sched.job_planned("r", 1, direction="load", blocks=1, tokens=1)
    assert tp is None
    WorkerTracer(worker_rec.provider).record_copy(
        tp, job_id=1, direction="load", nbytes=1, blocks=1, start_ns=1, end_ns=2
    )
    assert worker_rec.spans() == []
    sched.close_all()
    provider.shutdown()


def test_malformed_traceparent_records_nothing(worker: WorkerTracer, worker_rec: Recorder) -> None:
    worker.record_copy(
        "garbage", job_id=1, direction="load", nbytes=1, blocks=1, start_ns=1, end_ns=2
    )
    assert worker_rec.spans() == []


def test_repeated_lookups_are_counted_and_the_last_hit_kept(
    sched: SchedulerTracer, sched_rec: Recorder
) -> None:
    # vLLM looks a waiting request up again on every step it cannot be scheduled.
    sched.lookup("r", tokens_asked=512, tokens_hit=256)
    sched.lookup("r", tokens_asked=512, tokens_hit=384)
    sched.request_finished("r")
    assert len(sched_rec.spans(SPAN_LOOKUP)) == 2
    root = sched_rec.one(SPAN_REQUEST)
    assert (root.attributes["kvferry.lookups"], root.attributes["kvferry.tokens_hit"]) == (2, 384)
