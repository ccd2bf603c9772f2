"""A span exporter that writes this process's spans to one Jaeger JSON file.

Which thread: the SDK's batch processor calls :meth:`export` on its own worker thread,
and ``force_flush`` / ``shutdown`` come from whichever thread asks; a lock guards the
buffered spans. The engine thread never waits on the file.

The file is rewritten whole (a temporary file, then an atomic rename, so a reader never
sees half a document), because Jaeger UI keeps only the last entry of a trace id and a
trace's spans arrive over several batches. To keep rewrites cheap each span is serialised
once, and rewrites are spaced so that writing takes at most ~2% of the time; a flush or
shutdown writes at once. Spans past ``max_spans`` are dropped, counted and logged once:
the file is for looking at runs, OTLP is for long ones.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from .._logging import get_logger
from ._jaeger import process_of, span_to_jaeger


class JaegerFileExporter(SpanExporter):
    """Writes every exported span to ``path`` as a Jaeger JSON document."""

    def __init__(
        self, path: str | os.PathLike[str], *, max_spans: int = 200_000, min_interval_s: float = 2.0
    ) -> None:
        self.path = os.fspath(path)
        self.max_spans = max_spans
        self.min_interval_s = min_interval_s
        self.dropped = 0
        self._lock = threading.Lock()
        self._traces: dict[str, list[str]] = {}
        self._processes: dict[str, str] = {}  # json of a process -> its id
        self._count = 0
        self._dirty = False
        self._next_write = 0.0
        self._closed = False
        self._log = get_logger("kvferry.traces", path=self.path)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            if self._closed:
                return SpanExportResult.FAILURE
            for span in spans:
                if self._count >= self.max_spans:
                    if not self.dropped:
                        self._log.warning("trace_file_full", max_spans=self.max_spans)
                    self.dropped += 1
                    continue
                proc = json.dumps(process_of(span.resource), sort_keys=True)
                pid = self._processes.setdefault(proc, f"p{len(self._processes) + 1}")
                d = span_to_jaeger(span, pid)
                self._traces.setdefault(d["traceID"], []).append(json.dumps(d))
                self._count += 1
                self._dirty = True
            if time.monotonic() >= self._next_write:
                self._write_locked()
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        with self._lock:
            self._write_locked()
        return True

    def shutdown(self) -> None:
        with self._lock:
            self._write_locked()
            self._closed = True

    def _write_locked(self) -> None:
        if not self._dirty:
            return
        t0 = time.monotonic()
        # One process per provider in practice, so every trace lists them all.
        procs = ",".join(f'"{pid}":{proc}' for proc, pid in self._processes.items())
        parts = []
        for trace_id, spans in self._traces.items():
            parts.append(
                f'{{"traceID":"{trace_id}","spans":[{",".join(spans)}],'
                f'"processes":{{{procs}}},"warnings":null}}'
            )
        text = f'{{"data":[{",".join(parts)}],"total":0,"limit":0,"offset":0,"errors":null}}'
        folder = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".kvferry-", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)
        except BaseException:
            os.unlink(tmp)
            raise
        self._dirty = False
        took = time.monotonic() - t0
        self._next_write = time.monotonic() + max(self.min_interval_s, 50 * took)


class FlushingBatchSpanProcessor(BatchSpanProcessor):
    """A batch processor whose ``force_flush`` also flushes its exporter.

    The SDK's own exports the queue but does not tell the exporter, which would leave a
    file exporter's last rewrite pending until shutdown.
    """

    def __init__(self, exporter: SpanExporter) -> None:
        super().__init__(exporter)
        self._flush_exporter = exporter

    def force_flush(self, timeout_millis: int | None = None) -> bool:
        ok = (
            super().force_flush(timeout_millis)
            if timeout_millis is not None
            else super().force_flush()
        )
        return self._flush_exporter.force_flush() and ok
