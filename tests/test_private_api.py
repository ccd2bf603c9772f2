"""kvferry touches no other package's private API, outside one adapter module (issue 17).

A private API breaks without notice in a minor release (anyio's backend ``run_sync_soon``
was one). ``kvferry/_private_api.py`` is the one module allowed to use them, each behind
a probe with a public fallback. Everywhere else, this test finds:

- ``import pkg._mod`` / ``from pkg._mod import x`` / ``from pkg import _x`` of another
  package;
- ``name._x`` where ``name`` is bound by an import of another package (``asyncio._x``);
- ``obj._x`` (and ``getattr(obj, "_x")``) where no kvferry class defines ``_x``: an
  attribute of another package's object (``loop._run_once``) or of a base class from
  another package (``self._kv_transfer_config``).

Dunder names are public. A name kvferry defines (``self._x = ...``, ``def _x``, a class
attribute, ``__slots__``) may be used on any object.
"""

from __future__ import annotations

import ast
import asyncio
import contextvars
import logging
import types
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
import structlog

from kvferry import _private_api

PACKAGE = Path(__file__).resolve().parents[1] / "kvferry"
ALLOWED = {PACKAGE / "_private_api.py"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_module(module: str | None, level: int) -> bool:
    return level > 0 or module is None or module == "kvferry" or module.startswith("kvferry.")


def _defined_names(trees: list[ast.Module]) -> set[str]:
    """Private names kvferry itself defines, on any of its classes or modules."""
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)  # class attributes and module globals
        for node in ast.walk(tree):  # __slots__ = ("_a", "_b")
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
            ):
                for elt in ast.walk(node.value):
                    if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
                        names.add(elt.value)
    return {n for n in names if _private(n)}


def _foreign_names(tree: ast.Module) -> set[str]:
    """Names a module binds by importing another package (``import asyncio``, ``from
    anyio import lowlevel``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _own_module(alias.name, 0):
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and not _own_module(node.module, node.level):
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


def private_uses(tree: ast.Module, defined: set[str]) -> list[tuple[int, str]]:
    """``(line, what)`` for each private use of another package in one module."""
    foreign = _foreign_names(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _own_module(alias.name, 0) and any(map(_private, alias.name.split("."))):
                    found.append((line, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and not _own_module(node.module, node.level):
            assert node.module is not None
            if any(map(_private, node.module.split("."))):
                found.append((line, f"from {node.module} import ..."))
            for alias in node.names:
                if _private(alias.name):
                    found.append((line, f"from {node.module} import {alias.name}"))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            root = _root(node)
            if isinstance(root, ast.Name) and root.id in foreign:
                found.append((line, ast.unparse(node)))
            elif node.attr not in defined:
                found.append((line, ast.unparse(node)))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and node.args[1].value not in defined
        ):
            found.append((line, ast.unparse(node)))
    return sorted(found)


def test_no_private_api_of_another_package_outside_the_adapter_module() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    trees = {f: ast.parse(f.read_text(), str(f)) for f in files}
    defined = _defined_names(list(trees.values()))
    found = [
        f"{f.relative_to(PACKAGE.parent)}:{line}: {what}"
        for f, tree in trees.items()
        if f not in ALLOWED
        for line, what in private_uses(tree, defined)
    ]
    assert not found, "another package's private API (use or add a probe in _private_api.py):\n" + (
        "\n".join(found)
    )


def test_the_scan_finds_each_kind_of_private_use() -> None:
    """The scanner itself: each pattern it must catch, and what it must let through."""
    tree = ast.parse(
        "import asyncio\n"
        "import anyio._backends\n"
        "from vllm.x import _y\n"
        "from torch._C import z\n"
        "from ._cell import _Cell\n"
        "class A(Base):\n"
        "    __slots__ = ('_mine',)\n"
        "    def __init__(self, loop):\n"
        "        self._own = 1\n"
        "        asyncio._set_running_loop(loop)\n"
        "        loop._run_once()\n"
        "        self._kv_transfer_config.x = 1\n"
        "        getattr(loop, '_thread_id')\n"
        "        self._own, self._mine, loop.__class__, self._helper(), _Cell._x\n"
        "    def _helper(self):\n"
        "        return asyncio.get_running_loop()\n"
    )
    assert private_uses(tree, _defined_names([tree]) | {"_x"}) == [
        (2, "import anyio._backends"),
        (3, "from vllm.x import _y"),
        (4, "from torch._C import ..."),
        (10, "asyncio._set_running_loop"),
        (11, "loop._run_once"),
        (12, "self._kv_transfer_config"),
        (13, "getattr(loop, '_thread_id')"),
    ]


# -- the adapter module's probes: each use takes its public path when asked or when what it
# -- needs is missing, and says which path it took, once.


@pytest.fixture
def log_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_private_api, "_logged", set())


def only_public(monkeypatch: pytest.MonkeyPatch, public: bool) -> None:
    """``KVFERRY_PUBLIC_API_ONLY`` set (``public``) or not, for one test."""
    if public:
        monkeypatch.setenv(_private_api.PUBLIC_ONLY_ENV, "1")
    else:
        monkeypatch.delenv(_private_api.PUBLIC_ONLY_ENV, raising=False)


class _Unlike(asyncio.SelectorEventLoop):
    """A loop whose internals differ from what the probe needs (another CPython)."""

    _asyncgen_firstiter_hook = None


@pytest.mark.parametrize(
    ("public", "loop_factory", "path"),
    [
        (False, asyncio.new_event_loop, "run_once"),
        (True, asyncio.new_event_loop, "run_forever"),
        (False, _Unlike, "run_forever"),
    ],
)
def test_the_loop_stepper_steps_on_the_path_its_probe_chose(
    public: bool,
    loop_factory: Callable[[], asyncio.AbstractEventLoop],
    path: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    log_once: None,
) -> None:
    only_public(monkeypatch, public)
    loop = loop_factory()
    try:
        with caplog.at_level(logging.INFO, logger="kvferry"):
            stepper = _private_api.LoopStepper(loop)
            _private_api.LoopStepper(loop)
        assert stepper.path == path
        logged = [r.getMessage() for r in caplog.records if "private_api_path" in r.getMessage()]
        quiet = "ready queue, timers, selector" if path == "run_once" else "never"
        assert len(logged) == 2 and f"path='{path}'" in logged[0]  # once each
        assert "use='stepped loop quiescent'" in logged[1] and f"path='{quiet}'" in logged[1]
        done = loop.create_future()
        loop.call_soon(lambda: loop.call_soon(done.set_result, 7))
        assert not stepper.quiescent()  # a callback is ready
        done.add_done_callback(lambda _: stepper.set())
        stepper.run_until(done.done, lambda: None)
        assert done.result() == 7
        assert not _running_loop_here()  # the running-loop state was put back
        ran: list[int] = []
        # One more iteration runs the future's callbacks (set: run_forever's stop).
        loop.call_soon(lambda: (ran.append(1), stepper.set()))
        stepper.run_until(lambda: bool(ran), lambda: None)
        # Nothing left to run: quiescent where the loop's queues can be read, else never.
        assert stepper.quiescent() == (path == "run_once")
        timer = loop.call_later(3600, lambda: None)
        assert stepper.quiescent() == (path == "run_once")  # a timer not due yet
        timer.cancel()
        assert stepper.run_now(asyncio.get_running_loop) is loop
        assert not _running_loop_here()
    finally:
        loop.close()


def _running_loop_here() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("public", [False, True])
def test_the_ask_event_and_log_key_shortcuts_fall_back_to_anyio_and_structlog(
    public: bool, monkeypatch: pytest.MonkeyPatch, log_once: None
) -> None:
    only_public(monkeypatch, public)

    async def main() -> None:
        new_event = _private_api.event_factory()
        assert (new_event is anyio.Event) == public
        event = new_event()
        assert isinstance(event, anyio.Event)
        event.set()
        await event.wait()

    anyio.run(main)

    def in_context() -> object:
        _private_api.context_var_setter("message")("Lookup")
        return structlog.contextvars.get_contextvars().get("message")

    assert contextvars.Context().run(in_context) == "Lookup"
    assert "message" not in structlog.contextvars.get_contextvars()


def test_an_engine_is_shut_down_through_its_engine_core_where_it_has_one(log_once: None) -> None:
    calls: list[str] = []
    core = types.SimpleNamespace(shutdown=lambda: calls.append("shutdown"))
    llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(engine_core=core))
    assert _private_api.shutdown_engine_core(llm) and calls == ["shutdown"]
    assert not _private_api.shutdown_engine_core(types.SimpleNamespace(llm_engine=None))


@pytest.mark.parametrize("public", [False, True])
def test_the_redis_reply_stream_falls_back_to_the_parser(
    public: bool,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    log_once: None,
) -> None:
    from redis.asyncio.connection import Connection

    only_public(monkeypatch, public)
    with caplog.at_level(logging.INFO, logger="kvferry"):
        assert _private_api.redis_streams_replies() is not public
        _private_api.redis_streams_replies()
    logged = [r.getMessage() for r in caplog.records if "private_api_path" in r.getMessage()]
    assert len(logged) == 1  # once
    assert f"path='{'parser' if public else 'stream'}'" in logged[0]
    conn = Connection()
    assert _private_api.reply_stream(conn) is None  # not connected: the parser reads
    error = _private_api.reply_error(conn, "WRONGTYPE Operation against a key")
    assert type(error).__name__ == "ResponseError" and "WRONGTYPE" in str(error)
