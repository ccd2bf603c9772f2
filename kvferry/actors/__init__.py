"""The actor runtime: actors with bounded mailboxes on anyio, supervised, and three ways
to drive them (on a running loop, on a loop thread, stepped from sync code).

docs/actors.md has the semantics in one table.
"""

from __future__ import annotations

from .._errors import ActorCrashed as ActorCrashed
from .._errors import ActorStopped as ActorStopped
from ._base import Actor as Actor
from ._base import ActorRef as ActorRef
from ._base import ActorStatistics as ActorStatistics
from ._base import Reply as Reply
from ._base import RestartPolicy as RestartPolicy
from ._runtime import SyncRuntime as SyncRuntime
from ._runtime import start_runtime as start_runtime
from ._stepped import SteppedRuntime as SteppedRuntime
from ._system import ActorSystem as ActorSystem
from ._system import ShutdownReport as ShutdownReport
from ._thread import ThreadRuntime as ThreadRuntime
from ._timers import Timer as Timer

__all__ = [
    "Actor",
    "ActorCrashed",
    "ActorRef",
    "ActorStatistics",
    "ActorStopped",
    "ActorSystem",
    "Reply",
    "RestartPolicy",
    "ShutdownReport",
    "SteppedRuntime",
    "SyncRuntime",
    "ThreadRuntime",
    "Timer",
    "start_runtime",
]
