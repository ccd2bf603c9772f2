"""``kvferry.traces.setup()``: an SDK tracer provider with the exporters asked for.

The only place kvferry touches the OpenTelemetry SDK and exporters, all imported here,
inside :func:`setup`, so that ``import kvferry.traces`` costs only the API.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .._errors import ConfigError
from ._config import TracesConfig, resolve_config

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter


def setup(
    config: Mapping[str, Any] | None = None,
    *,
    role: str | None = None,
    environ: Mapping[str, str] | None = None,
    set_global: bool = False,
) -> TracerProvider | None:
    """A tracer provider exporting kvferry's spans, or None when tracing is off.

    ``config`` is ``kv_connector_extra_config["traces"]`` (keys in
    :data:`kvferry.traces.KEYS`; see docs/tracing.md); without it the ``OTEL_*``
    variables of ``environ`` (default ``os.environ``) decide, and tracing is off unless
    they ask for it. ``role`` ("scheduler", "worker") tags the process and fills
    ``{role}`` in the file name.

    The provider is not made global unless ``set_global`` (OpenTelemetry allows that
    once per process). The caller owns it: ``force_flush()`` to export now,
    ``shutdown()`` at the end (also run at interpreter exit). Raises
    :class:`~kvferry.ConfigError` (a ``ValueError``) naming a bad key or variable, or
    the key whose exporter is not installed.
    """
    tc = resolve_config(config, environ)
    if tc is None:
        return None
    from opentelemetry import trace

    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            "traces", f"tracing needs opentelemetry-sdk (pip install 'kvferry[traces]'): {exc}"
        ) from exc
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    attributes: dict[str, str | int] = {
        "service.name": tc.service_name,
        "process.pid": os.getpid(),
    }
    if role is not None:
        attributes["kvferry.role"] = role
    # Parent-based: a worker's copy span follows the decision its scheduler job made.
    sampler = None if tc.sample_ratio is None else ParentBased(TraceIdRatioBased(tc.sample_ratio))
    provider = TracerProvider(resource=Resource.create(attributes), sampler=sampler)
    for exporter in _otlp_exporters(tc):
        provider.add_span_processor(BatchSpanProcessor(exporter))
    path = tc.file_path(role)
    if path is not None:
        from ._file_exporter import FlushingBatchSpanProcessor, JaegerFileExporter

        provider.add_span_processor(FlushingBatchSpanProcessor(JaegerFileExporter(path)))
    if set_global:
        trace.set_tracer_provider(provider)
    return provider


def _otlp_exporters(tc: TracesConfig) -> list[SpanExporter]:
    exporters: list[SpanExporter] = []
    if tc.otlp_protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )
        except ImportError as exc:
            raise ConfigError(
                "traces.otlp",
                "OTLP over gRPC needs opentelemetry-exporter-otlp-proto-grpc "
                f"(pip install 'kvferry[traces]'): {exc}",
            ) from exc
        assert tc.otlp_endpoint is not None
        exporters.append(
            GrpcExporter(endpoint=tc.otlp_endpoint, insecure=tc.otlp_endpoint.startswith("http://"))
        )
    elif tc.otlp_protocol == "http/protobuf":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as HttpExporter,
            )
        except ImportError as exc:
            raise ConfigError(
                "traces.otlp",
                "OTLP over HTTP needs opentelemetry-exporter-otlp-proto-http "
                f"(pip install 'kvferry[traces]'): {exc}",
            ) from exc
        exporters.append(HttpExporter(endpoint=tc.otlp_endpoint))
    if tc.console:
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        exporters.append(ConsoleSpanExporter())
    return exporters
