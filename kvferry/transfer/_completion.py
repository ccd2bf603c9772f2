"""The completion bridge: turns a :class:`Completion` (a CUDA event, a copy thread's
future) into something the actors can wait on, without the engine ever waiting.

Two strategies, one interface:

- *poll*: :meth:`CompletionBridge.poll` queries every pending completion (never blocks)
  and resolves the ones that ended. The facade polls once per engine step, so a job
  submitted in step N is seen done in the first step after it ended.
- *thread*: :meth:`CompletionBridge.wait` hands a completion to a worker thread that
  blocks in ``synchronize()`` (CUDA events are created ``blocking=True``, so it sleeps).

Who owns what: a bridge belongs to one actor and is used on the event loop only.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

import anyio
import anyio.to_thread

from ._copy import Completion

K = TypeVar("K", bound=Hashable)


class CompletionBridge(Generic[K]):
    """Pending completions by token; ``poll`` returns the ones that ended, in order."""

    def __init__(self) -> None:
        self._pending: dict[K, Completion] = {}
        self._waiters: dict[K, anyio.Event] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, token: object) -> bool:
        return token in self._pending

    def add(self, token: K, completion: Completion) -> None:
        assert token not in self._pending, token
        self._pending[token] = completion

    def poll(self) -> list[tuple[K, BaseException | None]]:
        """Every completion that has ended, with its error (None if it succeeded).

        All pending completions are queried, not only the oldest: jobs of several copy
        threads (or streams) may end out of order.
        """
        ended = [(t, c) for t, c in self._pending.items() if c.query()]
        results = []
        for token, completion in ended:
            del self._pending[token]
            results.append((token, completion.exception()))
            waiter = self._waiters.pop(token, None)
            if waiter is not None:
                waiter.set()
        return results

    async def wait(self, token: K, *, timeout: float | None = None) -> None:
        """Wait (in a worker thread, *thread* strategy) until ``token``'s completion ended.

        Does not consume it: the next :meth:`poll` reports it. Raises :class:`TimeoutError`
        after ``timeout`` seconds.
        """
        completion = self._pending.get(token)
        if completion is None or completion.query():
            return
        with anyio.fail_after(timeout if timeout is not None else float("inf")):
            await anyio.to_thread.run_sync(completion.synchronize, abandon_on_cancel=True)

    async def wait_polled(self, token: K) -> None:
        """Wait until a later :meth:`poll` (run by someone else) reports ``token`` (*poll* strategy)."""
        if token not in self._pending:
            return
        event = self._waiters.setdefault(token, anyio.Event())
        await event.wait()
