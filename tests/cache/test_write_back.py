"""A write-back directory (a lower tier written on eviction, ``write: "on_evict"``): an
evicted block stops being a hit at once but keeps its slot, and its key, until the
caller wrote it down and ended the demotion; nothing is freed twice, a reset leaves the
bytes of a write in flight alone."""

from __future__ import annotations

import numpy as np

from kvferry.cache import BlocksRemoved, Directory
from kvferry.cache._testing import key as k


def full(d: Directory, n: int) -> None:
    slots = d.prepare_store([k(i) for i in range(n)])
    d.complete_store(slots, ok=True)


def test_an_evicted_block_is_no_hit_but_keeps_its_slot_until_its_demotion_ends() -> None:
    d = Directory(4, watermarks=(1.0, 1.0), write_back=True, events=True)
    full(d, 4)
    d.take_events()
    assert d.prepare_store([k(10)]).tolist() == [-1]  # its room is still being written
    [[victim]] = [e.keys for e in d.take_events() if isinstance(e, BlocksRemoved)]
    assert d.ready([k(i) for i in range(4)]).sum() == 3 and not d.ready([victim])[0]
    assert d.statistics().demoting == 1
    slots, keys = d.take_demotions()
    assert keys == [victim] and d.used == 4
    assert d.take_demotions()[1] == []  # handed out once
    d.end_demotions(slots)
    assert d.used == 3 and d.statistics().demoting == 0
    assert d.prepare_store([k(10)]).tolist() == slots.tolist()


def test_a_demoting_key_is_not_stored_again_meanwhile() -> None:
    d = Directory(2, watermarks=(1.0, 1.0), write_back=True)
    full(d, 2)
    d.prepare_store([k(5)])  # evicts one: DEMOTING
    [victim] = d.take_demotions()[1]
    assert d.prepare_store([victim]).tolist() == [-1]
    assert d.statistics().stores_skipped_present == 1


def test_the_evictor_leaves_demoting_slots_to_their_writes() -> None:
    d = Directory(10, watermarks=(0.5, 0.8), write_back=True)
    full(d, 9)
    assert d.evict() == 4  # down to the low watermark
    assert d.room_short() == 0  # the 4 on their way out count as gone
    assert d.evict() == 0
    slots, _ = d.take_demotions()
    d.end_demotions(slots)
    assert d.used == 5


def test_a_reset_drops_demotions_not_taken_and_frees_taken_ones_when_they_end() -> None:
    d = Directory(4, watermarks=(1.0, 1.0), write_back=True)
    full(d, 4)
    d.prepare_store([k(10)])
    taken, _ = d.take_demotions()
    d.prepare_store([k(11)])  # a second demotion, not taken before the reset
    d.reset()
    assert d.take_demotions()[1] == []  # of no use after a reset: freed
    assert d.used == 1  # the taken one: still read by its write
    d.end_demotions(taken)
    assert d.used == 0
    full(d, 4)  # every slot usable again
    assert d.used == 4 and d.invariant_errors == 0


def test_ending_a_slot_that_is_not_demoting_is_a_counted_invariant_error() -> None:
    d = Directory(4, write_back=True)
    full(d, 2)
    d.end_demotions(np.array([0, 3]))  # READY, FREE
    assert d.invariant_errors == 1
    assert d.lookup([k(0), k(1)]) == 2  # left alone


def test_without_write_back_an_eviction_frees_at_once() -> None:
    d = Directory(2, watermarks=(1.0, 1.0))
    full(d, 2)
    assert d.prepare_store([k(5)]).tolist() != [-1]
    assert d.take_demotions()[1] == [] and d.statistics().demoting == 0


def test_ending_a_demotion_not_taken_yet_is_a_counted_invariant_error_and_frees_nothing() -> None:
    """A caller's bug: a DEMOTING slot still listed for take_demotions, ended. Freed, it
    would be stored again, then handed out by take_demotions under its new key (written
    down as the evicted block, and freed twice); it is reported and left alone."""
    d = Directory(4, watermarks=(1.0, 1.0), write_back=True)
    full(d, 4)
    d.prepare_store([k(10)])  # evicts one: DEMOTING
    taken, [first] = d.take_demotions()
    d.prepare_store([k(11), k(12)])  # evicts another: DEMOTING, listed, not taken
    [second] = [key for key in map(k, range(4)) if key != first and not d.ready([key])[0]]
    listed = d.slot_of(second)
    assert listed is not None and listed not in taken.tolist()
    d.end_demotions(np.array([*taken.tolist(), listed]))  # the taken one ends, not the other
    assert d.invariant_errors == 1
    assert d.used == 3 and d.statistics().demoting == 1
    assert d.prepare_store([k(13)]).tolist() == [taken[0]]  # the room the first left
    assert d.prepare_store([k(14)]).tolist() == [-1]  # the second's is still being written
    slots, keys = d.take_demotions()
    assert slots.tolist() == [listed] and keys == [second]  # handed out with its own key
    d.end_demotions(slots)
    assert d.used == 3 and d.statistics().demoting == 0 and d.invariant_errors == 1
