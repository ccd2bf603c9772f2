"""A terminal summary of Jaeger JSON trace files: timelines and latency percentiles.

Files of several processes (the scheduler's and each worker's) are merged by trace id
first, so a request's timeline shows its lookup, its jobs and the workers' copies
together.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs

from ._jaeger import JsonDict, check_document, merge_documents
from ._spans import SPAN_COPY, SPAN_REQUEST

# Tags worth a column in a timeline, in this order (without the "kvferry." prefix).
_SHOWN = (
    "request_id", "job_id", "rank", "lookups", "tokens_asked", "tokens_hit", "tokens_local",
    "tokens_loaded", "tokens_stored", "blocks", "tokens", "bytes", "gb_per_s",
    "queue_wait_s", "failed_jobs", "unfinished",
)  # fmt: skip
_BAR = 24


@attrs.frozen(kw_only=True)
class SpanRow:
    """One span, flattened from the Jaeger document."""

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    start_us: int
    duration_us: int
    service: str
    tags: dict[str, Any]
    error: bool
    events: tuple[str, ...]

    @property
    def end_us(self) -> int:
        return self.start_us + self.duration_us


def load_documents(paths: Iterable[str | Path]) -> list[JsonDict]:
    """Parse each file; raises ``ValueError`` naming a file that is not JSON."""
    docs = []
    for p in paths:
        try:
            docs.append(json.loads(Path(p).read_text(encoding="utf-8")))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p}: not a JSON document ({exc})") from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"{p}: not a JSON document (not UTF-8 text: {exc})") from None
    return docs


def load_trace_files(paths: Iterable[str | Path]) -> list[JsonDict]:
    """Parse each file and check it is a trace file (:func:`check_document`); raises
    ``ValueError`` naming a file that is not JSON, or not a Jaeger document (with its
    first problem), which :func:`summarize` and :func:`merge_documents` could not read."""
    paths = list(paths)
    docs = load_documents(paths)
    for p, doc in zip(paths, docs, strict=True):
        problems = check_document(doc)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise ValueError(f"{p}: not a Jaeger trace file: {problems[0]}{more}")
    return docs


def rows_by_trace(doc: JsonDict) -> dict[str, list[SpanRow]]:
    """Spans of a (merged) document, by trace id, each trace sorted by start time."""
    out: dict[str, list[SpanRow]] = {}
    for tr in doc.get("data", []):
        procs = tr.get("processes", {})
        for s in tr.get("spans", []):
            tags = {t["key"]: t.get("value") for t in s.get("tags", [])}
            proc = procs.get(s.get("processID"), {})
            ptags = {t["key"]: t.get("value") for t in proc.get("tags", [])}
            service = str(proc.get("serviceName", "?"))
            if "kvferry.role" in ptags:
                service += f"/{ptags['kvferry.role']}"
            parent = next(
                (r["spanID"] for r in s.get("references", []) if r.get("refType") == "CHILD_OF"),
                None,
            )
            events = tuple(
                str(next((f["value"] for f in log.get("fields", []) if f["key"] == "event"), "?"))
                for log in s.get("logs", [])
            )
            out.setdefault(s["traceID"], []).append(
                SpanRow(
                    trace_id=s["traceID"],
                    span_id=s["spanID"],
                    parent_id=parent,
                    name=s["operationName"],
                    start_us=int(s["startTime"]),
                    duration_us=int(s["duration"]),
                    service=service,
                    tags=tags,
                    error=tags.get("error") is True,
                    events=events,
                )
            )
    for rows in out.values():
        rows.sort(key=lambda r: (r.start_us, r.span_id))
    return out


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of ascending values."""
    assert sorted_values, "percentile of no values"
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def _tree(rows: list[SpanRow]) -> list[tuple[int, SpanRow]]:
    """Depth-first (depth, span); a span whose parent is missing starts a subtree."""
    ids = {r.span_id for r in rows}
    children: dict[str | None, list[SpanRow]] = {}
    for r in rows:
        children.setdefault(r.parent_id if r.parent_id in ids else None, []).append(r)
    out: list[tuple[int, SpanRow]] = []
    stack = [(0, r) for r in reversed(children.get(None, []))]
    while stack:
        depth, r = stack.pop()
        out.append((depth, r))
        stack.extend((depth + 1, c) for c in reversed(children.get(r.span_id, [])))
    return out


def _fmt_tag(key: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{key}={value:.3g}"
    return f"{key}={value}"


def render_timeline(rows: list[SpanRow]) -> list[str]:
    t0 = min(r.start_us for r in rows)
    t1 = max(r.end_us for r in rows)
    span_us = max(t1 - t0, 1)
    root = next((r for r in rows if r.name == SPAN_REQUEST), rows[0])
    req = root.tags.get("kvferry.request_id", "?")
    services = sorted({r.service for r in rows})
    lines = [
        f"trace {rows[0].trace_id}  request {req}  {span_us / 1000:.3f} ms  "
        f"{len(rows)} spans  [{', '.join(services)}]",
        f"  {'start ms':>10} {'dur ms':>10}  {'':{_BAR}}  span",
    ]
    for depth, r in _tree(rows):
        a = (r.start_us - t0) * _BAR // span_us
        b = max(a + 1, math.ceil((r.end_us - t0) * _BAR / span_us))
        bar = " " * a + ("!" if r.error else "#") * (b - a)
        tags = [
            _fmt_tag(k, r.tags[f"kvferry.{k}"])
            for k in _SHOWN
            if f"kvferry.{k}" in r.tags and (k != "request_id" or r is root)
        ]
        if r.events:
            tags.append("events=" + ",".join(r.events))
        if r.error:
            tags.append("ERROR " + str(r.tags.get("otel.status_description", "")))
        name = "  " * depth + r.name
        lines.append(
            f"  {(r.start_us - t0) / 1000:>10.3f} {r.duration_us / 1000:>10.3f}  "
            f"{bar:<{_BAR}}  {name}  {' '.join(tags)}".rstrip()
        )
    return lines


def _stats_table(title: str, unit: str, groups: dict[str, list[float]]) -> list[str]:
    if not groups:
        return []
    width = max(len(title), *(len(k) for k in groups))
    lines = [
        f"{title:<{width}} {'count':>7} {'p50':>10} {'p90':>10} {'p99':>10} {'max':>10}  ({unit})"
    ]
    for name in sorted(groups):
        v = sorted(groups[name])
        p = [percentile(v, q) for q in (50, 90, 99)]
        lines.append(
            f"{name:<{width}} {len(v):>7} {p[0]:>10.3f} {p[1]:>10.3f} {p[2]:>10.3f} {v[-1]:>10.3f}"
        )
    return lines


def summarize(
    docs: Iterable[JsonDict], *, max_traces: int = 20, request_id: str | None = None
) -> str:
    """The summary text of the merged ``docs``.

    A timeline for each trace (at most ``max_traces``, 0 for all; only the trace of
    ``request_id`` when given), then, over every trace, latency percentiles per span
    name, the wait from a job's planning to its copy's start, and copy GB/s.
    """
    traces = rows_by_trace(merge_documents(docs))
    ordered = sorted(traces.values(), key=lambda rows: rows[0].start_us)
    if request_id is not None:
        ordered = [
            rows
            for rows in ordered
            if any(r.tags.get("kvferry.request_id") == request_id for r in rows)
        ]
    n_spans = sum(len(rows) for rows in traces.values())
    out = [f"{len(traces)} traces, {n_spans} spans", ""]
    shown = ordered if max_traces <= 0 else ordered[:max_traces]
    for rows in shown:
        out += render_timeline(rows) + [""]
    if len(shown) < len(ordered):
        out += [f"... {len(ordered) - len(shown)} more traces (--traces 0 shows all)", ""]

    latency: dict[str, list[float]] = {}
    wait: dict[str, list[float]] = {}
    gbps: dict[str, list[float]] = {}
    for rows in traces.values():
        by_id = {r.span_id: r for r in rows}
        for r in rows:
            latency.setdefault(r.name, []).append(r.duration_us / 1000)
            if r.name != SPAN_COPY:
                continue
            direction = str(r.tags.get("kvferry.direction", "?"))
            if "kvferry.gb_per_s" in r.tags:
                gbps.setdefault(f"copy {direction}", []).append(float(r.tags["kvferry.gb_per_s"]))
            job = by_id.get(r.parent_id or "")
            if job is not None:
                wait.setdefault(f"{direction} job → copy start", []).append(
                    (r.start_us - job.start_us) / 1000
                )
    out += _stats_table("span", "ms", latency)
    if wait:
        out += [""] + _stats_table("wait", "ms", wait)
    if gbps:
        out += [""] + _stats_table("throughput", "GB/s", gbps)
    return "\n".join(out).rstrip() + "\n"
