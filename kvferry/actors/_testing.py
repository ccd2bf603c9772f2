"""What a user needs to test their own actors deterministically (re-exported by
:mod:`kvferry.testing`): no sleeps as synchronisation, no real time.

- :func:`virtual_time_backend`: an ``anyio_backend`` value for trio on a ``MockClock``
  that jumps ahead whenever every task is blocked, so timeouts, restart windows and
  timers run in no real time;
- :func:`settle` / :func:`settle_runtime`: wait until every task is blocked (every
  message in flight has been handled as far as it can be);
- :class:`Probe`: an actor that records what it is sent, for asserting what an actor
  under test tells others; :class:`Faulty`: wraps an actor to make chosen messages fail,
  for testing supervision;
- :func:`recorded_spans`: an injected tracer provider with an in-memory exporter (the
  global provider is never touched);
- :func:`assert_no_thread_left` / :func:`assert_no_task_left`: shutdown left nothing
  running.

Who owns what: a :class:`Probe` is an actor like any other (its records are touched by
its own task; tests read them on the same loop, after :func:`settle` or ``expect``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from ._base import Actor, RestartPolicy, reply_of

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from ._runtime import SyncRuntime

M = TypeVar("M")
T = TypeVar("T")


def virtual_time_backend() -> tuple[str, dict[str, Any]]:
    """``("trio", {"clock": MockClock(autojump_threshold=0)})`` with a fresh clock.

    Use it as the ``anyio_backend`` of a test (``@pytest.mark.parametrize("anyio_backend",
    [virtual_time_backend()])``); make a new one per test, so no virtual time leaks
    between tests. Not for tests that wait on real threads: a thread at work looks blocked
    to the clock, which then jumps.
    """
    from trio.testing import MockClock

    return ("trio", {"clock": MockClock(autojump_threshold=0)})


async def settle() -> None:
    """Return once every other task on this loop is blocked: each actor has handled
    what it was sent, as far as it can without outside input."""
    await anyio.wait_all_tasks_blocked()


def settle_runtime(runtime: SyncRuntime) -> None:
    """:func:`settle`, from sync code, on a :class:`~kvferry.actors.SteppedRuntime` or
    :class:`~kvferry.actors.ThreadRuntime`."""
    runtime.call(anyio.wait_all_tasks_blocked)


class Probe(Actor[Any]):
    """Records every message it is sent; answers asks with ``answer(msg)``.

    Without ``answer``, an ask fails (an :class:`AssertionError` goes back to the asker),
    so an unexpected ask is loud. ``expect`` and ``receive`` read the messages in order.
    """

    mailbox_size = 1024

    def __init__(self, answer: Callable[[Any], Any] | None = None) -> None:
        self.received: list[Any] = []
        self._answer = answer
        self._read = 0
        self._arrived: anyio.Event | None = None

    async def handle(self, msg: Any) -> None:
        self.received.append(msg)
        reply = reply_of(msg)
        if reply is not None:
            if self._answer is None:
                reply.fail(AssertionError(f"Probe has no answer for {msg!r}"))
            else:
                reply.set(self._answer(msg))
        if self._arrived is not None:
            self._arrived.set()

    async def receive(self, *, timeout: float = 10.0) -> Any:  # noqa: ASYNC109 (a test's bound)
        """The next message not read yet, waiting up to ``timeout`` for it."""
        with anyio.fail_after(timeout):
            while self._read >= len(self.received):
                self._arrived = anyio.Event()
                await self._arrived.wait()
        msg = self.received[self._read]
        self._read += 1
        return msg

    async def expect(self, kind: type[T], *, timeout: float = 10.0) -> T:  # noqa: ASYNC109
        """The next message, which must be a ``kind``."""
        msg = await self.receive(timeout=timeout)
        assert isinstance(msg, kind), f"expected a {kind.__name__}, got {msg!r}"
        return msg

    def assert_nothing_more(self) -> None:
        """No message arrived beyond those read (call after :func:`settle`)."""
        extra = self.received[self._read :]
        assert not extra, f"unexpected messages: {extra!r}"


class Faulty(Actor[M]):
    """Wraps ``inner``: the first ``times`` messages for which ``when(msg)`` holds raise
    ``error(msg)`` instead of reaching it; everything else is delegated unchanged.

    The wrapper keeps ``inner``'s mailbox size, restart policy and hooks, so supervision
    behaves as it would for ``inner``: spawn ``Faulty(MyActor(), ...)`` to see how
    ``MyActor`` comes through failures.
    """

    def __init__(
        self,
        inner: Actor[M],
        *,
        when: Callable[[M], bool],
        error: Callable[[M], Exception] = lambda m: RuntimeError(f"injected failure on {m!r}"),
        times: int = 1,
    ) -> None:
        self.inner = inner
        self.mailbox_size = inner.mailbox_size  # type: ignore[misc]
        self.restart_policy: RestartPolicy = inner.restart_policy  # type: ignore[misc]
        self._when = when
        self._error = error
        self.failures_left = times

    async def on_start(self) -> None:
        self.inner._cell = self._cell
        await self.inner.on_start()

    async def on_stop(self) -> None:
        await self.inner.on_stop()

    async def on_restart(self, error: BaseException) -> None:
        await self.inner.on_restart(error)

    async def handle(self, msg: M) -> None:
        if self.failures_left > 0 and self._when(msg):
            self.failures_left -= 1
            raise self._error(msg)
        await self.inner.handle(msg)


def recorded_spans() -> tuple[TracerProvider, InMemorySpanExporter]:
    """A tracer provider to inject (``tracer_provider=``) and the exporter that records
    its finished spans (``exporter.get_finished_spans()``). Needs opentelemetry-sdk."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


@contextlib.contextmanager
def assert_no_thread_left(
    *, join_timeout_s: float = 10.0, except_names: tuple[str, ...] = ()
) -> Iterator[None]:
    """Fail if a thread started inside the block is still alive after it.

    Threads that are on their way out are joined first (up to ``join_timeout_s``): an
    exiting thread is not left behind, a thread nobody stopped is. Threads named in
    ``except_names`` are not checked (e.g. ``"AnyIO worker thread"``: the event loop's
    own pool, whose idle workers end by themselves).
    """
    before = set(threading.enumerate())
    yield
    new = [t for t in threading.enumerate() if t not in before and t.name not in except_names]
    for thread in new:
        thread.join(join_timeout_s)
    left = [t.name for t in new if t.is_alive()]
    assert not left, f"threads left behind: {left}"


@contextlib.asynccontextmanager
async def assert_no_task_left() -> AsyncIterator[None]:
    """Fail if a task started inside the block is still running after it."""
    before = {t.id for t in anyio.get_running_tasks()}
    yield
    left = [t.name for t in anyio.get_running_tasks() if t.id not in before]
    assert not left, f"tasks left behind: {left}"
