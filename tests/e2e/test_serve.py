"""kvferry behind ``vllm serve``: the OpenAI-compatible server in a subprocess, with the tiny
model and kvferry as its KV connector, on loopback.

Documents that together exceed the engine's 24-block cache are asked once, then re-asked
in another order (the re-asks load from host memory), then re-asked again with kvferry
turned off per request (``kv_transfer_params={"kvferry": {"load": false, "store":
false}}``): those recompute, and their greedy tokens are the outputs without kvferry.

In ``vllm serve`` the connector's scheduler half runs in the engine-core process; its
stats travel to the API server process, where vLLM's Prometheus logger records them
through ``KVFerryConnector.build_prom_metrics``. The test reads them from ``/metrics``.

One server per module (it starts in about a minute on 2 CPU cores).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvferry.testing import long_doc_prompts, reask_order

pytestmark = pytest.mark.e2e

NUM_DOCS, DOC_TOKENS = 6, 1000  # 8 engine blocks each: 48 blocks > the engine's 24
MAX_TOKENS = 8
BLOCK = 128  # vLLM's block size on the CPU
FULL_BLOCK_TOKENS = (DOC_TOKENS + 8) // BLOCK * BLOCK  # each prompt's tokens in full blocks
CPU_BYTES = 64 << 20
MODEL_NAME = "tiny"
START_TIMEOUT_S = 240
LOG_TAIL_CHARS = 6000
OFF = {"kvferry": {"load": False, "store": False}}
READY_LINE = b"Application startup complete"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(log: Path) -> str:
    return log.read_text(errors="replace")[-LOG_TAIL_CHARS:] if log.exists() else "(no log)"


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], base_url: str, log: Path) -> None:
        self.proc, self.base_url, self.log = proc, base_url, log

    def stop(self) -> None:
        """Stop the server's whole process group (API server, engine core, workers)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:  # children left behind by the API server die with the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)


def start_server(model: Path, log: Path, kvferry: dict[str, Any]) -> Server:
    import httpx

    port = free_port()
    kv_transfer_config = {
        "kv_connector": "KVFerryConnector",
        "kv_connector_module_path": "kvferry.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": kvferry,
    }
    # The flags of kvferry.testing.engine_args, on the command line.
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--model", str(model),
        "--served-model-name", MODEL_NAME,
        "--skip-tokenizer-init",
        "--seed", "0",
        "--gpu-memory-utilization", "0.3",
        "--num-gpu-blocks-override", "24",
        "--max-model-len", "2048",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens
        "--disable-uvicorn-access-log",
        "--kv-transfer-config", json.dumps(kv_transfer_config),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        # Compiled with inductor, as deployed (tests/e2e/conftest.py: the other engines not).
        env={k: v for k, v in os.environ.items() if k != "VLLM_CPU_CI_ENV"}
        | {"PYTHONUNBUFFERED": "1"},
        start_new_session=True,  # its own process group, killed as a whole
    )
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    # Ready is a line of the server's own log, not a poll: a thread copies its output to
    # the log file and says when uvicorn reported the start (or the output ended).
    started, ended = threading.Event(), threading.Event()

    def copy_log() -> None:
        assert proc.stdout is not None
        with log.open("wb") as out:
            for line in proc.stdout:
                out.write(line)
                out.flush()
                if READY_LINE in line:
                    started.set()
        ended.set()
        started.set()

    threading.Thread(target=copy_log, name="vllm-serve-log", daemon=True).start()
    try:
        if not started.wait(START_TIMEOUT_S):
            pytest.fail(f"vllm serve not ready after {START_TIMEOUT_S} s:\n{log_tail(log)}")
        if ended.is_set():
            proc.wait(timeout=30)
            pytest.fail(
                f"vllm serve exited with {proc.returncode} while starting:\n{log_tail(log)}"
            )
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            assert client.get("/health").status_code == 200
        return server
    except BaseException:
        server.stop()
        raise


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    srv = start_server(tiny_model, log, {"cpu_bytes_to_use": CPU_BYTES})
    try:
        yield srv
    finally:
        srv.stop()


def complete(client: Any, prompt: list[int], kv_transfer_params: Any = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": prompt,  # token ids: the server has no tokenizer
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,  # without a tokenizer, "text" is empty
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    (choice,) = out["choices"]
    return {
        "tokens": choice["token_ids"],
        "cached": (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
        "loaded": ((out.get("kv_transfer_params") or {}).get("kvferry") or {}).get(
            "tokens_loaded", 0
        ),
    }


@pytest.fixture(scope="module")
def served(server: Server) -> dict[str, Any]:
    """Three passes, one request at a time, then one scrape of ``/metrics``."""
    import httpx

    docs = long_doc_prompts(NUM_DOCS, DOC_TOKENS)
    order = reask_order(NUM_DOCS)
    try:
        with httpx.Client(base_url=server.base_url, timeout=300) as client:
            first = {d: complete(client, docs[d]) for d in range(NUM_DOCS)}
            reask = {d: complete(client, docs[d]) for d in order}
            off = {d: complete(client, docs[d], OFF) for d in order}
            r = client.get("/metrics")
            assert r.status_code == 200, r.text
            metrics = r.text
    except (httpx.HTTPError, AssertionError) as e:
        pytest.fail(f"{e!r}\nserver log:\n{log_tail(server.log)}")
    return {"first": first, "reask": reask, "off": off, "metrics": metrics}


def samples(text: str) -> dict[str, float]:
    """Sample name -> value for this server's model (one engine)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model_name") == MODEL_NAME and s.labels.get("engine", "0") == "0":
                out.setdefault(s.name, 0.0)
                out[s.name] += s.value
    return out


def test_reasks_load_from_host_memory(served: dict[str, Any]) -> None:
    assert all(served["first"][d]["loaded"] == 0 for d in range(NUM_DOCS))
    for d, r in served["reask"].items():
        # Every full block of a re-asked document was computed before: it is either still
        # in the engine's cache or loaded from kvferry, never recomputed.
        assert r["cached"] == FULL_BLOCK_TOKENS, (d, r)
        assert r["loaded"] <= r["cached"], (d, r)
    # Most come from host memory (the engine keeps at most 3 documents of 6).
    assert sum(r["loaded"] for r in served["reask"].values()) >= (NUM_DOCS - 2) * FULL_BLOCK_TOKENS


def test_outputs_equal_outputs_without_kvferry(served: dict[str, Any]) -> None:
    for d in range(NUM_DOCS):
        off = served["off"][d]
        # Turned off for this request, and nothing in the engine's own cache either (the
        # five documents asked in between hold 40 blocks > 24): all computed anew.
        assert off["loaded"] == 0 and off["cached"] == 0, (d, off)
        assert served["reask"][d]["tokens"] == off["tokens"], d
        assert served["first"][d]["tokens"] == off["tokens"], d
        assert len(off["tokens"]) == MAX_TOKENS


def test_outputs_depend_on_the_prompt(served: dict[str, Any]) -> None:
    """The comparison above has teeth: different documents give different answers."""
    assert len({tuple(served["off"][d]["tokens"]) for d in range(NUM_DOCS)}) == NUM_DOCS


def test_kvferry_metrics_reach_the_api_server(served: dict[str, Any]) -> None:
    m = samples(served["metrics"])
    names = (
        "tokens_looked_up", "tokens_hit", "tokens_missed", "tokens_loaded", "tokens_stored",
        "load_bytes", "store_bytes", "load_seconds", "store_seconds",
        "loads_failed", "stores_failed", "stores_skipped", "evictions",
    )  # fmt: skip
    for name in names:
        assert f"vllm:kvferry_{name}_total" in m, (name, sorted(k for k in m if "kvferry" in k))
    for name in ("host_blocks_used", "host_blocks_capacity", "host_usage_ratio"):
        assert f"vllm:kvferry_{name}" in m, name

    def c(name: str) -> float:
        return m[f"vllm:kvferry_{name}_total"]

    loaded = sum(r["loaded"] for p in ("first", "reask", "off") for r in served[p].values())
    assert loaded > 0
    # Loads are counted when they end, before their request computes: the counter that
    # reached /metrics is the sum of what the responses reported.
    assert c("tokens_loaded") == loaded
    assert c("tokens_hit") >= c("tokens_loaded")
    assert c("tokens_looked_up") == c("tokens_hit") + c("tokens_missed")
    assert m["vllm:external_prefix_cache_hits_total"] >= c("tokens_loaded")
    # Every document's full blocks were stored once, in the first pass.
    assert c("tokens_stored") == NUM_DOCS * FULL_BLOCK_TOKENS
    # Full attention, 2 layers, K and V, 2 KV heads of 64 bf16 values: 1 KiB per token.
    bytes_per_token = 2 * 2 * 2 * 64 * 2
    assert c("load_bytes") == c("tokens_loaded") * bytes_per_token
    assert c("store_bytes") == c("tokens_stored") * bytes_per_token
    assert c("load_seconds") > 0 and c("store_seconds") > 0
    assert c("loads_failed") == 0 and c("stores_failed") == 0
    assert c("evictions") == 0  # 64 MiB hold 512 blocks; 42 are used

    used, capacity = m["vllm:kvferry_host_blocks_used"], m["vllm:kvferry_host_blocks_capacity"]
    assert capacity == CPU_BYTES // (BLOCK * bytes_per_token)
    assert 0 < used <= capacity
    assert m["vllm:kvferry_host_usage_ratio"] == pytest.approx(used / capacity)


def test_kvferry_top_once_shows_this_servers_metrics(
    server: Server, served: dict[str, Any]
) -> None:
    """``kvferry top --once`` against this server: what it shows is what /metrics says."""
    pytest.importorskip("rich", reason="kvferry top needs its extra: kvferry[cli]")
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "COLUMNS": "120"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    r = subprocess.run(
        [sys.executable, "-m", "kvferry", "top", "--once", server.base_url],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"model={MODEL_NAME} engine=0" in r.stdout, r.stdout
    m = samples(served["metrics"])  # the counters end with the passes: scraped once more

    def row(label: str) -> str:
        return next(line for line in r.stdout.splitlines() if label in line)

    hit = m["vllm:kvferry_tokens_hit_total"] / m["vllm:kvferry_tokens_looked_up_total"]
    assert f"{hit:.1%}" in row("hit rate")
    assert f"{m['vllm:kvferry_tokens_loaded_total']:,.0f}" in row("tokens loaded")
    used, capacity = m["vllm:kvferry_host_blocks_used"], m["vllm:kvferry_host_blocks_capacity"]
    assert f"{used:,.0f} / {capacity:,.0f}" in row("host occupancy")
