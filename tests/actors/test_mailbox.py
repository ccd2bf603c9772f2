"""The mailbox on its own: bounded, FIFO, and a defined end."""

from __future__ import annotations

import anyio
import pytest

from kvferry.actors._mailbox import Mailbox

pytestmark = pytest.mark.anyio


async def test_items_come_out_in_order_and_room_is_bounded() -> None:
    box: Mailbox[int] = Mailbox(2)
    box.send_nowait(1)
    await box.send(2)
    with pytest.raises(anyio.WouldBlock):
        box.send_nowait(3)
    assert (len(box), box.ready) == (2, True)
    assert [box.receive_nowait(), await box.receive()] == [1, 2]
    with pytest.raises(anyio.WouldBlock):
        box.receive_nowait()


async def test_a_closed_mailbox_hands_out_what_it_holds_then_ends() -> None:
    box: Mailbox[int] = Mailbox(4)
    box.send_nowait(1)
    box.close()
    with pytest.raises(anyio.ClosedResourceError):
        box.send_nowait(2)
    assert await box.receive() == 1
    for _ in range(2):  # the end stays the end
        with pytest.raises(anyio.EndOfStream):
            await box.receive()


async def test_closing_fails_every_blocked_sender() -> None:
    box: Mailbox[int] = Mailbox(1)
    box.send_nowait(0)
    failed: list[int] = []

    async def sender(n: int) -> None:
        try:
            await box.send(n)
        except anyio.ClosedResourceError:
            failed.append(n)

    async with anyio.create_task_group() as tg:
        for n in (1, 2, 3):
            tg.start_soon(sender, n)
        await anyio.wait_all_tasks_blocked()
        assert box.senders_waiting == 3
        box.close()
    assert sorted(failed) == [1, 2, 3]
    assert box.receive_nowait() == 0


async def test_a_waiting_receiver_wakes_for_the_next_item() -> None:
    box: Mailbox[str] = Mailbox(1)
    got: list[str] = []

    async def receiver() -> None:
        got.append(await box.receive())

    async with anyio.create_task_group() as tg:
        tg.start_soon(receiver)
        await anyio.wait_all_tasks_blocked()
        box.send_nowait("hello")
    assert got == ["hello"]


def test_a_mailbox_holds_at_least_one_message() -> None:
    with pytest.raises(ValueError, match="mailbox_size"):
        Mailbox(0)
