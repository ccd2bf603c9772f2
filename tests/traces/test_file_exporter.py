"""The file exporter writes what Jaeger UI's JSON upload opens; summarize reads it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvferry.traces import (
    SPAN_COPY,
    SPAN_LOAD,
    SPAN_LOOKUP,
    SPAN_REQUEST,
    SchedulerTracer,
    check_document,
    merge_documents,
    setup,
    summarize,
)
from kvferry.traces.__main__ import main

# The worker half, in a real second process: its own provider and its own file.
WORKER = """
import sys, time
from kvferry.traces import WorkerTracer, setup
provider = setup({"file": sys.argv[1], "otlp": False}, role="worker", environ={})
w = WorkerTracer(provider, rank=0)
for tp, job_id in zip(sys.argv[2::2], sys.argv[3::2]):
    end = time.time_ns()
    w.record_copy(tp, job_id=int(job_id), direction="load", nbytes=4_000_000, blocks=2,
                  start_ns=end - 2_000_000, end_ns=end, queued_ns=end - 3_000_000)
provider.shutdown()
"""


def play_requests(sched: SchedulerTracer, n: int) -> list[tuple[str, int]]:
    """n requests that each hit, load and store; the load jobs' (traceparent, id)."""
    loads = []
    for i in range(n):
        rid = f"req-{i}"
        sched.request_started(rid)
        sched.lookup(rid, tokens_asked=512, tokens_hit=256, start_ns=time.time_ns())
        tp = sched.job_planned(rid, 2 * i + 1, direction="load", blocks=2, tokens=256)
        assert tp is not None
        loads.append((tp, 2 * i + 1))
        sched.job_planned(rid, 2 * i + 2, direction="store", blocks=2, tokens=256)
        sched.failed(reason="rejected", req_id=rid, job_id=2 * i + 2)
    return loads


def finish_requests(sched: SchedulerTracer, n: int) -> None:
    for i in range(n):
        sched.job_ended(2 * i + 1, ok=True)
        sched.job_ended(2 * i + 2, ok=i != 1, error="copy failed" if i == 1 else None)
        sched.request_finished(f"req-{i}")


@pytest.fixture(scope="module")
def two_process_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Three requests traced by this process (scheduler) and a child process (worker);
    written once for the module (the tests only read the files)."""
    tmp_path = tmp_path_factory.mktemp("two-processes")
    sched_file, worker_file = tmp_path / "sched.json", tmp_path / "worker.json"
    provider = setup({"file": str(sched_file)}, role="scheduler", environ={})
    assert provider is not None
    sched = SchedulerTracer(provider)
    loads = play_requests(sched, 3)
    args = [str(worker_file)] + [x for tp, job in loads for x in (tp, str(job))]
    subprocess.run(
        [sys.executable, "-c", WORKER, *args],
        check=True,
        timeout=120,
        env=dict(os.environ, OTEL_TRACES_EXPORTER="none"),
    )
    finish_requests(sched, 3)
    assert provider.force_flush()
    provider.shutdown()
    return sched_file, worker_file


def test_each_process_file_validates_against_jaeger_json(
    two_process_files: tuple[Path, Path],
) -> None:
    for path in two_process_files:
        doc = json.loads(path.read_text())
        assert check_document(doc) == []
    sched = json.loads(two_process_files[0].read_text())
    assert len(sched["data"]) == 3  # one trace per request
    tr = sched["data"][0]
    assert tr["processes"]["p1"]["serviceName"] == "kvferry"
    assert {"key": "kvferry.role", "type": "string", "value": "scheduler"} in tr["processes"]["p1"][
        "tags"
    ]
    names = {s["operationName"] for s in tr["spans"]}
    assert names == {SPAN_REQUEST, SPAN_LOOKUP, SPAN_LOAD, "store kv_blocks"}


def test_merged_files_join_worker_copies_to_their_jobs(
    two_process_files: tuple[Path, Path],
) -> None:
    doc = merge_documents(json.loads(p.read_text()) for p in two_process_files)
    assert check_document(doc) == []
    assert len(doc["data"]) == 3
    for tr in doc["data"]:
        spans = {s["spanID"]: s for s in tr["spans"]}
        (copy,) = [s for s in spans.values() if s["operationName"] == SPAN_COPY]
        (ref,) = copy["references"]
        job = spans[ref["spanID"]]
        assert ref["refType"] == "CHILD_OF" and job["operationName"] == SPAN_LOAD
        root = spans[job["references"][0]["spanID"]]
        assert root["operationName"] == SPAN_REQUEST and root["references"] == []
        services = {tr["processes"][s["processID"]]["serviceName"] for s in tr["spans"]}
        roles = {
            t["value"]
            for p in tr["processes"].values()
            for t in p["tags"]
            if t["key"] == "kvferry.role"
        }
        assert services == {"kvferry"} and roles == {"scheduler", "worker"}


def test_jaeger_fields_are_typed_and_in_microseconds(two_process_files: tuple[Path, Path]) -> None:
    doc = json.loads(two_process_files[0].read_text())
    spans = [s for tr in doc["data"] for s in tr["spans"]]
    store_failed = [
        s for s in spans if {"key": "error", "type": "bool", "value": True} in s["tags"]
    ]
    assert len(store_failed) == 1 and store_failed[0]["operationName"] == "store kv_blocks"
    logs = [log["fields"] for s in spans for log in s["logs"]]
    assert any(
        {"key": "event", "type": "string", "value": "failed"} in fields
        and {"key": "kvferry.reason", "type": "string", "value": "rejected"} in fields
        for fields in logs
    )
    now_us = time.time_ns() // 1000
    assert all(now_us - 600_000_000 < s["startTime"] <= now_us for s in spans)
    load = next(s for s in spans if s["operationName"] == SPAN_LOAD)
    assert {"key": "kvferry.job_id", "type": "int64", "value": 1} in load["tags"]


def test_summarize_reads_the_files(
    two_process_files: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["summarize", *map(str, two_process_files)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("3 traces, 15 spans")
    assert out.count("request req-") == 3
    assert "[kvferry/scheduler, kvferry/worker]" in out
    # The tree: the copy is indented under its load job, under the journey.
    timeline = out.split("\n\n")[1].splitlines()
    indent = {
        name: line.index(name)
        for line in timeline
        for name in (SPAN_REQUEST + "  ", SPAN_LOAD, SPAN_COPY)
        if name in line
    }
    assert indent[SPAN_REQUEST + "  "] + 2 == indent[SPAN_LOAD] == indent[SPAN_COPY] - 2
    for header in ("span", "wait", "throughput"):
        assert any(line.startswith(header) and "p50" in line for line in out.splitlines())
    copy_row = next(line for line in out.splitlines() if line.startswith(SPAN_COPY))
    assert copy_row.split()[2] == "3"  # count
    gbps_row = next(line for line in out.splitlines() if line.startswith("copy load"))
    assert float(gbps_row.split()[3]) == pytest.approx(2.0)  # 4 MB in 2 ms


def test_summarize_one_request(two_process_files: tuple[Path, Path]) -> None:
    docs = [json.loads(p.read_text()) for p in two_process_files]
    out = summarize(docs, request_id="req-1")
    assert out.count("request req-") == 1 and "ERROR copy failed" in out


def test_merge_command_writes_one_file_jaeger_opens(
    two_process_files: tuple[Path, Path], tmp_path: Path
) -> None:
    out = tmp_path / "merged.json"
    assert main(["merge", *map(str, two_process_files), "-o", str(out)]) == 0
    assert main(["check", str(out)]) == 0
    assert len(json.loads(out.read_text())["data"]) == 3


def test_checker_reports_what_jaeger_ui_would_trip_on(two_process_files: tuple[Path, Path]) -> None:
    doc = json.loads(two_process_files[0].read_text())
    span: dict[str, Any] = doc["data"][0]["spans"][0]
    span["startTime"] *= 1000  # nanoseconds written as microseconds
    span["spanID"] = "XYZ"
    span["processID"] = "p9"
    span["tags"].append({"key": "n", "type": "int64", "value": "7"})
    problems = check_document(doc)
    assert len(problems) == 4
    for what in ("startTime", "spanID", "processID", "tag 'n'"):
        assert any(what in p for p in problems), (what, problems)
    assert check_document({"traces": []}) == [
        "the document must be an object with a 'data' list of traces"
    ]


def test_check_command_fails_on_a_bad_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"data": [{"traceID": "1", "spans": [], "processes": {}}]}')
    assert main(["check", str(bad)]) == 1
    assert "traceID" in capsys.readouterr().out
    bad.write_text("not json")
    assert main(["summarize", str(bad)]) == 2


@pytest.mark.parametrize("command", ["summarize", "merge"])
@pytest.mark.parametrize("content", ["[]", '{"data": [{"spans": [{}]}]}'])
def test_summarize_and_merge_refuse_json_that_is_not_a_trace_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, content: str
) -> None:
    path = tmp_path / "t.json"
    path.write_text(content)
    out = tmp_path / "merged.json"
    assert main([command, str(path), *(["-o", str(out)] if command == "merge" else [])]) == 2
    assert capsys.readouterr().err.startswith(f"error: {path}: not a Jaeger trace file: ")
    assert not out.exists()


def test_merge_into_a_path_that_cannot_be_written_fails(
    two_process_files: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "no-such-dir" / "merged.json"
    assert main(["merge", *map(str, two_process_files), "-o", str(out)]) == 2
    assert capsys.readouterr().err == f"error: cannot write {out}: No such file or directory\n"


def test_spans_are_written_at_flush_not_only_at_exit(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    provider = setup({"file": str(path)}, environ={})
    assert provider is not None
    sched = SchedulerTracer(provider)
    sched.request_started("r")
    sched.request_finished("r")
    assert provider.force_flush()
    first = json.loads(path.read_text())
    assert [s["operationName"] for tr in first["data"] for s in tr["spans"]] == [SPAN_REQUEST]
    sched.request_started("r2")
    sched.request_finished("r2")
    assert provider.force_flush()
    assert len(json.loads(path.read_text())["data"]) == 2
    provider.shutdown()
