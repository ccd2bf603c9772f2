"""Actors and messages the actor tests share."""

from __future__ import annotations

from typing import TypeAlias

import anyio
import attrs

from kvferry.actors import Actor, Reply, RestartPolicy


@attrs.frozen(kw_only=True)
class Add:
    n: int


@attrs.frozen(kw_only=True)
class Get:
    reply: Reply[int] = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class Boom:
    """A tell whose handler raises."""


@attrs.frozen(kw_only=True)
class AskBoom:
    reply: Reply[int] = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class AnswerThenBoom:
    """An ask whose handler answers, then raises."""

    reply: Reply[int] = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class Block:
    """Holds the actor inside its handler until ``gate`` is set."""

    gate: anyio.Event = attrs.field(eq=False)
    entered: anyio.Event | None = attrs.field(default=None, eq=False)


@attrs.frozen(kw_only=True)
class Forget:
    """An ask whose handler never answers."""

    reply: Reply[int] = attrs.field(eq=False, repr=False)


Msg: TypeAlias = Add | Get | Boom | AskBoom | AnswerThenBoom | Block | Forget


class Counter(Actor[Msg]):
    """Sums ``Add``; ``Boom`` raises; ``Block`` waits on its gate."""

    mailbox_size = 2
    restart_policy = RestartPolicy(max_restarts=2, within_s=60.0)

    def __init__(self) -> None:
        self.value = 0
        self.seen: list[int] = []
        self.restarted_with: list[BaseException] = []

    async def on_restart(self, error: BaseException) -> None:
        self.restarted_with.append(error)

    async def handle(self, msg: Msg) -> None:
        match msg:
            case Block(gate=gate, entered=entered):
                if entered is not None:
                    entered.set()
                await gate.wait()
            case Forget():
                pass
            case _:
                self.apply(msg)

    def apply(self, msg: Msg) -> None:
        """The messages whose handling never awaits."""
        match msg:
            case Add(n=n):
                self.value += n
                self.seen.append(n)
            case Get(reply=reply):
                reply.set(self.value)
            case Boom():
                raise RuntimeError("boom")
            case AskBoom():
                raise ValueError("bad ask")
            case AnswerThenBoom(reply=reply):
                reply.set(self.value)
                raise RuntimeError("answered, then boom")
            case _:
                raise TypeError(f"not handled without awaiting: {msg!r}")


async def block(ref: object, gate: anyio.Event) -> None:
    """Tell ``ref`` a Block and return once its handler is inside it."""
    entered = anyio.Event()
    await ref.tell(Block(gate=gate, entered=entered))  # type: ignore[attr-defined]
    await entered.wait()
