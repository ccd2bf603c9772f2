"""Every use kvferry makes of another package's private API, each behind a probe.

A private API can change in any release (anyio's backend ``run_sync_soon`` did, between
4.15 and 4.16), so kvferry uses one only where no public API does the job and the gain is
measured, and only here: ``tests/test_private_api.py`` holds that no other module touches
a ``_``-prefixed attribute of another package. Each use probes for what it needs when
its user starts, takes a public path when something is missing (or when
``KVFERRY_PUBLIC_API_ONLY=1`` is set), and logs once per process which path it took
(``private_api_path``, with ``use`` and ``path``).

The uses, each with its private path (and the gain measured here) and its public path:

- :class:`LoopStepper` (the stepped runtime): asyncio's ``_run_once`` inside the
  running-loop state that ``run_forever`` sets up, about 3 µs of a 10 µs call; else
  ``run_forever`` + ``stop``. Its :meth:`~LoopStepper.quiescent` reads the loop's ready
  queue, timer heap and selector (nothing to run, no timer due, no file watched) so that
  a message can be handled without an iteration (tens of µs an ask, in situ on the
  engine thread); else the loop is never taken as quiescent (every message takes its
  iteration);
- :func:`event_factory` (one event per ask): anyio's backend ``Event`` class, looked up
  once, about 1.2 µs an ask; else ``anyio.Event()``;
- :func:`context_var_setter` (an actor's ``message`` log key): structlog's own
  ``ContextVar`` for the key, about 1 µs a message; else ``bind_contextvars``;
- :func:`shutdown_engine_core` (``kvferry.testing``): vLLM 0.32 has no public way to end
  an ``LLM``'s engine-core process now; else it ends when the ``LLM`` is collected;
- :func:`redis_streams_replies` / :func:`reply_stream` / :func:`reply_error` (the Redis
  tier's reads): a ``redis.asyncio`` connection's stream and its parser, so that a read
  takes each reply straight into its host slot (256 KiB reads at 0.89-0.98 of a raw GET
  against 0.76-0.77, measured with ``benchmarks/shared_tier.py``); else the parser reads
  each reply whole and the store verifies and copies it.

Who owns what: nothing here holds state but the set of uses already logged.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import anyio
import structlog

from ._logging import get_logger

PUBLIC_ONLY_ENV = "KVFERRY_PUBLIC_API_ONLY"

_logged: set[tuple[str, str]] = set()


def public_only() -> bool:
    """True when ``KVFERRY_PUBLIC_API_ONLY`` asks for the public path everywhere."""
    return os.environ.get(PUBLIC_ONLY_ENV, "").strip().lower() in ("1", "true", "yes")


def _chose(use: str, path: str, why: str) -> None:
    if (use, path) not in _logged:
        _logged.add((use, path))
        get_logger("kvferry").info("private_api_path", use=use, path=path, why=why)


def _loop_running_here() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


# -- the stepped runtime's loop ------------------------------------------------------------


class LoopStepper:
    """Runs an asyncio loop on the calling thread, until a condition holds.

    Private path (CPython's own loops): calls the loop's ``_run_once`` itself, inside the
    state ``run_forever`` would set up (running loop, async-generator hooks, thread id),
    and checks the condition after each iteration. Public path: ``run_forever``, which
    :meth:`set` stops after each iteration in which something the caller waits for
    happened. ``path`` says which ("run_once" or "run_forever").

    ``set`` makes the stepper a reply's waker: the answer ends the step.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._run_once: Callable[[], None] | None = None
        self._hooks: tuple[Any, Any] = (None, None)
        why = "asked by " + PUBLIC_ONLY_ENV
        if not public_only():
            run_once = getattr(loop, "_run_once", None)
            hooks = (
                getattr(loop, "_asyncgen_firstiter_hook", None),
                getattr(loop, "_asyncgen_finalizer_hook", None),
            )
            usable = (
                callable(run_once)
                and None not in hooks
                and hasattr(loop, "_thread_id")
                and callable(getattr(asyncio, "_set_running_loop", None))
                and callable(getattr(asyncio, "_get_running_loop", None))
            )
            if usable:
                self._run_once, self._hooks = run_once, hooks
            why = "measured cheaper" if usable else f"{type(loop).__name__}: not as probed"
        self.path = "run_once" if self._run_once is not None else "run_forever"
        _chose("stepped loop", self.path, why)
        # What quiescent() reads: the ready queue, the timer heap, the selector's map and
        # the self-pipe's file descriptor (the one file every selector loop watches).
        self._ready: Any = None
        self._scheduled: Any = None
        self._fds: Any = None
        self._own_fds = 0
        if self._run_once is not None:
            ready = getattr(loop, "_ready", None)
            scheduled = getattr(loop, "_scheduled", None)
            fds = getattr(getattr(loop, "_selector", None), "get_map", None)
            ssock = getattr(loop, "_ssock", None)
            if (
                hasattr(ready, "__len__")
                and isinstance(scheduled, list)
                and callable(fds)
                and ssock is not None
            ):
                self._ready, self._scheduled, self._fds = ready, scheduled, fds
                self._own_fds = len(fds())
        quiet = "ready queue, timers, selector" if self._fds is not None else "never"
        _chose("stepped loop quiescent", quiet, why if self._fds is None else "measured cheaper")

    def set(self) -> None:
        if self._run_once is None:
            self.loop.stop()

    def quiescent(self) -> bool:
        """True when an iteration of the loop would find nothing to do: no callback
        ready, no timer due, and no file watched but the loop's own (a socket's data is
        only seen by an iteration). False whenever that cannot be read."""
        fds = self._fds
        if fds is None or self._ready:
            return False
        scheduled = self._scheduled
        if scheduled and scheduled[0].when() <= self.loop.time():
            return False
        return len(fds()) <= self._own_fds

    def run_now(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on this thread as if inside an iteration (the loop is the running
        loop meanwhile: anyio finds its backend, futures their loop), between iterations."""
        if asyncio._get_running_loop() is not None:  # raises nothing when none runs
            raise RuntimeError("SteppedRuntime cannot be driven from inside a running loop")
        asyncio._set_running_loop(self.loop)
        try:
            return fn(*args)
        finally:
            asyncio._set_running_loop(None)

    def run_until(self, until: Callable[[], bool], check: Callable[[], None]) -> None:
        """Step until ``until()``; ``check()`` runs before each step and may raise."""
        loop = self.loop
        if _loop_running_here():
            raise RuntimeError("SteppedRuntime cannot be driven from inside a running loop")
        run_once = self._run_once
        if run_once is None:
            while not until():
                check()
                loop.run_forever()
            return
        old_hooks = sys.get_asyncgen_hooks()
        asyncio._set_running_loop(loop)
        sys.set_asyncgen_hooks(*self._hooks)
        loop._thread_id = threading.get_ident()  # type: ignore[attr-defined]
        try:
            while not until():
                check()
                run_once()
        finally:
            loop._thread_id = None  # type: ignore[attr-defined]
            asyncio._set_running_loop(None)
            sys.set_asyncgen_hooks(*old_hooks)


# -- one event per ask ----------------------------------------------------------------------


def event_factory() -> Callable[[], anyio.Event]:
    """A constructor of the running backend's ``anyio.Event``; call it in the loop.

    ``anyio.Event()`` looks the backend up on each call, most of its cost (about 2 µs of
    2.5 here); an ask needs one event, so an actor's cell looks the class up once and
    builds it directly. Public path: ``anyio.Event`` itself.
    """
    if public_only():
        _chose("ask event", "anyio.Event", "asked by " + PUBLIC_ONLY_ENV)
        return anyio.Event
    cls = type(anyio.Event())
    try:
        probe = cls()
    except TypeError:
        probe = None
    if not isinstance(probe, anyio.Event):
        _chose("ask event", "anyio.Event", f"{cls.__name__} cannot be built directly")
        return anyio.Event
    _chose("ask event", "backend class", "measured cheaper")
    return cls


# -- structlog's context variables ----------------------------------------------------------


def context_var_setter(key: str) -> Callable[[str], object]:
    """A setter of structlog's context variable ``key`` in the current context.

    structlog keeps one ``ContextVar`` per key; binding in a throwaway context hands it
    over (``Token.var``), and setting it directly costs a fraction of
    ``bind_contextvars`` (an actor sets ``message`` for every message it handles). The
    probe checks that ``get_contextvars`` sees a value set that way; else the setter
    binds through ``bind_contextvars``.
    """

    def bind(value: str) -> object:
        return structlog.contextvars.bind_contextvars(**{key: value})

    if public_only():
        _chose("log context", "bind_contextvars", "asked by " + PUBLIC_ONLY_ENV)
        return bind
    try:
        tokens = contextvars.Context().run(structlog.contextvars.bind_contextvars, **{key: None})
        var = tokens[key].var

        def seen() -> object:
            var.set("probe")
            return structlog.contextvars.get_contextvars().get(key)

        usable = contextvars.Context().run(seen) == "probe"
    except Exception:  # any change of structlog's design: take the public path
        usable = False
    if not usable:
        _chose("log context", "bind_contextvars", "structlog's variable is not settable")
        return bind
    _chose("log context", "context var", "measured cheaper")
    return var.set


# -- vLLM's engine (kvferry.testing) ---------------------------------------------------------


def shutdown_engine_core(llm: Any) -> bool:
    """Shut a ``vllm.LLM``'s engine-core process down now; False if there is no way to.

    vLLM 0.32 has no public shutdown for ``LLM`` (its engine ends when the object is
    collected), so this goes through ``llm.llm_engine.engine_core.shutdown()``.
    """
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    shutdown = getattr(engine_core, "shutdown", None)
    if not callable(shutdown):
        _chose("engine shutdown", "garbage collection", "no llm_engine.engine_core.shutdown")
        return False
    _chose("engine shutdown", "engine_core.shutdown", "no public shutdown in vLLM 0.32")
    shutdown()
    return True


# -- redis-py's connections (the Redis tier's reads) -----------------------------------------


def redis_streams_replies() -> bool:
    """Whether ``redis.asyncio`` connections have what :func:`reply_stream` and
    :func:`reply_error` read: the stream a connection reads its replies from
    (``Connection._reader``, an asyncio ``StreamReader`` once connected) and its parser
    (``Connection._parser``: hiredis's keeps its ``hiredis.Reader`` as ``_reader``,
    whose public ``has_data`` says whether it holds bytes; every parser maps an error
    line to its exception with ``parse_error``). Probed on a connection made, not
    opened. False: the store's reads take each reply from the parser."""
    if public_only():
        _chose("redis reply stream", "parser", "asked by " + PUBLIC_ONLY_ENV)
        return False
    try:
        import hiredis
        from redis.asyncio.connection import Connection

        conn = Connection()
        usable = (
            hasattr(conn, "_reader")
            and callable(getattr(getattr(conn, "_parser", None), "parse_error", None))
            and callable(getattr(hiredis.Reader(), "has_data", None))
        )
    except Exception:  # no hiredis, or another design of redis-py: the parser reads
        usable = False
    if not usable:
        _chose("redis reply stream", "parser", "redis-py or hiredis not as probed")
        return False
    _chose("redis reply stream", "stream", "measured cheaper")
    return True


def reply_stream(connection: Any) -> Any:
    """The asyncio ``StreamReader`` ``connection`` reads its replies from, when its
    parser holds none of their bytes (hiredis's, between replies); else None (the
    parser must read the next reply). Only after :func:`redis_streams_replies`."""
    buffered = getattr(getattr(connection._parser, "_reader", None), "has_data", None)
    stream = connection._reader
    if buffered is None or stream is None or buffered():
        return None
    return stream


def reply_error(connection: Any, text: str) -> Exception:
    """The exception ``connection``'s parser makes of an error line (``MOVED ...`` on a
    cluster: its redirection)."""
    error: Exception = connection._parser.parse_error(text)
    return error
