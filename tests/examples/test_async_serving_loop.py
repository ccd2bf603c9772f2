"""examples/async_serving_loop.py runs, and what it loads is what it stored."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "async_serving_loop.py"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("async_serving_loop", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


SMALL = {"num_docs": 3, "doc_blocks": 2, "new_tokens": 3, "concurrency": 2, "engine_blocks": 12}


def test_loaded_kv_equals_the_kv_that_was_stored(example: ModuleType) -> None:
    report = asyncio.run(example.main(use_kvferry=True, **SMALL))
    assert report.blocks_stored == 3 * 2  # every document's full blocks, once
    assert report.blocks_loaded == 3 * 2  # all of them again in the second pass
    assert report.loaded_blocks_checked == report.blocks_loaded
    assert report.loaded_blocks_differing == 0


def test_outputs_equal_the_outputs_without_kvferry_with_less_compute(example: ModuleType) -> None:
    without = asyncio.run(example.main(use_kvferry=False, **SMALL))
    with_ferry = asyncio.run(example.main(use_kvferry=True, **SMALL))
    assert with_ferry.outputs == without.outputs
    assert len(without.outputs) == 6
    assert with_ferry.blocks_computed == without.blocks_computed - with_ferry.blocks_loaded


def test_the_example_runs_as_a_script(
    example: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    import runpy

    runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    assert "greedy outputs identical to the run without kvferry: True" in out
