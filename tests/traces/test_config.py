"""Tracing is off by default; the "traces" config and OTEL_* variables turn it on."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from kvferry import ConfigError
from kvferry.traces import TracesConfig, resolve_config, setup

HTTP_DEFAULT = "http://localhost:4318/v1/traces"
GRPC_DEFAULT = "http://localhost:4317"


def resolve(config: Any = None, **env: str) -> TracesConfig | None:
    return resolve_config(config, environ=env)


def test_off_by_default() -> None:
    assert resolve() is None
    assert setup(environ={}) is None


@pytest.mark.parametrize(
    ("env", "off"),
    [
        ({"OTEL_TRACES_EXPORTER": "none"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4318"}, True),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_SERVICE_NAME": "x"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, False),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://h:4318/v1/traces"}, False),
    ],
)
def test_environment_turns_it_on_or_off(env: dict[str, str], off: bool) -> None:
    assert (resolve(**env) is None) is off


@pytest.mark.parametrize(
    ("config", "env", "proto", "endpoint"),
    [
        ({}, {}, "http/protobuf", HTTP_DEFAULT),
        ({"otlp": "http"}, {}, "http/protobuf", HTTP_DEFAULT),
        ({"otlp": True}, {}, "http/protobuf", HTTP_DEFAULT),
        ({"otlp": "grpc"}, {}, "grpc", GRPC_DEFAULT),
        ({"otlp": "http://jaeger:4318"}, {}, "http/protobuf", "http://jaeger:4318/v1/traces"),
        ({"otlp": "http://jaeger:9999/custom"}, {}, "http/protobuf", "http://jaeger:9999/custom"),
        ({"otlp": "jaeger:4317"}, {}, "grpc", "http://jaeger:4317"),
        ({"otlp": "grpc://jaeger:4317"}, {}, "grpc", "http://jaeger:4317"),
        ({"otlp": "https://j:443", "otlp_protocol": "grpc"}, {}, "grpc", "https://j:443"),
        (
            {"otlp": "http"},
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"},
            "http/protobuf",
            "http://c:4318/v1/traces",
        ),
        (
            {"otlp": "grpc"},
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"},
            "grpc",
            "http://c:4317",
        ),
        (None, {"OTEL_TRACES_EXPORTER": "otlp"}, "http/protobuf", HTTP_DEFAULT),
        (
            None,
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            "grpc",
            GRPC_DEFAULT,
        ),
        (
            None,
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"},
            "http/protobuf",
            "http://c:4318/v1/traces",
        ),
        # vLLM's --otlp-traces-endpoint sets this for its processes; port 4317 is gRPC.
        (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317"}, "grpc", "http://c:4317"),
        (
            None,
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            },
            "http/protobuf",
            "http://c:4318/v1/traces",
        ),
    ],
)
def test_otlp_endpoint_and_protocol(
    config: Any, env: dict[str, str], proto: str, endpoint: str
) -> None:
    tc = resolve(config, **env)
    assert tc is not None
    assert (tc.otlp_protocol, tc.otlp_endpoint) == (proto, endpoint)


def test_file_only_and_its_name() -> None:
    tc = resolve({"file": "out/{role}-{pid}.json"})
    assert tc is not None and tc.otlp_protocol is None
    assert tc.file_path("worker") == f"out/worker-{__import__('os').getpid()}.json"
    tc = resolve({"file": True})
    assert tc is not None and tc.file == "traces/kvferry-{pid}.json"


def test_config_wins_over_environment() -> None:
    tc = resolve(
        {"file": True, "otlp": False, "service_name": "mine"},
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_SERVICE_NAME="theirs",
    )
    assert tc is not None
    assert tc.otlp_protocol is None and tc.service_name == "mine"
    assert resolve({"enabled": False}, OTEL_TRACES_EXPORTER="otlp") is None


def test_unsupported_exporter_variable_is_ignored_not_fatal() -> None:
    assert resolve(OTEL_TRACES_EXPORTER="zipkin") is None
    tc = resolve(OTEL_TRACES_EXPORTER="zipkin,console")
    assert tc is not None and tc.console and tc.otlp_protocol is None


@pytest.mark.parametrize(
    ("config", "env", "key"),
    [
        ({"otlp": "http", "fiel": "x"}, {}, "traces.fiel"),
        ({"enabled": "yes"}, {}, "traces.enabled"),
        ({"otlp": 4318}, {}, "traces.otlp"),
        ({"otlp": "http://:4318"}, {}, "traces.otlp"),
        ({"otlp": "ftp://h:21"}, {}, "traces.otlp"),
        ({"otlp": "http://h:notaport"}, {}, "traces.otlp"),
        ({"otlp": "http", "otlp_protocol": "grpc"}, {}, "traces.otlp_protocol"),
        ({"otlp": "http://h:1", "otlp_protocol": "http/json"}, {}, "traces.otlp_protocol"),
        ({"file": 3}, {}, "traces.file"),
        ({"file": "t/{host}.json"}, {}, "traces.file"),
        ({"service_name": ""}, {}, "traces.service_name"),
        ({"sample_ratio": 2}, {}, "traces.sample_ratio"),
        ({"sample_ratio": True}, {}, "traces.sample_ratio"),
        # Values are checked even when off, so that turning it on cannot fail later.
        ({"enabled": False, "sample_ratio": -1}, {}, "traces.sample_ratio"),
        (["otlp"], {}, "traces"),
        (
            None,
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ),
        (
            None,
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://:1"},
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        ),
    ],
)
def test_bad_config_raises_value_error_naming_the_key(
    config: Any, env: dict[str, str], key: str
) -> None:
    with pytest.raises(ValueError, match=key) as info:
        resolve_config(config, environ=env)
    assert isinstance(info.value, ConfigError) and info.value.key == key
    with pytest.raises(ConfigError):
        setup(config, environ=env)


@pytest.mark.parametrize(
    "config",
    [
        None,  # tracing off: no exporter asked for
        {"file": "t.json"},  # a file, no OTLP
        {"otlp": "grpc"},  # OTLP, its protocol named by the config
    ],
)
def test_a_protocol_variable_kvferry_does_not_use_is_not_checked(config: Any) -> None:
    # Meant for another program of the process tree: the Python SDK has no http/json.
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
    resolved = resolve_config(config, environ=env)
    if config is None:
        assert resolved is None
    else:
        assert resolved is not None
        assert resolved.otlp_protocol == (config.get("otlp") and "grpc")


def test_setup_returns_a_provider_and_leaves_the_global_one_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    installed: list[Any] = []
    monkeypatch.setattr(trace, "set_tracer_provider", installed.append)
    provider = setup(
        {"file": str(tmp_path / "t.json"), "service_name": "svc", "sample_ratio": 0.5},
        role="scheduler",
        environ={},
    )
    assert isinstance(provider, TracerProvider)
    try:
        assert installed == []
        assert provider.resource.attributes["service.name"] == "svc"
        assert provider.resource.attributes["kvferry.role"] == "scheduler"
        assert "0.5" in provider.sampler.get_description()
    finally:
        provider.shutdown()


def test_setup_sets_the_global_provider_when_asked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    installed: list[Any] = []
    monkeypatch.setattr(trace, "set_tracer_provider", installed.append)
    provider = setup({"file": str(tmp_path / "t.json")}, environ={}, set_global=True)
    assert installed == [provider]
    assert provider is not None
    provider.shutdown()
