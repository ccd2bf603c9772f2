"""The completion bridge: turns a :class:`Completion` (a CUDA event, a copy-thread job)
into something the actors can wait on, without the engine thread ever waiting.

Two strategies, one bridge:

- *poll*: :meth:`CompletionBridge.poll` queries every pending completion (never blocks)
  and returns the ones that ended. The facade polls once per engine step, so a job
  submitted in step N is seen ended in the first step after it ended.
- *thread*: :meth:`CompletionBridge.wait` hands one completion to a worker thread that
  blocks in ``synchronize()`` (CUDA events are created ``blocking=True``, so it sleeps).

Completions may end in any order (several copy threads, two streams): every pending one
is queried, not only the oldest. A completion whose ``query()`` raises has ended with
that error. Ended completions are kept, in the order they were seen, until the next
:meth:`poll` returns them: whoever waited, the owner's poll still reports every one.

Who owns what: a bridge belongs to one actor and is used on the event loop only; only
``synchronize`` runs in a worker thread, and it touches no bridge state.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

import anyio
import anyio.to_thread

from ._copy import Completion

K = TypeVar("K", bound=Hashable)


class CompletionBridge(Generic[K]):
    """Pending completions by token; :meth:`poll` returns the ones that ended, in order."""

    def __init__(self) -> None:
        self._pending: dict[K, Completion] = {}
        self._ended: list[tuple[K, BaseException | None]] = []

    def __len__(self) -> int:
        """Completions not yet seen ended."""
        return len(self._pending)

    def __contains__(self, token: object) -> bool:
        return token in self._pending

    def add(self, token: K, completion: Completion) -> None:
        """Track ``completion``; raises :class:`KeyError` if ``token`` is already pending."""
        if token in self._pending:
            raise KeyError(f"completion {token!r} is already pending")
        self._pending[token] = completion

    def get(self, token: K) -> Completion | None:
        return self._pending.get(token)

    def _sweep(self) -> None:
        for token, completion in list(self._pending.items()):
            error: BaseException | None
            try:
                ended = completion.query()
                error = completion.exception() if ended else None
            except Exception as exc:
                ended, error = True, exc
            if not ended:
                continue
            del self._pending[token]
            self._ended.append((token, error))

    def poll(self) -> list[tuple[K, BaseException | None]]:
        """Every completion that has ended since the last poll, with its error (None if
        it succeeded), in the order they were seen ended. Never blocks."""
        self._sweep()
        ended, self._ended = self._ended, []
        return ended

    async def wait(self, token: K) -> None:
        """*Thread* strategy: wait in a worker thread until ``token``'s completion ended.

        Does not consume it: the next :meth:`poll` reports it. Returns at once for a
        token that is not pending. Bound it with ``anyio.fail_after``: on cancellation
        the thread is abandoned (it ends with the completion).
        """
        completion = self._pending.get(token)
        if completion is None or completion.query():
            return
        await anyio.to_thread.run_sync(completion.synchronize, abandon_on_cancel=True)
