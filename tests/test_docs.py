"""Docs that cannot rot: every ``python`` block of README.md and docs/*.md runs, the
metrics reference is the one generated from the table, and docs/configuration.md lists
every key with its true default.

A document's blocks run in order in one namespace (a later block uses what an earlier one
defined), with top-level ``await`` allowed. The only names a block gets without importing
them are those its text presents as given (:data:`GIVEN`): ``MODEL`` is the tiny model,
and docs/actors.md shows actors without repeating its imports. A block that starts a vLLM
engine runs it for real on the tiny model; only the settings a CPU test machine needs
(``ENGINE_ON_CPU``) are added to the snippet's own arguments, and the engine is closed
after.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from kvferry import FerryConfig
from kvferry._metrics import reference_markdown

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
ENGINE_ON_CPU = {
    "skip_tokenizer_init": True,  # the tiny model has no tokenizer
    "gpu_memory_utilization": 0.3,  # on the CPU: a share of host memory
    "num_gpu_blocks_override": 24,
    "max_model_len": 2048,
    "enforce_eager": True,  # a compiled start costs minutes on a 2-core test machine
}


def given(doc: Path) -> dict[str, Any]:
    """The names a document's blocks take from its text, not from an import."""
    names: dict[str, Any] = {"__name__": f"doc:{doc.name}"}
    if doc.name == "actors.md":
        import kvferry.actors

        names["attrs"] = attrs
        names |= {n: getattr(kvferry.actors, n) for n in kvferry.actors.__all__}
    if doc.name == "tracing.md":
        pytest.importorskip("vllm")
        from vllm.config import KVTransferConfig

        names["KVTransferConfig"] = KVTransferConfig
    return names


def blocks(doc: Path) -> list[str]:
    return BLOCK.findall(doc.read_text())


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvferry.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def engines_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """``vllm.LLM`` with the CPU test settings added; every engine started is closed."""
    vllm = pytest.importorskip("vllm")
    from kvferry.testing import close_engine, equal_cpu_threads

    equal_cpu_threads()
    started: list[Any] = []
    real = vllm.LLM

    class LLM(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**ENGINE_ON_CPU, **kwargs})
            started.append(self)

    monkeypatch.setattr(vllm, "LLM", LLM)
    try:
        yield started
    finally:
        for llm in started:
            close_engine(llm)


def run_blocks(doc: Path, namespace: dict[str, Any]) -> None:
    for i, code in enumerate(blocks(doc)):
        compiled = compile(
            code, f"{doc.name} block {i + 1}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
        )
        result = eval(compiled, namespace)  # a coroutine when the block awaits
        if inspect.iscoroutine(result):
            asyncio.run(result)


def starts_an_engine(doc: Path) -> bool:
    return any("LLM(" in code for code in blocks(doc))


@pytest.mark.parametrize(
    "doc",
    [d for d in DOCS if blocks(d) and not starts_an_engine(d)],
    ids=lambda d: d.relative_to(ROOT).as_posix(),
)
def test_the_python_blocks_of_a_document_run(doc: Path) -> None:
    run_blocks(doc, given(doc))


@pytest.mark.e2e
@pytest.mark.parametrize(
    "doc",
    [d for d in DOCS if starts_an_engine(d)],
    ids=lambda d: d.relative_to(ROOT).as_posix(),
)
def test_the_python_blocks_that_start_an_engine_run_on_the_tiny_model(
    doc: Path, tiny_model: Path, engines_on_cpu: list[Any]
) -> None:
    namespace = {**given(doc), "MODEL": str(tiny_model)}
    run_blocks(doc, namespace)
    assert engines_on_cpu, "the block was expected to start an engine"
    # The engine it started offloads with kvferry: a prompt asked again after the
    # engine's own cache was cleared is loaded from host memory.
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvferry.testing import long_doc_prompts

    [prompt] = long_doc_prompts(1, 600)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for llm in engines_on_cpu:
        loaded = []
        for _ in range(2):
            [out] = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            loaded.append((out.kv_transfer_params or {}).get("kvferry", {}).get("tokens_loaded"))
            llm.reset_prefix_cache()
        assert loaded[0] == 0 and loaded[1] > 0, loaded


def test_every_document_with_code_is_found() -> None:
    """The block pattern finds what it should (a test of the tests above)."""
    assert len(blocks(ROOT / "README.md")) >= 1
    assert len(blocks(ROOT / "docs" / "configuration.md")) >= 2


def test_the_metrics_reference_is_generated_from_the_table() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    assert doc == reference_markdown(), (
        "docs/metrics.md differs from kvferry/_metrics.py: regenerate it with "
        "`python -m kvferry metrics --markdown > docs/metrics.md`"
    )


def configuration_rows() -> dict[str, str]:
    text = (ROOT / "docs" / "configuration.md").read_text()
    rows = re.findall(r"^\| `([a-z_]+)` \| ([^|]+) \|", text, re.MULTILINE)
    return {key: default.strip() for key, default in rows}


def test_the_configuration_doc_lists_every_key_with_its_default() -> None:
    rows = configuration_rows()
    assert list(rows) == list(FerryConfig.KEYS)
    fields = attrs.fields_dict(FerryConfig)
    for key, cell in rows.items():
        default = fields[key].default
        if default is attrs.NOTHING:
            assert cell == "required", key
            continue
        assert cell.startswith("`") and cell.endswith("`"), (key, cell)
        expected = list(default) if isinstance(default, tuple) else default
        assert json.loads(cell.strip("`")) == expected, (key, cell, default)
