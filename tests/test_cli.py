"""The ``kvferry`` command, each subcommand run as a program on real inputs: configs as
text and files, trace files written by kvferry's own exporter, and a Prometheus page served
over HTTP on loopback. (``top`` against a real ``vllm serve`` is in tests/e2e/test_serve.py,
next to the server it reuses.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvferry._cli import check_transfer_config, metrics_url, vllm_transfer_config_fields
from kvferry._metrics import COUNTERS, GAUGES

ROOT = Path(__file__).resolve().parents[1]
GOOD = {
    "kv_connector": "KVFerryConnector",
    "kv_connector_module_path": "kvferry.connector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"cpu_bytes_to_use": 64 << 20, "block_size": 256},
}


def kvferry(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m kvferry ARGS`` in a child process, as a user runs it."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "COLUMNS": "120",
    }
    return subprocess.run(
        [sys.executable, "-m", "kvferry", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "command",
    [[], ["check-config"], ["top"], ["traces"], ["traces", "summarize"], ["metrics"]],
    ids=lambda c: " ".join(c) or "kvferry",
)
def test_every_command_has_help(command: list[str]) -> None:
    r = kvferry(*command, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: kvferry"), r.stdout


# -- check-config ---------------------------------------------------------------------------


def test_a_good_config_passes() -> None:
    r = kvferry("check-config", json.dumps(GOOD), "--block-size", "128")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("ok")


def test_each_bad_key_is_named_with_its_reason(tmp_path: Path) -> None:
    bad = {
        **GOOD,
        "kv_conector": "KVFerryConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": -1,
            "runtime": "fast",
            "blok_size": 256,
            "block_size": 100,
            "traces": {"sample_ratio": 2},
        },
    }
    path = tmp_path / "kv.json"
    path.write_text(json.dumps(bad))
    r = kvferry("check-config", f"@{path}", "--block-size", "128")
    assert r.returncode == 1, r.stdout + r.stderr
    errors = {line.split(": ")[1] for line in r.stdout.splitlines() if line.startswith("error: ")}
    extra = "kv_connector_extra_config."
    assert errors == {
        "kv_conector",
        "kv_role",
        extra + "cpu_bytes_to_use",
        extra + "runtime",
        extra + "blok_size",
        extra + "block_size",
        extra + "traces.sample_ratio",
    }, r.stdout
    assert "error: kv_connector_extra_config.runtime: must be one of" in r.stdout
    assert "not a multiple of vLLM's block size (128 tokens)" in r.stdout
    assert r.stdout.strip().endswith("7 bad keys")


def test_a_bare_extra_config_is_checked_as_such() -> None:
    r = kvferry("check-config", '{"cpu_bytes_to_use": 1000000, "store_decoded": "yes"}')
    assert r.returncode == 1
    assert "error: store_decoded: must be true or false" in r.stdout
    assert "note: no 'kv_connector' key" in r.stdout


def test_input_that_is_not_json_is_a_usage_error(tmp_path: Path) -> None:
    r = kvferry("check-config", "{cpu_bytes_to_use: 1}")
    assert r.returncode == 2 and "is not JSON" in r.stderr
    r = kvferry("check-config", f"@{tmp_path / 'missing.json'}")
    assert r.returncode == 2 and "cannot read" in r.stderr


def test_vllms_own_keys_are_read_from_the_installed_vllm() -> None:
    pytest.importorskip("vllm")
    from dataclasses import fields

    from vllm.config import KVTransferConfig

    assert vllm_transfer_config_fields() == frozenset(f.name for f in fields(KVTransferConfig))


def test_a_load_failure_policy_set_by_hand_is_a_warning_not_an_error() -> None:
    findings, _ = check_transfer_config({**GOOD, "kv_load_failure_policy": "fail"})
    assert [(f.key, f.error) for f in findings] == [("kv_load_failure_policy", False)]


def errors_of(extra: dict[str, Any]) -> list[str]:
    """The keys of a bare extra config's error findings, as ``check-config`` prints them."""
    findings, _ = check_transfer_config(extra)
    return [f"{f.key}: {f.message}" for f in findings if f.error]


def test_keys_good_alone_are_checked_together_as_engine_start_does() -> None:
    redis = {"kind": "redis", "url": "redis://127.0.0.1:6379/0"}
    extra = {"cpu_bytes_to_use": 1 << 20, "runtime": "stepped", "tiers": [redis]}
    assert errors_of(extra) == [
        "runtime: a redis tier needs the loop-thread runtime ('thread' or 'auto'), got 'stepped'"
    ]
    assert errors_of({**extra, "runtime": "thread"}) == []


@pytest.mark.parametrize(
    ("entry", "key"),
    [
        ({"url": "http://127.0.0.1:6379"}, "tiers[0].url"),
        ({"cluster": ["redis://a:7000", "redis://b:notaport"]}, "tiers[0].cluster"),
        ({"url": "redis://127.0.0.1:6379", "encrypt_key": "zz"}, "tiers[0].encrypt_key"),
        ({"url": "redis://127.0.0.1:6379", "encrypt_key": "00" * 5}, "tiers[0].encrypt_key"),
    ],
)
def test_a_redis_url_or_key_engine_start_refuses_is_reported_without_a_server(
    entry: dict[str, Any], key: str
) -> None:
    errors = errors_of({"cpu_bytes_to_use": 1 << 20, "tiers": [{"kind": "redis", **entry}]})
    assert [e.split(": ")[0] for e in errors] == [key], errors


def test_infinity_is_a_finding_naming_its_key_not_a_traceback() -> None:
    r = kvferry("check-config", '{"cpu_bytes_to_use": Infinity}')  # json.loads reads it
    assert r.returncode == 1, r.stderr
    assert "error: cpu_bytes_to_use: must be a whole number, got inf" in r.stdout
    assert r.stderr == ""


@pytest.mark.parametrize("block_size", ["0", "-16"])
def test_a_block_size_below_one_is_a_usage_error(block_size: str) -> None:
    r = kvferry("check-config", "--block-size", block_size, json.dumps(GOOD))
    assert r.returncode == 2, r.stderr
    assert "--block-size: must be >= 1" in r.stderr and "Traceback" not in r.stderr


def test_a_file_that_is_not_text_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "kv.json"
    path.write_bytes(b"\xff\xfe{}")
    r = kvferry("check-config", f"@{path}")
    assert r.returncode == 2
    assert r.stderr.startswith(f"kvferry check-config: error: {path} is not UTF-8 text")
    assert r.stderr.count("\n") == 1  # one line, no traceback


# -- traces ---------------------------------------------------------------------------------


def test_traces_summarize_reads_files_kvferry_wrote(tmp_path: Path) -> None:
    from kvferry.traces import SchedulerTracer, setup

    path = tmp_path / "kvferry-scheduler.json"
    provider = setup({"file": str(path), "otlp": False}, role="scheduler", environ={})
    assert provider is not None
    sched = SchedulerTracer(provider)
    for i in range(2):
        sched.request_started(f"req-{i}")
        sched.lookup(f"req-{i}", tokens_asked=512, tokens_hit=256)
        sched.job_planned(f"req-{i}", i + 1, direction="load", blocks=2, tokens=256)
        sched.job_ended(i + 1, ok=True)
        sched.request_finished(f"req-{i}")
    provider.shutdown()

    r = kvferry("traces", "summarize", str(path), "--request", "req-1")
    assert r.returncode == 0, r.stderr
    assert "2 traces" in r.stdout
    assert "request req-1" in r.stdout and "request req-0" not in r.stdout
    assert "lookup kv_blocks" in r.stdout and "load kv_blocks" in r.stdout

    r = kvferry("traces", "check", str(path))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout


def test_traces_summarize_of_a_file_that_is_not_json_fails(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text("{")
    r = kvferry("traces", "summarize", str(path))
    assert r.returncode == 2 and "not a JSON document" in r.stderr


@pytest.mark.parametrize("command", ["summarize", "merge"])
@pytest.mark.parametrize("content", ["[]", '{"data": [{"spans": [{}]}]}'])
def test_traces_of_json_that_is_not_a_trace_file_fails(
    tmp_path: Path, command: str, content: str
) -> None:
    path = tmp_path / "t.json"
    path.write_text(content)
    output = ("-o", str(tmp_path / "merged.json")) if command == "merge" else ()
    r = kvferry("traces", command, str(path), *output)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"kvferry traces: error: {path}: not a Jaeger trace file: ")
    assert r.stderr.count("\n") == 1  # one line, no traceback
    assert not (tmp_path / "merged.json").exists()


def test_traces_merge_into_a_path_that_cannot_be_written_fails(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text('{"data": []}')
    out = tmp_path / "no-such-dir" / "all.json"
    r = kvferry("traces", "merge", str(path), "-o", str(out))
    assert r.returncode == 2
    assert r.stderr == f"kvferry traces: error: cannot write {out}: No such file or directory\n"


# -- metrics --------------------------------------------------------------------------------


def test_metrics_lists_the_table() -> None:
    r = kvferry("metrics")
    assert r.returncode == 0
    names = [line.split()[0] for line in r.stdout.splitlines()]
    assert names == [m.sample_name for m in (*COUNTERS, *GAUGES)] or sorted(names) == sorted(
        m.sample_name for m in (*COUNTERS, *GAUGES)
    )


# -- top against a Prometheus page on loopback ------------------------------------------------


@pytest.fixture
def exporter() -> Iterator[tuple[str, dict[str, Any]]]:
    """A real Prometheus HTTP endpoint with kvferry's metrics, as vLLM labels them."""
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    labels = ["model_name", "engine"]
    metrics: dict[str, Any] = {}
    for m in COUNTERS:
        c = prometheus_client.Counter(m.full_name, m.help, labels, registry=registry)
        metrics[m.name] = c.labels("tiny", "0")
    for m in GAUGES:
        g = prometheus_client.Gauge(m.full_name, m.help, labels, registry=registry)
        metrics[m.name] = g.labels("tiny", "0")
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield f"http://127.0.0.1:{server.server_port}", metrics
    finally:
        server.shutdown()
        thread.join()


def test_top_once_shows_hit_rate_throughput_occupancy_and_failures(
    exporter: tuple[str, dict[str, Any]],
) -> None:
    pytest.importorskip("rich")
    url, m = exporter
    m["tokens_looked_up"].inc(1000)
    m["tokens_hit"].inc(750)
    m["load_bytes"].inc(3e9)
    m["load_seconds"].inc(2.0)
    m["stores_failed"].inc(2)
    m["host_blocks_used"].set(30)
    m["host_blocks_capacity"].set(120)
    r = kvferry("top", "--once", url)  # a bare server address: /metrics is added
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"{url}/metrics" in out
    assert "model=tiny engine=0" in out
    line = next(x for x in out.splitlines() if "hit rate" in x)
    assert "75.0%" in line
    line = next(x for x in out.splitlines() if "load GB/s" in x)
    assert "1.500 in copies" in line  # 3 GB in 2 s of copies
    line = next(x for x in out.splitlines() if "host occupancy" in x)
    assert "30 / 120 (25.0%)" in line
    line = next(x for x in out.splitlines() if x.lstrip("│ ").startswith("failures"))
    assert "0, 2, 0" in line
    assert "by cause" not in out  # no load failed


def test_top_says_why_loads_failed(exporter: tuple[str, dict[str, Any]]) -> None:
    pytest.importorskip("rich")
    url, m = exporter
    m["loads_failed"].inc(5)
    m["loads_failed_copy"].inc(3)
    m["redis_loads_failed"].inc(2)
    r = kvferry("top", "--once", url)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if "loads failed by cause" in x)
    assert "copy 3, redis 2" in line


def test_top_refreshes_until_its_frame_count(exporter: tuple[str, dict[str, Any]]) -> None:
    pytest.importorskip("rich")
    url, m = exporter
    m["tokens_loaded"].inc(128)
    t0 = time.monotonic()
    r = kvferry("top", f"{url}/metrics", "--count", "3", "--interval", "0.2")
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t0 >= 0.4  # three frames, two intervals
    assert "tokens loaded" in r.stdout


def test_top_says_when_a_server_has_no_kvferry_metrics(tmp_path: Path) -> None:
    pytest.importorskip("rich")
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    prometheus_client.Counter("vllm:prompt_tokens", "", registry=registry).inc()
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        r = kvferry("top", "--once", f"http://127.0.0.1:{server.server_port}/metrics")
    finally:
        server.shutdown()
        thread.join()
    assert r.returncode == 1
    assert "no vllm:kvferry_* metrics" in r.stdout


def test_top_of_a_server_that_is_not_there_is_a_usage_error() -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on, once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = kvferry("top", "--once", f"127.0.0.1:{port}")
    assert r.returncode == 2 and "cannot read" in r.stderr


@pytest.mark.parametrize("url", ["http://localhost:notaport", "http://[::1"])
def test_top_of_a_malformed_url_is_a_usage_error(url: str) -> None:
    pytest.importorskip("rich")
    r = kvferry("top", "--once", url)
    assert r.returncode == 2
    assert r.stderr.startswith(f"kvferry top: error: cannot read {url}")
    assert r.stderr.count("\n") == 1  # one line, no traceback


def test_top_of_a_page_that_is_not_prometheus_text_is_a_usage_error() -> None:
    pytest.importorskip("rich")
    pytest.importorskip("prometheus_client")
    import http.server
    import threading

    class Html(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<html><body>not metrics</body></html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Html)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        r = kvferry("top", "--once", url)
    finally:
        server.shutdown()
        thread.join()
        server.server_close()
    assert r.returncode == 2
    assert r.stderr.startswith(f"kvferry top: error: {url} is not a Prometheus metrics page")
    assert r.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("option", "value"), [("--interval", "inf"), ("--interval", "-1"), ("--count", "-1")]
)
def test_top_refuses_an_interval_or_count_out_of_range(option: str, value: str) -> None:
    r = kvferry("top", "127.0.0.1:9", option, value)  # refused before any request
    assert r.returncode == 2
    assert f"argument {option}: must be" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("given", "url"),
    [
        ("localhost:8000", "http://localhost:8000/metrics"),
        ("http://h:8000/", "http://h:8000/metrics"),
        ("http://h:8000/metrics", "http://h:8000/metrics"),
        ("https://h/custom/path", "https://h/custom/path"),
    ],
)
def test_a_server_address_gets_its_metrics_path(given: str, url: str) -> None:
    assert metrics_url(given) == url
