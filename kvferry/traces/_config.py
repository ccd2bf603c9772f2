"""Whether to trace, and where to: the ``"traces"`` config and the ``OTEL_*`` variables.

Pure parsing, no OpenTelemetry SDK: the connector can validate at engine start without
installing anything. Every error is a :class:`~kvferry.ConfigError` (a ``ValueError``)
naming the key, ``traces.<key>`` or the environment variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Final, Literal
from urllib.parse import urlsplit

import attrs

from .._errors import ConfigError
from .._logging import get_logger

Protocol = Literal["grpc", "http/protobuf"]

DEFAULT_FILE: Final = "traces/kvferry-{pid}.json"
DEFAULT_SERVICE_NAME: Final = "kvferry"
# A Jaeger all-in-one collector's OTLP ports on this machine.
DEFAULT_GRPC_ENDPOINT: Final = "http://localhost:4317"
DEFAULT_HTTP_ENDPOINT: Final = "http://localhost:4318/v1/traces"

KEYS: Final = ("enabled", "otlp", "otlp_protocol", "file", "service_name", "sample_ratio")

_PROTOCOLS: Final = {"grpc": "grpc", "http": "http/protobuf", "http/protobuf": "http/protobuf"}
_EXPORTERS: Final = ("otlp", "console", "none")


@attrs.frozen(kw_only=True)
class TracesConfig:
    """Resolved tracing settings; exists only when tracing is on."""

    otlp_protocol: Protocol | None = None
    """None: no OTLP export."""
    otlp_endpoint: str | None = None
    """Full URL: ``.../v1/traces`` for HTTP, ``scheme://host:port`` for gRPC."""
    file: str | None = None
    """Path template of the Jaeger JSON file (``{pid}`` and ``{role}`` are filled in)."""
    console: bool = False
    service_name: str = DEFAULT_SERVICE_NAME
    sample_ratio: float | None = None
    """Share of requests traced; None: the SDK's default (``OTEL_TRACES_SAMPLER``, else all)."""

    def file_path(self, role: str | None) -> str | None:
        """The file this process writes: the template with its pid and role."""
        if self.file is None:
            return None
        return self.file.format(pid=os.getpid(), role=role or "process")


def _is_true(value: str | None) -> bool:
    return (value or "").strip().lower() == "true"


def _protocol(key: str, value: Any) -> Protocol:
    proto = _PROTOCOLS.get(str(value).strip().lower()) if isinstance(value, str) else None
    if proto is None:
        raise ConfigError(key, f"must be 'grpc' or 'http/protobuf', got {value!r}")
    return proto  # type: ignore[return-value]


def _infer_protocol(endpoint: str) -> Protocol:
    """gRPC for ``grpc://`` or port 4317 (OTLP/gRPC's port), else HTTP."""
    parts = urlsplit(endpoint if "://" in endpoint else f"//{endpoint}")
    if parts.scheme == "grpc" or parts.port == 4317:
        return "grpc"
    return "http/protobuf"


def _check_url(key: str, url: str) -> None:
    try:
        parts = urlsplit(url if "://" in url else f"//{url}")
        port = parts.port
    except ValueError as exc:
        raise ConfigError(key, f"is not a valid URL: {url!r} ({exc})") from None
    if not parts.hostname or port == 0:
        raise ConfigError(key, f"names no host and port: {url!r}")
    if parts.scheme not in ("", "http", "https", "grpc"):
        raise ConfigError(key, f"scheme must be http, https or grpc, got {url!r}")


def _endpoint(proto: Protocol, url: str | None, *, signal_url: bool) -> str:
    """The URL the exporter is given, from a user's URL or the default.

    HTTP needs the full path: a base URL (``OTEL_EXPORTER_OTLP_ENDPOINT``, or a config
    URL without a path) gets ``/v1/traces``. gRPC gets a scheme, ``http://`` (plain text,
    as a local Jaeger listens) when none or ``grpc://`` was given; write ``https://``
    for TLS.
    """
    if url is None:
        return DEFAULT_GRPC_ENDPOINT if proto == "grpc" else DEFAULT_HTTP_ENDPOINT
    url = url.strip()
    if proto == "grpc":
        if url.startswith("grpc://"):
            return "http://" + url[len("grpc://") :]
        return url if "://" in url else f"http://{url}"
    if "://" not in url:
        url = f"http://{url}"
    if not signal_url or urlsplit(url).path in ("", "/"):
        return url.rstrip("/") + "/v1/traces"
    return url


def _from_env(
    environ: Mapping[str, str],
) -> tuple[bool, bool, str | None, bool, tuple[str, str] | None]:
    """(asked for OTLP, asked for console, endpoint, endpoint is per-signal, protocol).

    The protocol is the variable that names it and its value, unchecked: it is checked
    only where kvferry exports OTLP with it, so a value meant for another program of the
    process tree (``http/json``, which this SDK lacks) cannot stop the engine.
    """
    exporters_raw = environ.get("OTEL_TRACES_EXPORTER")
    exporters: list[str] = []
    if exporters_raw is not None:
        exporters = [e.strip().lower() for e in exporters_raw.split(",") if e.strip()]
        unsupported = [e for e in exporters if e not in _EXPORTERS]
        if unsupported:
            # Not an error: the variable may be set for another program of the process
            # tree, and a bad variable must not stop the engine.
            get_logger("kvferry.traces").warning(
                "otel_exporter_ignored",
                variable="OTEL_TRACES_EXPORTER",
                ignored=unsupported,
                supported=list(_EXPORTERS),
            )
    endpoint: str | None = None
    signal_url = False
    for var in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        if environ.get(var, "").strip():
            endpoint = environ[var].strip()
            _check_url(var, endpoint)
            signal_url = var == "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
            break
    proto: tuple[str, str] | None = None
    for var in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        if environ.get(var):
            proto = (var, environ[var])
            break
    if "none" in exporters:
        return False, False, endpoint, signal_url, proto
    # An endpoint alone turns OTLP on: vLLM's --otlp-traces-endpoint sets
    # OTEL_EXPORTER_OTLP_TRACES_ENDPOINT for its processes, so kvferry's spans join its.
    otlp = "otlp" in exporters or (exporters_raw is None and endpoint is not None)
    return otlp, "console" in exporters, endpoint, signal_url, proto


def resolve_config(
    config: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> TracesConfig | None:
    """Tracing settings from the ``"traces"`` config and the environment; None when off.

    Off by default. On when ``config`` is a mapping (``{}`` means OTLP to a local Jaeger
    unless the environment names an exporter), or, without a config, when
    ``OTEL_TRACES_EXPORTER`` names ``otlp`` / ``console`` or an OTLP endpoint variable is
    set. ``OTEL_SDK_DISABLED=true``, ``OTEL_TRACES_EXPORTER=none`` (without a config)
    and ``{"enabled": False}`` turn it off. Config keys win over variables.

    Raises :class:`~kvferry.ConfigError` naming an unknown key, a bad value (even with
    ``enabled`` false, so that turning it on cannot fail later) or a bad variable.
    """
    env = os.environ if environ is None else environ
    if config is not None and not isinstance(config, Mapping):
        raise ConfigError("traces", f"must be a mapping of {', '.join(KEYS)}, got {config!r}")
    cfg = _check_keys(dict(config or {}))
    if not cfg["enabled"] or _is_true(env.get("OTEL_SDK_DISABLED")):
        return None
    env_otlp, env_console, env_endpoint, signal_url, env_proto = _from_env(env)

    otlp, proto, endpoint, file = cfg["otlp"], cfg["otlp_protocol"], cfg["endpoint"], cfg["file"]
    if endpoint is not None:
        signal_url = True
    if otlp is False:
        env_otlp = False
    use_otlp = (otlp is not None and otlp is not False) or env_otlp
    if config is not None and otlp is None and file is None and not env_console:
        use_otlp = True  # a "traces" config that names no exporter: the local Jaeger
    if not (use_otlp or file or env_console):
        return None
    if use_otlp:
        endpoint = endpoint if endpoint is not None else env_endpoint
        if proto is None and env_proto is not None:
            proto = _protocol(*env_proto)
        if proto is None:
            proto = _infer_protocol(endpoint) if endpoint else "http/protobuf"
        endpoint = _endpoint(proto, endpoint, signal_url=signal_url)
    return TracesConfig(
        otlp_protocol=proto if use_otlp else None,
        otlp_endpoint=endpoint if use_otlp else None,
        file=file,
        console=env_console,
        service_name=cfg["service_name"] or env.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME,
        sample_ratio=cfg["sample_ratio"],
    )


def _check_keys(cfg: dict[str, Any]) -> dict[str, Any]:
    """Validate every key of a ``"traces"`` config; the values, normalised."""
    unknown = sorted(set(cfg) - set(KEYS))
    if unknown:
        raise ConfigError(f"traces.{unknown[0]}", f"unknown key (known keys: {', '.join(KEYS)})")
    enabled = cfg.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ConfigError("traces.enabled", f"must be true or false, got {enabled!r}")

    otlp = cfg.get("otlp")
    proto: Protocol | None = None
    endpoint: str | None = None
    if otlp is None or isinstance(otlp, bool):
        pass
    elif isinstance(otlp, str) and otlp.strip().lower() in _PROTOCOLS:
        proto = _protocol("traces.otlp", otlp)
    elif isinstance(otlp, str) and otlp.strip():
        _check_url("traces.otlp", otlp.strip())
        endpoint = otlp.strip()
    else:
        raise ConfigError(
            "traces.otlp", f"must be 'http', 'grpc', an endpoint URL or false, got {otlp!r}"
        )
    if "otlp_protocol" in cfg:
        if endpoint is None:
            raise ConfigError("traces.otlp_protocol", "needs 'otlp' to be an endpoint URL")
        proto = _protocol("traces.otlp_protocol", cfg["otlp_protocol"])

    file = cfg.get("file")
    if file is True:
        file = DEFAULT_FILE
    elif file is False:
        file = None
    if file is not None:
        if not isinstance(file, str) or not file.strip():
            raise ConfigError("traces.file", f"must be a path or true/false, got {file!r}")
        try:
            file.format(pid=0, role="r")
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(
                "traces.file", f"may hold only {{pid}} and {{role}}, got {file!r} ({exc!r})"
            ) from None

    service = cfg.get("service_name")
    if service is not None and (not isinstance(service, str) or not service.strip()):
        raise ConfigError("traces.service_name", f"must be a non-empty string, got {service!r}")
    ratio = cfg.get("sample_ratio")
    if ratio is not None and (
        isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 <= ratio <= 1
    ):
        raise ConfigError("traces.sample_ratio", f"must be a number in [0, 1], got {ratio!r}")
    return {
        "enabled": enabled,
        "otlp": otlp,
        "otlp_protocol": proto,
        "endpoint": endpoint,
        "file": file,
        "service_name": service.strip() if service else None,
        "sample_ratio": None if ratio is None else float(ratio),
    }
