"""The mailbox: a bounded FIFO with one receiver (the actor's task).

Built on an anyio semaphore that counts queued items, rather than on a memory object
stream: a stream creates an ``Event`` and a task record every time its receiver waits,
and checkpoints on every receive even when an item is ready; a semaphore wait is one
future, and receiving a queued item does not yield. On the stepped runtime that is the
difference between one loop iteration per hop and two.

A sender that finds the mailbox full parks with its item; the receiver, when it takes an
item, moves the oldest parked item into the queue and wakes that sender. Items therefore
enter the queue in the order their senders came, whatever order the scheduler wakes the
senders in (trio shuffles them), and a new sender never overtakes a parked one.

Who owns what: senders are any tasks on the actor system's loop; the receiver is the
actor's task alone. Nothing here may be touched from another thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

import anyio
import anyio.lowlevel

T = TypeVar("T")


class _Parked(Generic[T]):
    """A sender waiting for room, with its item."""

    __slots__ = ("item", "event", "moved", "refused")

    def __init__(self, item: T) -> None:
        self.item = item
        self.event = anyio.Event()
        self.moved = False  # its item is in the queue
        self.refused = False  # the mailbox closed first


class Mailbox(Generic[T]):
    __slots__ = ("_items", "_parked", "_ready", "closed", "size")

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"mailbox_size must be >= 1, got {size}")
        self.size = size
        self.closed = False
        self._items: deque[T] = deque()
        self._parked: deque[_Parked[T]] = deque()
        # One more unit than items once closed: the end marker the receiver finds last.
        self._ready = anyio.Semaphore(0, fast_acquire=True)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def ready(self) -> bool:
        """True when :meth:`receive_nowait` would not block (an item, or the end)."""
        return self._ready.value > 0

    @property
    def senders_waiting(self) -> int:
        return len(self._parked)

    def _has_room(self) -> bool:
        return len(self._items) < self.size and not self._parked

    def send_nowait(self, item: T) -> None:
        """Queue ``item``; :class:`anyio.WouldBlock` if full, ``ClosedResourceError`` if closed."""
        if self.closed:
            raise anyio.ClosedResourceError
        if not self._has_room():
            raise anyio.WouldBlock
        self._items.append(item)
        self._ready.release()

    async def send(self, item: T, *, taken: Callable[[], object] | None = None) -> None:
        """Queue ``item``, waiting for room. Always a checkpoint, full or not (trio's rule),
        so a sender in a loop cannot starve the loop.

        A send cancelled while parked is withdrawn, unless the receiver had already moved
        its item into the queue (as with anyio's streams): then it is delivered all the
        same, and the cancellation still propagates; ``taken`` is called first, so that
        whoever waits on the sender learns that the item got in.
        """
        if self.closed:
            raise anyio.ClosedResourceError
        await anyio.lowlevel.checkpoint()
        if self.closed:
            raise anyio.ClosedResourceError
        if self._has_room():
            self._items.append(item)
            self._ready.release()
            return
        parked = _Parked(item)
        self._parked.append(parked)
        try:
            await parked.event.wait()
        except BaseException:
            if parked.moved:
                if taken is not None:
                    taken()
            elif not parked.refused:
                self._parked.remove(parked)
            raise
        if parked.refused:
            raise anyio.ClosedResourceError

    def receive_nowait(self) -> T:
        """The oldest item; :class:`anyio.WouldBlock` if none, ``EndOfStream`` once closed
        and drained."""
        self._ready.acquire_nowait()
        return self._take()

    async def receive(self) -> T:
        """The oldest item, waiting for one; ``EndOfStream`` once closed and drained.

        Does not yield when an item is ready (see the module docstring).
        """
        await self._ready.acquire()
        return self._take()

    def _take(self) -> T:
        if self._items:
            item = self._items.popleft()
            if self._parked:  # the freed slot goes to the oldest parked sender
                parked = self._parked.popleft()
                parked.moved = True
                self._items.append(parked.item)
                self._ready.release()
                parked.event.set()
            return item
        assert self.closed
        self._ready.release()  # keep the end marker for the next receive
        raise anyio.EndOfStream

    def close(self) -> None:
        """No more sends: parked senders fail with ``ClosedResourceError``, the receiver
        gets what is queued, then ``EndOfStream``."""
        if self.closed:
            return
        self.closed = True
        while self._parked:
            parked = self._parked.popleft()
            parked.refused = True
            parked.event.set()
        self._ready.release()
