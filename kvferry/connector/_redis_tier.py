"""The scheduler side of the shared Redis tier: what it knows of which chunks Redis holds.

Who owns what: :class:`~kvferry.connector._scheduler.SchedulerSide` owns one, on vLLM's
engine thread. Redis belongs to every engine of the same fingerprint; this side never
owns its contents, it only asks. The workers do the reads and writes
(:class:`~kvferry.tiers.RedisIOActor`, one per rank, under the rank's fingerprint).

Existence checks never run on the engine thread. Keys a lookup needs an answer for are
gathered during the step and sent once per step (:meth:`RedisTier.flush`) to a checker
actor on a loop thread of its own (whatever the connector's runtime), which asks every
rank's keys in one pipeline each and leaves the answers in a queue the engine thread
drains at its next lookup. At most :data:`MAX_CHECKS_OUT` checks are out at once: while
Redis is slow to answer, later keys wait for a later step's check, so the checker's
mailbox never fills (a full one would make the engine thread wait for Redis in
:meth:`RedisTier.flush`). While a request's answer is out, its lookup says "ask again"
(vLLM's ``None``), for at most ``lookup_wait_ms``; then the chunks not answered for are
misses. Answers are kept a short while (:data:`ANSWER_TTL_S`), then forgotten; a chunk
this engine wrote is known present, one whose read failed is known absent. What this engine
learnt of a chunk (its write ended, its read failed) is newer than the answer of any check
sent before: such an answer, drained later, leaves it alone, and so does one drained after
that fact was forgotten (expired, or a reset) or after a reset.

A hit is read Redis -> host slot -> device like a disk hit (the host slot is reserved at
the lookup), so the scheduler's load path is the disk tier's; a Redis chunk that is gone
or fails verification by then fails the load, and vLLM recomputes those blocks.

Redis has no pins: :meth:`lease` returns no places and :meth:`unpin` does nothing. A
store is written through: :meth:`prepare_writes` takes the keys not known present and
not being written already. A chunk whose write failed (Redis down, full, too slow) is
remembered, and written again from host memory when a load takes it from there
:data:`RETRY_S` or more after the failure (:meth:`prepare_rewrites`): once Redis is
back, the prefixes in use reach it without being stored again.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from .._config import RedisTierConfig
from .._logging import get_logger
from ..actors import Actor, ActorRef, ActorSystem, start_runtime
from ..cache import BlocksStored, KVEvent
from ..tiers import CircuitBreaker, Fingerprint, Outcome, RedisStore

I64 = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]

MEDIUM = "REDIS"
"""The medium of the Redis tier's KV events."""

ANSWER_TTL_S = 2.0
"""How long an existence answer is trusted. Another engine may write a chunk after an
absent answer, or Redis evict it after a present one (its read then fails: recomputed)."""

MAX_ANSWERS = 1 << 18
"""Answers remembered at most (the oldest are forgotten first), expired or not: a bound for
a burst, as an answer is forgotten anyway once it expired."""

RETRY_S = 5.0
"""How long after a chunk's write failed (Redis down, full, slow) it is offered to Redis
again, at its next load from host memory."""

MAX_UNWRITTEN = 1 << 16
"""Chunks whose write failed remembered at most (the oldest are forgotten first)."""

MAX_CHECKS_OUT = 2
"""Existence checks sent and not answered, at most: one being asked, one waiting in the
checker's mailbox (far below its bound); the keys asked meanwhile go with a later one."""


@attrs.frozen
class _Check:
    keys: tuple[bytes, ...]
    seq: int
    """The check's number (1, 2, ...: in the order sent, and answered)."""


@attrs.frozen
class RedisTierStatistics:
    """The scheduler side's view of the Redis tier (cumulative)."""

    keys_checked: int
    """Keys sent to Redis in existence checks (each asked of every rank)."""
    keys_found: int
    checks_unanswered: int
    """Checks Redis did not answer (a timeout, an error): their keys were asked again."""
    lookups_waited: int
    """Lookups answered "ask again" while an existence check was out."""
    lookups_unanswered: int
    """Lookups that went on without an answer after ``lookup_wait_ms`` (misses)."""
    writes_in_flight: int
    answers: int
    """Answers remembered now."""
    unwritten: int
    """Chunks whose write failed, to be offered to Redis again (:data:`RETRY_S`)."""
    chunks_offered_again: int
    """Chunks written again from host memory after their write had failed."""


class _Checker(Actor[_Check]):
    """On the checker's loop thread: asks every rank's store, leaves the answer."""

    def __init__(
        self,
        stores: list[RedisStore],
        answered: deque[tuple[int, tuple[bytes, ...], Bools | None]],
    ) -> None:
        self.stores = stores
        self.answered = answered

    async def on_stop(self) -> None:
        for store in self.stores:
            await store.aclose()

    async def handle(self, msg: _Check) -> None:
        answer: Bools | None = None
        try:
            answer = await self._ask(list(msg.keys))
        finally:
            # Every check is answered, None if it failed: the engine thread counts the
            # checks out by their answers. Thread-safe; drained on the engine thread.
            self.answered.append((msg.seq, msg.keys, answer))

    async def _ask(self, keys: list[bytes]) -> Bools | None:
        found: Bools | None = np.ones(len(keys), np.bool_)
        for store in self.stores:  # a chunk is there if every rank wrote its part
            if found is None or not found.any():
                break
            idx = np.flatnonzero(found)
            got = await store.check([keys[i] for i in idx.tolist()])
            if got is Outcome.UNAVAILABLE:
                # The breaker is open (Redis known down): misses at once, no waiting.
                found[:] = False
            elif isinstance(got, Outcome):
                found = None  # no answer (a timeout, an error): the lookup may ask again
            else:
                found[idx] = got
        return found


class RedisTier:
    """``fingerprints``: one per worker rank. Connects at once: a URL that does not parse
    or a server that cannot be reached fails here, naming ``tiers[i].url`` (or
    ``.cluster``)."""

    write_back = False

    def __init__(
        self,
        tier: RedisTierConfig,
        fingerprints: Sequence[Fingerprint],
        *,
        events: bool,
        clock: Callable[[], float],
    ) -> None:
        self.tier = tier
        self._clock = clock
        self._wait_s = tier.lookup_wait_ms / 1000.0
        self._answers: OrderedDict[bytes, tuple[bool, float, int]] = OrderedDict()
        """Key -> (present, when learnt, after which check): the check's number for its
        answer; for what this engine learnt itself (a write, a failed read), the number
        of the next check to be sent (the answers of those sent before are older)."""
        self._floor = 0
        """Answers of checks numbered below are dropped when drained: sent before a reset,
        or before a fact this engine learnt that is forgotten now (see :meth:`_forget`)."""
        self._failed_at = -math.inf
        """When a check last went unanswered (:meth:`answered_since`)."""
        self._answered: deque[tuple[int, tuple[bytes, ...], Bools | None]] = deque()
        """(seq, keys, found) from the checker; found None: no answer (asked again later)."""
        self._sent = 0
        """Checks sent so far (the last one's ``seq``)."""
        self._asked: set[bytes] = set()
        """Keys sent and not answered yet."""
        self._to_ask: dict[bytes, None] = {}
        """Keys to send with this step's check (ordered, unique)."""
        self._checks_out = 0
        """Checks sent whose answer is not drained yet (:data:`MAX_CHECKS_OUT`)."""
        self._writing: set[bytes] = set()
        self._unwritten: OrderedDict[bytes, float] = OrderedDict()
        """Chunks whose write failed → when they may be offered again."""
        self._events: list[KVEvent] = []
        self._forward_events = events
        self._c = dict.fromkeys(
            (
                "keys_checked",
                "keys_found",
                "checks_unanswered",
                "lookups_waited",
                "lookups_unanswered",
                "chunks_offered_again",
            ),
            0,
        )
        self._log = get_logger("kvferry.connector", role="scheduler", tier=tier.index)
        stores = [make_store(tier, fp) for fp in fingerprints]
        answered = self._answered

        async def setup(system: ActorSystem) -> ActorRef[_Check]:
            try:
                for store in stores:
                    await store.connect()
            except BaseException:
                for store in stores:
                    await store.aclose()
                raise
            return await system.spawn(_Checker(stores, answered), name="redis-exists")

        # A loop thread of its own: the checks progress between engine steps whatever
        # runtime the connector's actors use.
        self._runtime, self._checker = start_runtime("thread", setup)
        self.url = stores[0].url
        self._log.info("redis_tier_started", redis=self.url, ranks=len(stores))

    # -- lookups -------------------------------------------------------------------------

    def _drain(self) -> None:
        now = self._clock()
        answers = self._answers
        while self._answered:
            seq, keys, found = self._answered.popleft()
            self._checks_out -= 1
            if found is None:
                self._asked.difference_update(keys)
                self._failed_at = now
                self._c["checks_unanswered"] += 1
                continue
            stale = seq < self._floor
            for k, f in zip(keys, found.tolist(), strict=True):
                self._asked.discard(k)
                if stale:  # asked again by the next lookup that needs it
                    continue
                a = answers.get(k)
                if a is not None and a[2] > seq:
                    # Learnt after this check was sent (written, or its read failed):
                    # Redis may have answered before that write landed or that delete.
                    continue
                answers[k] = (f, now, seq)
                answers.move_to_end(k)
            self._c["keys_found"] += int(found.sum())
        self._forget(now)

    def _forget(self, now: float) -> None:
        """Forget the answers expired (and the oldest beyond :data:`MAX_ANSWERS`): an engine
        that sees many distinct prompts would otherwise hold every answer it ever had, and
        pay for a big dict at each lookup. Each answer is moved to the end when learnt, on
        a monotonic clock: the expired ones lead, and each is dropped once.

        A fact this engine learnt shields its chunk from the answers of checks sent before
        it (:meth:`_learnt`); forgotten, it shields nothing, so those checks' answers are
        dropped from now on (the floor). Such a check is one out for longer than an answer
        is trusted: its keys are asked again by the next lookup that needs them."""
        answers = self._answers
        while answers:
            k, (_, learnt, seq) = next(iter(answers.items()))
            if learnt + ANSWER_TTL_S >= now and len(answers) <= MAX_ANSWERS:
                break
            del answers[k]
            self._floor = max(self._floor, seq)

    def known(self, keys: Sequence[bytes]) -> tuple[Bools, Bools]:
        """(present, unknown) per key: what the answers say now; a key neither known
        present nor answered absent within :data:`ANSWER_TTL_S` is unknown."""
        self._drain()
        now = self._clock()
        present = np.zeros(len(keys), np.bool_)
        unknown = np.zeros(len(keys), np.bool_)
        answers = self._answers
        for i, k in enumerate(keys):
            a = answers.get(k)
            if a is None or a[1] + ANSWER_TTL_S < now:
                unknown[i] = True
            else:
                present[i] = a[0]
        return present, unknown

    def answered_since(self, keys: Sequence[bytes], since: float) -> bool:
        """Whether every key was answered for (or written, or failed a read) at ``since``
        or later, trusted still or not: a lookup that began to wait at ``since`` and finds
        them unknown again waited for nothing still out (see :meth:`known`).

        An expired answer is forgotten (:meth:`_forget`), so a key without one counts as
        answered unless its question is still out (to be sent, or sent) or a check went
        unanswered since ``since``: a lookup that waited since then asked it, and that
        question ended in an answer or a failure. A failure keeps the wait it ends (then
        a miss), as Redis that does not answer must not hold a request back for more than
        ``lookup_wait_ms`` a time; which check failed is not kept: any failure does."""
        answers = self._answers
        failed = self._failed_at >= since
        for k in keys:
            a = answers.get(k)
            if a is not None:
                if a[1] < since:
                    return False
            elif failed or k in self._asked or k in self._to_ask:
                return False
        return bool(keys)

    def _learnt(self, k: bytes, present: bool, now: float) -> None:
        """What this engine learnt of chunk ``k`` itself: newer than any check sent yet."""
        self._answers[k] = (present, now, self._sent + 1)
        self._answers.move_to_end(k)

    def ask(self, keys: Sequence[bytes]) -> None:
        """Check these keys with this step's batch (unless already out)."""
        for k in keys:
            if k not in self._asked:
                self._to_ask[k] = None

    def waited(self, since: float) -> bool:
        """Whether a lookup that first waited at ``since`` may still say "ask again"."""
        return self._clock() - since < self._wait_s

    def count_wait(self, *, gave_up: bool) -> None:
        self._c["lookups_unanswered" if gave_up else "lookups_waited"] += 1

    def flush(self) -> None:
        """Send this step's existence check (once per step, from build_connector_meta),
        unless :data:`MAX_CHECKS_OUT` are out: its keys then wait for a later step's.
        Never waits for Redis."""
        if not self._to_ask:
            return
        self._drain()
        if self._checks_out >= MAX_CHECKS_OUT:
            return
        self._checks_out += 1
        self._sent += 1
        keys = tuple(self._to_ask)
        self._to_ask = {}
        self._asked.update(keys)
        self._c["keys_checked"] += len(keys)
        self._runtime.tell(self._checker, _Check(keys=keys, seq=self._sent))

    # -- the lower tier's protocol (the scheduler's disk paths) ---------------------------

    def ready(self, keys: Sequence[bytes]) -> Bools:
        return self.known(keys)[0]

    def lease(self, keys: Sequence[bytes]) -> I64:
        return np.zeros(0, np.int64)  # nothing to pin: Redis evicts as it pleases

    def unpin(self, slots: npt.ArrayLike) -> None:
        pass

    def prepare_writes(self, keys: Sequence[bytes]) -> I64:
        """Places for the keys to write through; -1 where known present or being written."""
        present, _ = self.known(keys)
        places = np.full(len(keys), -1, np.int64)
        for i, k in enumerate(keys):
            if not present[i] and k not in self._writing:
                self._writing.add(k)
                places[i] = i
        return places

    def prepare_rewrites(self, keys: Sequence[bytes]) -> I64:
        """Places for the keys (just loaded from host memory) to write again, their last
        write having failed at least :data:`RETRY_S` ago; -1 for the others (never
        failed, too recent, known present by now, being written)."""
        places = np.full(len(keys), -1, np.int64)
        unwritten = self._unwritten
        if not unwritten:
            return places
        now = self._clock()
        present: Bools | None = None
        for i, k in enumerate(keys):
            after = unwritten.get(k)
            if after is None or after > now or k in self._writing:
                continue
            if present is None:
                present = self.known(keys)[0]
            del unwritten[k]
            if present[i]:  # another engine wrote it since
                continue
            self._writing.add(k)
            places[i] = i
            self._c["chunks_offered_again"] += 1
        return places

    def writes_ended(self, slots: I64, keys: Sequence[bytes], failed: I64) -> int:
        """A write ended on every worker; ``failed[i]``: on how many chunk i failed (a
        dropped store, a full Redis, an error: offered again from :data:`RETRY_S` on, at
        a load from host memory). Returns the chunks now in Redis."""
        now = self._clock()
        written = []
        unwritten = self._unwritten
        for k, f in zip(keys, failed.tolist(), strict=True):
            self._writing.discard(k)
            if f == 0:
                self._learnt(k, True, now)
                written.append(k)
                unwritten.pop(k, None)
            else:
                unwritten[k] = now + RETRY_S
                unwritten.move_to_end(k)
        while len(unwritten) > MAX_UNWRITTEN:
            unwritten.popitem(last=False)
        if written and self._forward_events:
            self._events.append(BlocksStored(keys=tuple(written), medium=MEDIUM))
        return len(written)

    def reads_ended(self, keys: Sequence[bytes], failed: I64) -> None:
        """A chunk whose read failed (gone, corrupt: deleted by the reader) is absent."""
        now = self._clock()
        for k, f in zip(keys, failed.tolist(), strict=True):
            if f > 0:
                self._learnt(k, False, now)

    def reset(self) -> int:
        """Forget the answers (and the chunks whose write failed: host memory is
        emptied). The chunks stay in Redis: other engines share them. The answers of the
        checks out are forgotten too, when they come: what was known before the reset is
        known no longer, and such an answer may be older than a fact it forgets (a read
        that failed: the chunk a hit again, its loads failing)."""
        n = len(self._answers)
        self._answers.clear()
        self._floor = self._sent + 1
        self._unwritten.clear()
        return n

    def take_deletes(self) -> list[bytes]:
        return []  # a chunk that fails verification is deleted by the worker reading it

    def take_events(self) -> list[KVEvent]:
        out, self._events = self._events, []
        return out

    @property
    def has_unwritten(self) -> bool:
        """Whether any chunk's write failed and is still to be offered again."""
        return bool(self._unwritten)

    @property
    def writes_in_flight(self) -> int:
        return len(self._writing)

    def statistics(self) -> RedisTierStatistics:
        self._drain()
        return RedisTierStatistics(
            writes_in_flight=len(self._writing),
            answers=len(self._answers),
            unwritten=len(self._unwritten),
            **self._c,
        )

    def close(self) -> None:
        self._runtime.close()


def make_store(tier: RedisTierConfig, fingerprint: Fingerprint, **kwargs: Any) -> RedisStore:
    """The :class:`RedisStore` of one rank for this tier's configuration. Its pool has a
    connection for each of the ``io_depth`` batches a worker's actor sends at once, and
    one for the actor's own deletes: the client fails an operation beyond its pool
    (``MaxConnectionsError``), an error the breaker counts, on a healthy server."""
    kwargs.setdefault("max_connections", max(16, tier.io_depth + 1))
    return RedisStore(
        fingerprint=fingerprint,
        url=tier.url,
        cluster=list(tier.cluster) if tier.cluster is not None else None,
        tier_index=tier.index,
        ttl_s=tier.ttl_s,
        op_timeout_s=tier.op_timeout_s,
        connect_timeout_s=tier.connect_timeout_s,
        encrypt_key=tier.encrypt_key,
        breaker=CircuitBreaker(
            threshold=tier.breaker_threshold, cooldown_s=tier.breaker_cooldown_s
        ),
        **kwargs,
    )
