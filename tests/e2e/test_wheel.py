"""A wheel that installs: ``python -m build`` makes one (from its sdist), a fresh virtualenv
takes it, and an engine started there loads ``kvferry.connector`` from the installed wheel.

The fresh virtualenv reuses the torch and vLLM of the environment running the tests (a
``.pth`` line adds that environment's site-packages after the new one's own), so nothing
is downloaded; the wheel itself is installed with ``--no-index``. The engine runs with the
temporary folder as its working directory and no ``PYTHONPATH``, so the source tree cannot
be imported by accident.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "kvferry")
OPTIONAL = ("rich", "matplotlib", "prometheus-client", "opentelemetry-exporter-otlp-proto-http",
            "opentelemetry-exporter-otlp-proto-grpc")  # fmt: skip

ENGINE = """
import json, sys
from pathlib import Path

import kvferry
import kvferry.connector
from kvferry.testing import close_engine, engine_args, long_doc_prompts, make_tiny_model

def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model = make_tiny_model(Path(sys.argv[1]) / "model")
    llm = LLM(**engine_args(model, kvferry={"cpu_bytes_to_use": 16 << 20}, enforce_eager=True))
    [doc] = long_doc_prompts(1, 600)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = []
    for _ in range(2):
        [o] = llm.generate([TokensPrompt(prompt_token_ids=doc)], params, use_tqdm=False)
        outs.append(o)
        llm.reset_prefix_cache()  # the second ask can only hit kvferry's host tier
    close_engine(llm)
    print("RESULT " + json.dumps({
        "kvferry": kvferry.__file__,
        "connector": kvferry.connector.__file__,
        "prefix": sys.prefix,
        "loaded": [(o.kv_transfer_params or {}).get("kvferry", {}).get("tokens_loaded")
                   for o in outs],
        "same_tokens": outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids,
    }))

if __name__ == "__main__":
    main()
"""


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert r.returncode == 0, f"{cmd}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("build", reason="the wheel test needs build (kvferry[test])")
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    dist = tmp_path_factory.mktemp("dist")
    # --no-isolation: the setuptools already here builds it (no download); sdist first,
    # then the wheel from the sdist, so a file missing from the sdist is caught too.
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)])
    [whl] = dist.glob("kvferry-*.whl")
    assert list(dist.glob("kvferry-*.tar.gz"))
    return whl


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", str(env)])
    py = env / "bin" / "python"
    site = run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    here = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    # After the new environment's own site-packages: torch, vLLM and kvferry's
    # dependencies from the environment running the tests, never downloaded.
    Path(site.stdout.strip(), "reuse-test-environment.pth").write_text("\n".join(sorted(here)))
    # --ignore-installed: the test environment's own kvferry (an editable install, seen
    # through the .pth line) is neither uninstalled nor taken for this one.
    pip = [str(py), "-m", "pip", "install", "--quiet", "--no-index", "--no-deps"]
    run([*pip, "--ignore-installed", str(wheel)])
    return env


def test_the_wheel_holds_the_package_and_its_data_only(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert all(n.startswith(("kvferry/", "kvferry-")) for n in names), names
    for needed in ("kvferry/_assets/tiny-llama.json", "kvferry/py.typed", "kvferry/_cli.py"):
        assert needed in names


def test_optional_parts_stay_optional(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    requires = [x.split(":", 1)[1].strip() for x in lines if x.startswith("Requires-Dist:")]
    found = 0
    for req in requires:
        if req.lower().replace("_", "-").startswith(OPTIONAL):
            assert "extra ==" in req, req
            found += 1
    assert found >= len(OPTIONAL)  # each is there, behind an extra
    extras = {x.split(":", 1)[1].strip() for x in lines if x.startswith("Provides-Extra:")}
    assert {"cli", "demo", "traces"} <= extras


def test_its_dependencies_are_met_without_downloading(venv: Path) -> None:
    check = (
        "import importlib.metadata as md\n"
        "from packaging.requirements import Requirement\n"
        "bad = []\n"
        "for r in map(Requirement, md.requires('kvferry') or []):\n"
        "    if r.marker is not None and not r.marker.evaluate({'extra': ''}):\n"
        "        continue\n"
        "    try:\n"
        "        v = md.version(r.name)\n"
        "    except md.PackageNotFoundError:\n"
        "        bad.append(str(r)); continue\n"
        "    if not r.specifier.contains(v, prereleases=True):\n"
        "        bad.append(f'{r} (found {v})')\n"
        "print(bad)\n"
    )
    r = run([str(venv / "bin" / "python"), "-c", check], cwd=venv)
    assert r.stdout.strip() == "[]", r.stdout


def test_the_kvferry_command_is_installed(venv: Path) -> None:
    config = {
        "kv_connector": "KVFerryConnector",
        "kv_connector_module_path": "kvferry.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20},
    }
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = run([str(venv / "bin" / "kvferry"), "check-config", json.dumps(config)], cwd=venv, env=env)
    assert r.stdout.strip().endswith("ok")


def test_an_engine_loads_the_connector_from_the_installed_wheel(venv: Path) -> None:
    pytest.importorskip("vllm", reason="starting an engine needs vLLM (make test installs it)")
    script = venv / "engine.py"
    script.write_text(ENGINE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = run([str(venv / "bin" / "python"), str(script), str(venv)], cwd=venv, env=env)
    [line] = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    site = Path(result["prefix"]).resolve()
    assert site == venv.resolve()
    for key in ("kvferry", "connector"):
        assert Path(result[key]).resolve().is_relative_to(site), result
        assert not Path(result[key]).resolve().is_relative_to(ROOT), result
    assert result["loaded"][0] == 0 and result["loaded"][1] > 0, result
    assert result["same_tokens"], result
