"""Driving an :class:`ActorSystem` from synchronous code (vLLM's connector calls).

Two runtimes, one interface (:class:`SyncRuntime`):

- :class:`SteppedRuntime` runs the event loop *on the caller's thread*, only while a call
  is in progress: ``call`` runs the loop until its coroutine is done, and the actors'
  tasks stay suspended between calls. No extra thread competes with the engine for the
  GIL; completions from copy threads are polled at each call. This is what the vLLM
  facade uses (see docs/architecture.md).
- :class:`ThreadRuntime` runs the loop on a dedicated thread behind an anyio
  ``BlockingPortal``; ``call`` is a portal round-trip. Needed where the caller's thread
  already runs an event loop.

Who owns what: the runtime owns its loop and the host task that keeps the actor system
open; ``call`` and ``close`` must come from one thread at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import anyio
import anyio.from_thread

from ._system import ActorSystem

T = TypeVar("T")
S = TypeVar("S")

Setup = Callable[[ActorSystem], Awaitable[S]]


class SyncRuntime(Protocol):
    system: ActorSystem

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T: ...

    def close(self) -> None: ...


class SteppedRuntime:
    """Runs the loop on the calling thread for the duration of each call."""

    def __init__(self, *, close_timeout_s: float = 10.0) -> None:
        self._runner = asyncio.Runner()
        self._close_timeout_s = close_timeout_s
        self._host: asyncio.Task[None] | None = None
        self._stop: anyio.Event | None = None
        self.system: ActorSystem

    def start(self, setup: Setup[S]) -> S:
        """Open the actor system, run ``setup(system)`` in it, and return its result."""

        async def boot() -> S:
            ready = anyio.Event()
            self._stop = anyio.Event()
            box: dict[str, Any] = {}

            async def host() -> None:
                try:
                    async with ActorSystem() as system:
                        self.system = system
                        box["value"] = await setup(system)
                        ready.set()
                        assert self._stop is not None
                        await self._stop.wait()
                except BaseException as exc:  # reported to the caller of start()
                    box["error"] = exc
                    ready.set()
                    raise

            # The one place kvferry touches asyncio directly: a task that outlives this
            # call keeps the actor system open between calls.
            self._host = asyncio.get_running_loop().create_task(host(), name="kvferry-host")
            await ready.wait()
            if "error" in box:
                raise box["error"]
            return box["value"]  # type: ignore[no-any-return]

        return self._runner.run(boot())

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the loop, on this thread, until it returns."""
        return self._runner.get_loop().run_until_complete(fn(*args))

    def close(self) -> None:
        host = self._host
        if host is not None and not host.done():

            async def shutdown() -> None:
                assert self._stop is not None
                self._stop.set()
                with anyio.move_on_after(self._close_timeout_s):
                    with contextlib.suppress(Exception):
                        await host

            self._runner.run(shutdown())
        self._host = None
        self._runner.close()


class ThreadRuntime:
    """Runs the loop on a dedicated thread; each call is one portal round-trip."""

    def __init__(self) -> None:
        self._portal_cm: Any = None
        self._system_cm: Any = None
        self.system: ActorSystem

    def start(self, setup: Setup[S]) -> S:
        self._portal_cm = anyio.from_thread.start_blocking_portal(name="kvferry-loop")
        portal = self._portal_cm.__enter__()
        self._portal = portal
        try:
            self._system_cm = portal.wrap_async_context_manager(ActorSystem())
            self.system = self._system_cm.__enter__()
            return portal.call(setup, self.system)
        except BaseException:
            self.close()
            raise

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return self._portal.call(fn, *args)

    def close(self) -> None:
        # Close the actor system first: leaving the portal waits for every task in it.
        if self._system_cm is not None:
            cm, self._system_cm = self._system_cm, None
            cm.__exit__(None, None, None)
        if self._portal_cm is not None:
            cm, self._portal_cm = self._portal_cm, None
            cm.__exit__(None, None, None)


def _loop_running_here() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def start_runtime(kind: str, setup: Setup[S]) -> tuple[SteppedRuntime | ThreadRuntime, S]:
    """Start a runtime of ``kind`` ("stepped", "thread" or "auto") and run ``setup`` in it.

    "auto" is stepped, unless this thread already runs an event loop (the stepped
    runtime cannot nest in it), then thread.
    """
    if kind == "auto":
        kind = "thread" if _loop_running_here() else "stepped"
    runtime: SteppedRuntime | ThreadRuntime
    if kind == "stepped":
        runtime = SteppedRuntime()
    elif kind == "thread":
        runtime = ThreadRuntime()
    else:
        raise ValueError(f"unknown runtime kind {kind!r}")
    return runtime, runtime.start(setup)
