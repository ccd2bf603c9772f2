"""What pyproject.toml promises: tested floors, optional parts as extras (issue 17, issue 12
defect 9)."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
UNTESTED_FLOORS = {"torch"}  # only the local CPU build of torch 2.13 installs here


def _name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9_.-]+", requirement)
    assert match is not None, requirement
    return match.group(0).lower().replace("_", "-")


def _version(text: str) -> tuple[int, ...]:
    parts = [int(p) for p in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def _floors(requirements: list[str]) -> dict[str, tuple[int, ...]]:
    floors = {}
    for req in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([\d.]+)(,<[\d.]+)?", req)
        assert match is not None, f"{req}: a direct dependency has a floor (>=)"
        floors[_name(req)] = _version(match.group(2))
    return floors


def _pins() -> dict[str, tuple[int, ...]]:
    pins = {}
    for line in (ROOT / "constraints-floor.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[_name(name)] = _version(version)
    return pins


def test_the_floor_venv_installs_every_dependency_at_its_floor() -> None:
    pins = _pins()
    extras = PROJECT["optional-dependencies"]
    floors = _floors(PROJECT["dependencies"])
    for extra in ("cpu-kernel", "traces"):
        floors |= _floors(extras[extra])
    floors |= {
        name: floor
        for name, floor in _floors(extras["test"]).items()
        if name in pins  # the test tools the floor suite runs with
    }
    for name, floor in floors.items():
        if name in UNTESTED_FLOORS:
            assert name in pins
            continue
        assert pins.get(name) == floor, f"{name}: floor {floor}, floor venv {pins.get(name)}"
    for tool in ("pytest", "pytest-asyncio", "trio", "hypothesis"):
        assert tool in pins


def test_optional_parts_are_extras_not_dependencies() -> None:
    core = {_name(r) for r in PROJECT["dependencies"]}
    extras = {k: {_name(r) for r in v} for k, v in PROJECT["optional-dependencies"].items()}
    assert "llvmlite" not in core and "llvmlite" in extras["cpu-kernel"]
    assert "numba" not in core and "numba" in extras["jit"]
    assert "opentelemetry-sdk" not in core and "opentelemetry-sdk" in extras["traces"]
    assert "safetensors" in extras["test"]
    # the main venv installs the fast CPU kernel, so that it is what the tests exercise
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"pip install .*-e '\.\[[^]]*cpu-kernel[^]]*\]'", makefile)
    # and the compiled directory loops; the floor venv, without numba, tests the Python ones
    assert re.search(r"pip install .*-e '\.\[[^]]*jit[^]]*\]'", makefile)


def test_make_tiny_model_says_what_to_install_without_safetensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvferry.testing import make_tiny_model

    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r"kvferry\[test\]"):
        make_tiny_model(tmp_path)
