"""`make demo` as a newcomer sees it: examples/demo.py run as a program, on fewer documents.

Its stdout must read as a report, not a log: no traceback (vLLM's own logs, tracebacks
included, go to the log file it names), the table, a chart of the size it promises, and
one request's journey from the traces it recorded.
"""

from __future__ import annotations

import importlib.util
import os
import re
import struct
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "demo.py"
# 6 documents of 8 blocks: 48 blocks, more than the demo engine's 32.
ARGS = ["--docs", "6", "--doc-tokens", "1000"]


def demo_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvferry_demo", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # attrs looks the module up
    spec.loader.exec_module(module)
    return module


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", head
    width, height = struct.unpack(">II", head[16:24])
    return width, height


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("matplotlib", reason="the demo needs its extra: kvferry[demo]")
    pytest.importorskip("rich", reason="the demo needs its extra: kvferry[demo]")
    out = tmp_path_factory.mktemp("demo")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, str(DEMO), *ARGS, "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=out,
        timeout=400,
    )
    return {"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr, "out": out}


def test_the_demo_succeeds_and_prints_no_traceback(demo: dict[str, Any]) -> None:
    assert demo["rc"] == 0, demo["stdout"] + demo["stderr"]
    assert "Traceback" not in demo["stdout"]
    assert "Traceback" not in demo["stderr"], demo["stderr"]
    assert "WARNING" not in demo["stdout"] and "INFO" not in demo["stdout"]


def test_vllm_logs_of_every_process_go_to_the_printed_file(demo: dict[str, Any]) -> None:
    m = re.search(r"vLLM's logs go to (\S+)", demo["stdout"])
    assert m, demo["stdout"]
    log = Path(m.group(1))
    assert log == demo["out"] / "vllm.log"
    text = log.read_text()
    # Lines of the engine-core process and of its worker: children's output came too.
    assert re.search(r"\(EngineCore\S* pid=\d+\)", text), text[-3000:]
    assert re.search(r"\((Vllm)?Worker\S* pid=\d+\)", text), text[-3000:]


def test_the_table_reports_loads_and_matching_outputs(demo: dict[str, Any]) -> None:
    out = demo["stdout"]
    assert "prefix caching alone" in out and "prefix caching + kvferry" in out
    assert "outputs matched (greedy token ids, every request, both passes): yes" in out
    row = next(line for line in out.splitlines() if "prefix caching + kvferry" in line)
    numbers = [float(x.replace(",", "")) for x in re.findall(r"[\d,]+(?:\.\d+)?", row)]
    loaded = numbers[-2]
    assert loaded > 0, row


def test_the_chart_has_the_promised_size(demo: dict[str, Any]) -> None:
    m = re.search(r"chart of pass-2 latencies: (\S+)", demo["stdout"])
    assert m, demo["stdout"]
    chart = Path(m.group(1))
    module = demo_module()
    w_in, h_in = module.CHART_INCHES
    assert module.CHART_SIZE_PX == (round(w_in * module.CHART_DPI), round(h_in * module.CHART_DPI))
    assert png_size(chart) == module.CHART_SIZE_PX


def test_one_requests_journey_is_printed_from_the_recorded_traces(demo: dict[str, Any]) -> None:
    out = demo["stdout"]
    assert "one request's KV journey" in out, out
    journey = out.split("one request's KV journey", 1)[1]
    for span in ("kvferry", "lookup kv_blocks", "load kv_blocks", "copy kv_blocks"):
        assert span in journey, span
    assert list((demo["out"] / "traces").glob("kvferry-scheduler-*.json"))
    assert list((demo["out"] / "traces").glob("kvferry-worker-*.json"))
