"""Jaeger's JSON trace format: the file Jaeger UI's "JSON file" upload opens.

The document is ``{"data": [trace, ...]}``; a trace is ``{"traceID", "spans",
"processes"}``; a span carries hex ids, ``startTime`` and ``duration`` in microseconds,
typed ``tags``, ``logs`` (its events), ``references`` to its parent and a ``processID``
into the trace's ``processes`` (``{"serviceName", "tags"}``). This module converts SDK
spans into it, checks a document against what the UI reads, and merges documents of
several processes by trace id. It needs no OpenTelemetry SDK at run time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan

JsonDict = dict[str, Any]

TAG_TYPES = ("string", "bool", "int64", "float64", "binary")
REF_TYPES = ("CHILD_OF", "FOLLOWS_FROM")
_TRACE_ID = re.compile(r"^[0-9a-f]{16}$|^[0-9a-f]{32}$")
_SPAN_ID = re.compile(r"^[0-9a-f]{16}$")
# Microseconds since the epoch between 2001 and 5138: catches ns or ms written as µs.
_MIN_US, _MAX_US = 10**15, 10**17


def tag(key: str, value: Any) -> JsonDict:
    """One typed Jaeger tag; sequences become their JSON text."""
    if isinstance(value, bool):
        return {"key": key, "type": "bool", "value": value}
    if isinstance(value, int):
        return {"key": key, "type": "int64", "value": value}
    if isinstance(value, float):
        return {"key": key, "type": "float64", "value": value}
    if isinstance(value, str):
        return {"key": key, "type": "string", "value": value}
    if isinstance(value, Sequence):
        return {"key": key, "type": "string", "value": json.dumps(list(value))}
    return {"key": key, "type": "string", "value": str(value)}


def process_of(resource: Resource) -> JsonDict:
    attrs = dict(resource.attributes)
    service = str(attrs.pop("service.name", "unknown_service"))
    return {"serviceName": service, "tags": [tag(k, v) for k, v in sorted(attrs.items())]}


def span_to_jaeger(span: ReadableSpan, process_id: str) -> JsonDict:
    """One SDK span as a Jaeger span dict (without its process)."""
    from opentelemetry.trace import SpanKind, StatusCode

    ctx = span.context
    assert ctx is not None
    trace_id = f"{ctx.trace_id:032x}"
    refs: list[JsonDict] = []
    if span.parent is not None:
        refs.append(
            {
                "refType": "CHILD_OF",
                "traceID": f"{span.parent.trace_id:032x}",
                "spanID": f"{span.parent.span_id:016x}",
            }
        )
    for link in span.links:
        refs.append(
            {
                "refType": "FOLLOWS_FROM",
                "traceID": f"{link.context.trace_id:032x}",
                "spanID": f"{link.context.span_id:016x}",
            }
        )
    tags = [tag(k, v) for k, v in (span.attributes or {}).items()]
    if span.kind is not SpanKind.INTERNAL:
        tags.append(tag("span.kind", span.kind.name.lower()))
    scope = span.instrumentation_scope
    if scope is not None:
        tags.append(tag("otel.scope.name", scope.name))
        if scope.version:
            tags.append(tag("otel.scope.version", scope.version))
    if span.status.status_code is not StatusCode.UNSET:
        tags.append(tag("otel.status_code", span.status.status_code.name))
    if span.status.status_code is StatusCode.ERROR:
        tags.append(tag("error", True))  # what Jaeger UI colours red
        if span.status.description:
            tags.append(tag("otel.status_description", span.status.description))
    logs = [
        {
            "timestamp": ev.timestamp // 1000,
            "fields": [tag("event", ev.name)]
            + [tag(k, v) for k, v in (ev.attributes or {}).items()],
        }
        for ev in span.events
    ]
    start = span.start_time or 0
    end = span.end_time or start
    return {
        "traceID": trace_id,
        "spanID": f"{ctx.span_id:016x}",
        "operationName": span.name,
        "references": refs,
        "flags": int(ctx.trace_flags),
        "startTime": start // 1000,
        "duration": max(end - start, 0) // 1000,
        "tags": tags,
        "logs": logs,
        "processID": process_id,
        "warnings": None,
    }


def document(
    traces: Mapping[str, Iterable[JsonDict]], processes: Mapping[str, JsonDict]
) -> JsonDict:
    """A Jaeger document of span dicts grouped by trace id, sharing ``processes``."""
    data = []
    for trace_id, spans in traces.items():
        spans = list(spans)
        used = {s["processID"] for s in spans}
        data.append(
            {
                "traceID": trace_id,
                "spans": spans,
                "processes": {p: processes[p] for p in sorted(used)},
                "warnings": None,
            }
        )
    return {"data": data, "total": 0, "limit": 0, "offset": 0, "errors": None}


def merge_documents(docs: Iterable[JsonDict]) -> JsonDict:
    """Merge documents (one per process) into one: spans grouped by trace id.

    Process ids are renumbered (``p1``, ``p2``...) because each file starts at ``p1``;
    identical processes share one id; a span seen twice (same trace and span id) is kept
    once.
    """
    processes: dict[str, JsonDict] = {}
    by_key: dict[str, str] = {}
    traces: dict[str, list[JsonDict]] = {}
    seen: set[tuple[str, str]] = set()
    for doc in docs:
        for tr in doc.get("data", []):
            local: dict[str, str] = {}
            for pid, proc in tr.get("processes", {}).items():
                key = json.dumps(proc, sort_keys=True)
                if key not in by_key:
                    by_key[key] = f"p{len(by_key) + 1}"
                    processes[by_key[key]] = proc
                local[pid] = by_key[key]
            for span in tr.get("spans", []):
                ident = (span["traceID"], span["spanID"])
                if ident in seen:
                    continue
                seen.add(ident)
                span = dict(span, processID=local.get(span.get("processID", ""), "p0"))
                traces.setdefault(span["traceID"], []).append(span)
    if any(s["processID"] == "p0" for spans in traces.values() for s in spans):
        processes["p0"] = {"serviceName": "unknown_service", "tags": []}
    return document(traces, processes)


def _check_tag(where: str, t: Any) -> list[str]:
    if not isinstance(t, dict) or not isinstance(t.get("key"), str) or not t["key"]:
        return [f"{where}: a tag needs a non-empty 'key'"]
    typ, value = t.get("type"), t.get("value")
    ok = {
        "string": isinstance(value, str),
        "bool": isinstance(value, bool),
        "int64": isinstance(value, int) and not isinstance(value, bool),
        "float64": isinstance(value, int | float) and not isinstance(value, bool),
        "binary": isinstance(value, str),
    }.get(typ if isinstance(typ, str) else "", False)
    return [] if ok else [f"{where}: tag {t['key']!r} has type {typ!r} and value {value!r}"]


def _check_time(where: str, key: str, value: Any) -> list[str]:
    if not isinstance(value, int) or isinstance(value, bool) or not _MIN_US <= value < _MAX_US:
        return [f"{where}: '{key}' must be microseconds since the epoch, got {value!r}"]
    return []


def check_document(doc: Any) -> list[str]:
    """What Jaeger UI's JSON upload would trip on in ``doc``; empty when it opens it.

    Checks the fields the UI reads: hex trace and span ids, operation names, µs start
    times and durations, typed tags, logs, references and each span's process (with a
    service name).
    """
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        return ["the document must be an object with a 'data' list of traces"]
    problems: list[str] = []
    for i, tr in enumerate(doc["data"]):
        where = f"data[{i}]"
        if not isinstance(tr, dict):
            problems.append(f"{where}: a trace must be an object")
            continue
        trace_id = tr.get("traceID")
        if not isinstance(trace_id, str) or not _TRACE_ID.match(trace_id):
            problems.append(f"{where}: 'traceID' must be 16 or 32 lowercase hex digits")
        procs = tr.get("processes")
        if not isinstance(procs, dict):
            problems.append(f"{where}: 'processes' must be an object")
            procs = {}
        for pid, proc in procs.items():
            if (
                not isinstance(proc, dict)
                or not isinstance(proc.get("serviceName"), str)
                or not proc["serviceName"]
            ):
                problems.append(f"{where}.processes.{pid}: needs a non-empty 'serviceName'")
            else:
                for t in proc.get("tags", []):
                    problems += _check_tag(f"{where}.processes.{pid}", t)
        spans = tr.get("spans")
        if not isinstance(spans, list) or not spans:
            problems.append(f"{where}: 'spans' must be a non-empty list")
            continue
        ids = set()
        for j, s in enumerate(spans):
            sw = f"{where}.spans[{j}]"
            if not isinstance(s, dict):
                problems.append(f"{sw}: a span must be an object")
                continue
            if s.get("traceID") != trace_id:
                problems.append(f"{sw}: 'traceID' differs from its trace's")
            span_id = s.get("spanID")
            if not isinstance(span_id, str) or not _SPAN_ID.match(span_id):
                problems.append(f"{sw}: 'spanID' must be 16 lowercase hex digits")
            elif span_id in ids:
                problems.append(f"{sw}: 'spanID' {span_id} appears twice")
            ids.add(span_id)
            if not isinstance(s.get("operationName"), str) or not s["operationName"]:
                problems.append(f"{sw}: needs a non-empty 'operationName'")
            problems += _check_time(sw, "startTime", s.get("startTime"))
            dur = s.get("duration")
            if not isinstance(dur, int) or isinstance(dur, bool) or dur < 0:
                problems.append(f"{sw}: 'duration' must be whole microseconds >= 0")
            if s.get("processID") not in procs:
                problems.append(f"{sw}: 'processID' {s.get('processID')!r} is not in 'processes'")
            for r in s.get("references", []) if isinstance(s.get("references"), list) else [None]:
                if (
                    not isinstance(r, dict)
                    or r.get("refType") not in REF_TYPES
                    or not _TRACE_ID.match(str(r.get("traceID")))
                    or not _SPAN_ID.match(str(r.get("spanID")))
                ):
                    problems.append(f"{sw}: a reference needs refType {REF_TYPES}, traceID, spanID")
            for t in s.get("tags", []) if isinstance(s.get("tags"), list) else [None]:
                problems += _check_tag(sw, t)
            for log in s.get("logs", []) if isinstance(s.get("logs"), list) else [None]:
                if not isinstance(log, dict) or not isinstance(log.get("fields"), list):
                    problems.append(f"{sw}: a log needs 'timestamp' and a 'fields' list")
                    continue
                problems += _check_time(f"{sw}.logs", "timestamp", log.get("timestamp"))
                for t in log["fields"]:
                    problems += _check_tag(f"{sw}.logs", t)
    return problems
