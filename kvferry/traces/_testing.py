"""An in-process OTLP/HTTP trace receiver, for tests that check what kvferry exports.

Which thread: the HTTP server runs on its own daemon thread (one more per request);
received spans are appended under a lock and waiters are woken by a condition, so a test
waits for spans from other processes with :meth:`OTLPReceiver.wait_for`, never a sleep.
Within one process, ``provider.force_flush()`` returns after the export was answered,
and so after the spans were stored.

Needs ``opentelemetry-proto`` (it comes with ``opentelemetry-exporter-otlp-proto-http``).
"""

from __future__ import annotations

import base64
import gzip
import json
import threading
import time
import zlib
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class ReceivedSpan:
    """A span as decoded from an ``ExportTraceServiceRequest``; ids are lowercase hex."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    service_name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    events: tuple[tuple[str, dict[str, Any]], ...]
    status_code: str
    """"UNSET", "OK" or "ERROR"."""
    status_message: str = ""


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def _hex_ids_to_base64(doc: Any) -> Any:
    """OTLP/JSON writes ids in hex where protobuf's JSON mapping expects base64."""
    for rs in doc.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):
                for item in (span, *span.get("links", [])):
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if item.get(key):
                            item[key] = base64.b64encode(bytes.fromhex(item[key])).decode()
    return doc


def decode_request(body: bytes, content_type: str = "application/x-protobuf") -> list[ReceivedSpan]:
    """The spans of one OTLP/HTTP trace export body (protobuf, or OTLP JSON)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    from opentelemetry.proto.trace.v1.trace_pb2 import Status

    req = ExportTraceServiceRequest()
    if content_type.startswith("application/json"):
        from google.protobuf import json_format

        json_format.ParseDict(_hex_ids_to_base64(json.loads(body)), req)
    else:
        req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        resource = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    ReceivedSpan(
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex() or None,
                        name=s.name,
                        service_name=str(resource.get("service.name", "")),
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes=_attrs(s.attributes),
                        resource=resource,
                        events=tuple((e.name, _attrs(e.attributes)) for e in s.events),
                        status_code=Status.StatusCode.Name(s.status.code).removeprefix(
                            "STATUS_CODE_"
                        ),
                        status_message=s.status.message,
                    )
                )
    return out


class OTLPReceiver:
    """An OTLP/HTTP collector on ``127.0.0.1`` (a free port) that keeps what it receives.

    Use as a context manager; point an exporter at :attr:`endpoint` (``setup({"otlp":
    receiver.endpoint})``, or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` for child
    processes). Answers ``POST /v1/traces`` with an ``ExportTraceServiceResponse``, any
    other path with 404, and a body it cannot decode with 400 (kept in :attr:`errors`).
    """

    def __init__(self) -> None:
        import opentelemetry.proto.collector.trace.v1.trace_service_pb2  # noqa: F401 (fail early)

        self._cond = threading.Condition()
        self._spans: list[ReceivedSpan] = []
        self.requests = 0
        self.errors: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                if self.path.rstrip("/") != "/v1/traces":
                    self._answer(404, b"")
                    return
                try:
                    if encoding == "gzip":
                        body = gzip.decompress(body)
                    elif encoding == "deflate":
                        body = zlib.decompress(body)
                    spans = decode_request(body, self.headers.get("Content-Type") or "")
                except Exception as exc:
                    with receiver._cond:
                        receiver.errors.append(repr(exc))
                    self._answer(400, repr(exc).encode())
                    return
                with receiver._cond:
                    receiver._spans.extend(spans)
                    receiver.requests += 1
                    receiver._cond.notify_all()
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                    ExportTraceServiceResponse,
                )

                self._answer(200, ExportTraceServiceResponse().SerializeToString())

            def _answer(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # keep test output clean

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port: int = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}/v1/traces"
        """The full OTLP/HTTP traces URL."""
        self.base_endpoint = f"http://127.0.0.1:{self.port}"
        """The base URL (for ``OTEL_EXPORTER_OTLP_ENDPOINT``)."""
        self._thread: threading.Thread | None = None

    def start(self) -> OTLPReceiver:
        assert self._thread is None, "OTLPReceiver started twice"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="otlp-receiver", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> OTLPReceiver:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far, in arrival order."""
        with self._cond:
            return list(self._spans)

    def traces(self) -> dict[str, list[ReceivedSpan]]:
        """Spans received so far, by trace id, each trace sorted by start time."""
        out: dict[str, list[ReceivedSpan]] = {}
        for s in self.spans():
            out.setdefault(s.trace_id, []).append(s)
        for spans in out.values():
            spans.sort(key=lambda s: (s.start_ns, s.span_id))
        return out

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float = 30.0
    ) -> list[ReceivedSpan]:
        """Block until ``predicate(spans)`` holds; the spans. ``TimeoutError`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"OTLPReceiver: condition not met within {timeout} s "
                        f"({len(self._spans)} spans received, errors: {self.errors})"
                    )
                self._cond.wait(left)
            return list(self._spans)

    def clear(self) -> None:
        with self._cond:
            self._spans.clear()
            self.errors.clear()
