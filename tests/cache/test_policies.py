"""Eviction policies: what each keeps, how each is chosen."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvferry import ConfigError
from kvferry.cache import ARCPolicy, BlocksRemoved, Directory, LRUPolicy, S3FIFOPolicy, make_policy
from kvferry.cache._recency import RecencyLists
from kvferry.cache._testing import key as k

from ._compiled import both


def store(d: Directory, keys: list[bytes]) -> None:
    slots = d.prepare_store(keys)
    d.complete_store(slots[slots >= 0], ok=True)


def use(d: Directory, keys: list[bytes]) -> None:
    slots = d.prepare_load(keys)
    assert slots is not None
    d.complete_load(slots)


def hot_survivors(policy: str) -> int:
    """Store 4 hot blocks, reuse them, then scan 40 one-off blocks through a tier of 10."""
    d = Directory(10, policy=policy, watermarks=(1.0, 1.0))
    hot = [k(i) for i in range(4)]
    store(d, hot)
    use(d, hot)
    use(d, hot)
    for i in range(100, 140, 2):
        store(d, [k(i), k(i + 1)])
    return sum(d.lookup([h]) for h in hot)


def test_lru_loses_the_hot_blocks_to_a_scan() -> None:
    assert hot_survivors("lru") == 0


@pytest.mark.parametrize("policy", ["arc", "s3fifo"])
def test_scan_resistant_policies_keep_the_hot_blocks(policy: str) -> None:
    assert hot_survivors(policy) == 4


def test_arc_grows_its_recency_side_after_a_ghost_hit_in_b1() -> None:
    d = Directory(2, policy="arc", watermarks=(1.0, 1.0))
    store(d, [k(1)])
    store(d, [k(2)])
    store(d, [k(3)])  # k(1) leaves T1 for the ghost list B1
    assert d.statistics().policy_stats["b1"] == 1
    store(d, [k(1)])  # back: recency was cut too short
    stats = d.statistics().policy_stats
    assert stats["ghost_hits_b1"] == 1 and stats["target_t1"] == 1.0


def test_s3fifo_sends_a_returning_block_straight_to_main() -> None:
    d = Directory(10, policy="s3fifo", watermarks=(1.0, 1.0))
    store(d, [k(i) for i in range(10)])
    store(d, [k(10)])  # k(0), never reused, leaves S for the ghost
    assert d.lookup([k(0)]) == 0
    store(d, [k(0)])
    stats = d.statistics().policy_stats
    assert stats["ghost_hits"] == 1 and stats["main"] == 1


def test_s3fifo_promotes_a_block_reused_while_small() -> None:
    d = Directory(10, policy="s3fifo", watermarks=(1.0, 1.0))
    store(d, [k(i) for i in range(10)])
    use(d, [k(0)])
    store(d, [k(10)])
    assert d.lookup([k(0)]) == 1 and d.lookup([k(1)]) == 0
    assert d.statistics().policy_stats["promotions"] == 1


@both
@pytest.mark.parametrize("policy", ["arc", "s3fifo"])
def test_a_load_of_leased_slots_a_reset_dropped_is_no_reuse_of_their_next_key(
    policy: str, compiled: bool
) -> None:
    """A lookup's lease, a reset, then the load of the leased slots: they are no longer
    the policy's, and are freed when the load ends, then taken by another key. A reuse
    recorded for them is replayed after that key's admission (the policies replay their
    records at the next decision) and credited to it: a cold key promoted (to S3-FIFO's M,
    to ARC's T2), and a block stored after it evicted in its place."""
    d = Directory(4, policy=policy, watermarks=(1.0, 1.0), events=True, compiled=compiled)
    store(d, [k(1)])
    leased = d.lookup_and_lease([k(1)])
    d.reset()
    d.load_leased(leased)
    d.complete_load(leased)
    cold = d.prepare_store([k(10)])
    assert cold.tolist() == leased.tolist()  # the dropped slot, another key's now
    d.complete_store(cold, ok=True)
    for i in (11, 12, 13):
        store(d, [k(i)])
    d.take_events()
    store(d, [k(14)])  # full: the oldest block stored, never reused, goes
    removed = [key for e in d.take_events() if isinstance(e, BlocksRemoved) for key in e.keys]
    assert removed == [k(10)]
    assert d.statistics().policy_stats["promotions"] == 0
    assert d.invariant_errors == 0


def test_a_policy_never_offers_a_pinned_block() -> None:
    for policy in ("lru", "arc", "s3fifo"):
        d = Directory(4, policy=policy, watermarks=(1.0, 1.0))
        store(d, [k(i) for i in range(4)])
        pinned = d.prepare_load([k(0), k(1), k(2), k(3)])
        assert list(d.prepare_store([k(9)])) == [-1], policy
        assert pinned is not None
        d.complete_load(pinned)
        assert d.prepare_store([k(9)])[0] >= 0, policy


def test_make_policy_by_name_import_path_or_instance() -> None:
    assert isinstance(make_policy("lru", 4), LRUPolicy)
    assert isinstance(make_policy("S3FIFO", 4), S3FIFOPolicy)
    assert isinstance(make_policy("kvferry.cache:ARCPolicy", 4), ARCPolicy)
    mine = ARCPolicy(4)
    assert make_policy(mine, 4) is mine


def test_a_class_that_is_not_a_policy_is_refused() -> None:
    with pytest.raises(ConfigError, match="lacks"):
        make_policy("fractions:Fraction", 4)


def evictable_except(*refused: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda slots: ~np.isin(slots, refused)


def test_victims_are_the_oldest_evictable_slots_oldest_first() -> None:
    lru = LRUPolicy(6)
    lru.admit(np.array([0, 1, 2]), np.zeros(3, np.int64))  # 0 is the head: newest
    lru.admit(np.array([3, 4, 5]), np.zeros(3, np.int64))
    assert lru.victims(3, evictable_except(2), np.zeros(0, np.int64)).tolist() == [1, 0, 5]


def test_a_refused_slot_keeps_its_age_for_the_next_eviction() -> None:
    lru = LRUPolicy(6)
    lru.admit(np.array([2, 1, 0]), np.zeros(3, np.int64))  # oldest first: 0, 1, 2
    lru.touch(np.array([4, 3]))  # not stored: ignored
    lru.admit(np.array([5, 4, 3]), np.zeros(3, np.int64))
    assert lru.victims(2, evictable_except(0), np.zeros(0, np.int64)).tolist() == [1, 2]
    assert lru.victims(2, evictable_except(), np.zeros(0, np.int64)).tolist() == [0, 3]


def test_recency_lists_promote_refresh_and_pop_in_order() -> None:
    lists = RecencyLists(8, 2)
    lists.enter(np.array([1, 0]), 1)  # list 1, oldest first: 0, 1
    lists.enter(np.array([3, 2]), 1)  # 0, 1, 2, 3
    lists.promote(np.array([1, 7]), 2)  # 7 is in no list: ignored
    lists.refresh(np.array([0]))  # list 1: 2, 3, 0
    lists.enter(np.array([5]), 1)
    lists.promote(np.array([5, 2]), 2)  # the batch's head is its newest: 2, then 5
    assert lists.order(1).tolist() == [3, 0]
    assert lists.order(2).tolist() == [1, 2, 5]
    assert (lists.size(1), lists.size(2), lists.promoted) == (2, 3, 3)
    assert lists.pop(2, 2, evictable_except()).tolist() == [1, 2]
    assert lists.member[[1, 2]].tolist() == [0, 0]


def test_recency_lists_remove_a_slot_given_twice_once() -> None:
    lists = RecencyLists(8, 2)
    lists.enter(np.array([2, 1, 0]), 1)
    lists.enter(np.array([4, 3]), 2)
    lists.remove(np.array([1, 1, 3, 3, 3, 7]))  # 7 is in no list: ignored
    assert (lists.size(1), lists.size(2)) == (2, 1)
    assert lists.order(1).tolist() == [0, 2] and lists.order(2).tolist() == [4]


def test_recency_lists_compact_a_log_of_stale_entries() -> None:
    lists = RecencyLists(4, 1, initial=64)
    lists.enter(np.array([3, 2, 1, 0]), 1)
    for _ in range(1000):  # 4000 appends, 4 live entries: the log is rewritten, not grown
        lists.refresh(np.array([3, 2, 1, 0]))
        lists.flush()
    assert len(lists._logs[1].buf) <= 64 and lists.order(1).tolist() == [0, 1, 2, 3]
    assert lists.pop(1, 3, evictable_except(1)).tolist() == [0, 2, 3]
    assert lists.order(1).tolist() == [1]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    ("move_from", "move_batch", "no_room"),
    [(0, 1, False), (0, 40, False), (None, None, False), (0, 1, True)],
    ids=["moved", "batches", "compacted", "no-room"],
)
def test_recency_lists_move_a_full_log_over_a_little_at_a_time(
    seed: int, move_from: int | None, move_batch: int | None, no_room: bool
) -> None:
    """Two lists with small buffers, so that logs fill and go on in new buffers again and
    again (the old one moved over by later appends, read first by pops, pops refused in
    either): every order and every victim is a plain model's (an OrderedDict a list), and
    no call passes over a whole log."""
    from collections import OrderedDict

    rng = np.random.default_rng(seed)
    cap = 96
    lists = RecencyLists(cap, 2, initial=8)
    if move_from is not None and move_batch is not None:  # else: compacted in one pass
        lists.move_from, lists.move_batch = move_from, move_batch
    if no_room:  # a bug's way out: no room left for the old entries, rebuilt in one pass
        lists._room_for_old = lambda lst: 0  # type: ignore[method-assign]
    model: list[OrderedDict[int, None]] = [OrderedDict(), OrderedDict(), OrderedDict()]
    where = np.zeros(cap, np.int64)  # the model's list of each slot (0: none)
    renewals = crossings = 0
    renew, move = lists._renew, lists._move
    moved_most = [0]

    def counted_renew(lst: int, room: int) -> Any:
        nonlocal renewals
        renewals += 1
        return renew(lst, room)

    def counted_move(lst: int, count: int) -> None:
        old = lists._old[lst]
        assert old is not None
        moved_most[0] = max(moved_most[0], min(count, old.tail - old.head))
        move(lst, count)

    lists._renew = counted_renew  # type: ignore[method-assign]
    lists._move = counted_move  # type: ignore[method-assign]

    def newest(lst: int, batch: list[int]) -> None:
        for slot in reversed(batch):  # the batch's head is its newest
            model[where[slot]].pop(slot, None)
            model[lst][slot] = None
            where[slot] = lst

    for _ in range(4000):
        op = int(rng.integers(0, 5))
        size = int(rng.integers(0, 10))
        if op == 0:  # enter slots in no list
            free = np.flatnonzero(where == 0)
            batch = rng.permutation(free)[:size].astype(np.int64)
            lst = int(rng.integers(1, 3))
            lists.enter(batch, lst)
            newest(lst, batch.tolist())
        elif op == 1:  # promote (slots in no list ignored, a repeat keeps its first place)
            batch = rng.integers(0, cap, size=size)
            lst = int(rng.integers(1, 3))
            lists.promote(batch, lst)
            newest(lst, [s for s in dict.fromkeys(batch.tolist()) if where[s]])
        elif op == 2:  # refresh
            batch = rng.integers(0, cap, size=size)
            lists.refresh(batch)
            for s in reversed(list(dict.fromkeys(batch.tolist()))):
                if where[s]:
                    model[where[s]].move_to_end(s)
        elif op == 3:  # pop, some refused
            lst = int(rng.integers(1, 3))
            refused = set(rng.integers(0, cap, size=int(rng.integers(0, 8))).tolist())
            had_old = lists._old[lst] is not None
            got = lists.pop(lst, size, evictable_except(*refused)).tolist()
            crossings += had_old and lists._old[lst] is None
            want = [s for s in model[lst] if s not in refused][:size]
            assert got == want
            for s in want:
                del model[lst][s]
                where[s] = 0
        else:  # remove
            batch = np.unique(rng.integers(0, cap, size=int(rng.integers(0, 4))))
            lists.remove(batch)
            for s in batch.tolist():
                model[where[s]].pop(s, None)
                where[s] = 0
        for lst in (1, 2):
            assert lists.order(lst).tolist() == list(model[lst])
            assert lists.size(lst) == len(model[lst])
    assert (lists.rebuilds > 0) == no_room  # else the room for the moves was always there
    if no_room:
        pass
    elif move_from is None:
        assert renewals == 0
    else:  # the moves and the crossing pops were met; a few times an append's entries
        assert renewals > 50 and crossings > 5
        assert moved_most[0] <= 16 * 9 + (move_batch or 0)


def test_ordered_recency_gives_the_recency_log_s_victims() -> None:
    """The host tier's LRU order (an OrderedDict) and the compact one (numpy logs) take
    the same victims through every kind of call, refused candidates included."""
    from kvferry.cache._recency import OrderedRecency

    rng = np.random.default_rng(7)
    cap = 64
    od, log = OrderedRecency(), RecencyLists(cap, 1, initial=16)
    resident: set[int] = set()
    for _ in range(3000):
        op = rng.integers(0, 4)
        if op == 0:  # admit slots in no list, a batch's head newest
            free = np.array(sorted(set(range(cap)) - resident), np.int64)
            batch = rng.permutation(free)[: rng.integers(0, 9)] if len(free) else free
            od.enter(batch)
            log.enter(batch, 1)
            resident.update(batch.tolist())
        elif op == 1:  # touch: some resident, some not, a repeat
            batch = rng.integers(0, cap, size=int(rng.integers(0, 12)))
            od.refresh(batch)
            log.refresh(batch)
        elif op == 2:  # evict, some candidates refused (pinned)
            refused = rng.integers(0, cap, size=int(rng.integers(0, 6)))
            n = int(rng.integers(0, 10))
            a = od.pop(n, evictable_except(*refused.tolist()))
            b = log.pop(1, n, evictable_except(*refused.tolist()))
            assert a.tolist() == b.tolist()
            resident.difference_update(a.tolist())
        else:  # forget some (distinct, as the directory hands them)
            batch = np.unique(rng.integers(0, cap, size=int(rng.integers(0, 4))))
            od.remove(batch)
            log.remove(batch)
            resident.difference_update(batch.tolist())
        assert od.order().tolist() == log.order(1).tolist()
    assert len(od) == log.size(1) == len(resident)


@pytest.mark.parametrize("order", ["dict", "log"])
def test_lru_victims_are_the_same_in_either_order(order: str) -> None:
    lru = make_policy("lru", 6, lru_order=order)  # type: ignore[arg-type]
    assert isinstance(lru, LRUPolicy)
    lru.admit(np.array([2, 1, 0]), np.zeros(3, np.int64))
    lru.touch(np.array([1]))
    lru.admit(np.array([4, 3]), np.zeros(2, np.int64))
    assert lru.order().tolist() == [0, 2, 1, 3, 4]
    assert lru.victims(2, evictable_except(0), np.zeros(0, np.int64)).tolist() == [2, 1]
    assert lru.order().tolist() == [0, 3, 4]


class _EagerARC(ARCPolicy):
    """ARC given each store's tags at once, as a policy without ``tags_in_batches``."""

    tags_in_batches = False


def _request(
    d: Directory,
    rng: np.random.Generator,
    inflight: list[Any],
    keys: list[bytes],
    depth: int,
    *,
    absent: tuple[bytes, ...] = (),
) -> None:
    """A request of ``keys`` (its hit loaded, the rest stored) and the end of the one
    ``depth`` requests before it: its load and store complete (a tenth of the stores
    fail), and it touches its keys (and ``absent`` ones)."""
    n = d.lookup(keys)
    load = d.prepare_load(keys[:n]) if n else None
    inflight.append((keys, load, d.prepare_store(keys[n:])))
    if len(inflight) > depth:
        done, load, slots = inflight.pop(0)
        if load is not None:
            d.complete_load(load)
        d.complete_store(slots[slots >= 0], ok=bool(rng.random() > 0.1))
        d.touch([*done, *absent])


def _arc_run(policy: ARCPolicy, watermarks: tuple[float, float]) -> tuple[list[bytes], dict]:
    """A seeded run (requests in flight, failed stores, discards, evictor passes, a reset)
    through an ARC directory: the keys it evicted, in order, and its policy's gauges."""
    rng = np.random.default_rng(7)
    d = Directory(60, policy=policy, watermarks=watermarks, events=True)
    inflight: list[Any] = []
    for step in range(600):
        keys = [k(int(i)) for i in rng.zipf(1.3, int(rng.integers(1, 9))) % 300]
        _request(d, rng, inflight, keys, 4)
        if step % 97 == 0:
            d.discard([k(int(i)) for i in rng.integers(0, 300, 5)])
        if step == 400:
            d.reset()
        d.evict()
    evicted = [key for e in d.take_events() if isinstance(e, BlocksRemoved) for key in e.keys]
    return evicted, d.statistics().policy_stats


@pytest.mark.parametrize("watermarks", [(1.0, 1.0), (0.8, 0.9)])
def test_arc_learns_the_same_from_tags_in_batches(watermarks: tuple[float, float]) -> None:
    batched, eager = ARCPolicy(60), _EagerARC(60)
    got, stats = _arc_run(batched, watermarks)
    want, want_stats = _arc_run(eager, watermarks)
    assert got == want
    assert stats == want_stats
    assert stats["ghost_hits_b1"] > 0 and stats["ghost_hits_b2"] > 0


def _adapt(p: float, capacity: int, b1: int, b2: int, in_b1: list[bool]) -> float:
    """vLLM's ARC adaptation, hit by hit."""
    for is_b1 in in_b1:
        if is_b1 and b1:
            p = min(p + max(1.0, b2 / b1), float(capacity))
            b1 -= 1
        elif b2:
            p = max(p - max(1.0, b1 / b2), 0.0)
            b2 -= 1
    return p


@pytest.mark.parametrize("case", ["b1", "b2", "both", "capped", "floored"])
def test_arc_adapts_its_target_as_vllm_does_hit_by_hit(case: str) -> None:
    rng = np.random.default_rng(3)
    arc = ARCPolicy(1000)
    b1 = rng.integers(1, 2**62, 700) | 1
    b2 = rng.integers(1, 2**62, 300) | 1
    arc._b1.push(b1)
    arc._b2.push(b2)
    arc.p = {"capped": 990.0, "floored": 3.0}.get(case, 333.3)
    fresh = rng.integers(1, 2**62, 50) | 1
    hits = {"b1": [b1[:40]], "b2": [b2[:40]], "capped": [b1[:40]], "floored": [b2[:40]]}
    chosen = hits.get(case, [b1[:30], b2[:30]])
    tags = rng.permutation(np.concatenate([fresh, *chosen]))
    in_b1 = [bool(t) for t in np.isin(tags, b1)]
    in_b1 = [i for i, t in zip(in_b1, tags, strict=True) if i or t in set(b2.tolist())]
    want = _adapt(arc.p, 1000, 700, 300, in_b1)
    arc.store_miss(tags)
    arc._learn()
    assert arc.p == want
    assert len(arc._b1) + len(arc._b2) == 1000 - sum(len(c) for c in chosen)


@pytest.mark.parametrize("seed", range(5))
def test_lru_touches_the_slots_found_as_it_touches_the_ready_ones(seed: int) -> None:
    """The OrderedDict LRU's touch_found (the index's slots, unfiltered) gives the
    directory the order its touch of the READY slots gives: the same victims."""
    runs = []
    for found in (True, False):
        policy = LRUPolicy(40, order="dict")
        if not found:
            policy.touch_found = None
        d = Directory(40, policy=policy, watermarks=(1.0, 1.0), events=True)
        rng = np.random.default_rng(seed)
        inflight: list[Any] = []
        for _ in range(400):
            keys = [k(int(i)) for i in rng.integers(0, 120, int(rng.integers(1, 9)))]
            _request(d, rng, inflight, keys, 3, absent=(k(999),))
        runs.append(
            [key for e in d.take_events() if isinstance(e, BlocksRemoved) for key in e.keys]
        )
    assert runs[0] == runs[1] and len(runs[0]) > 100


def test_lru_keeps_its_order_in_logs_from_a_million_slots_even_evicting_inline() -> None:
    from kvferry.cache._recency import LogRecency, OrderedRecency

    small = Directory(1000, watermarks=(1.0, 1.0))
    large = Directory(1_000_000, watermarks=(1.0, 1.0))
    assert isinstance(small.policy._order, OrderedRecency)  # type: ignore[attr-defined]
    assert isinstance(large.policy._order, LogRecency)  # type: ignore[attr-defined]
