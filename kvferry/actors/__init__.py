"""The actor runtime: actors with bounded mailboxes on anyio, and ways to drive them."""

from __future__ import annotations

from ._base import Actor as Actor
from ._base import ActorRef as ActorRef
from ._base import ActorStatistics as ActorStatistics
from ._base import Reply as Reply
from ._base import RestartPolicy as RestartPolicy
from ._runtime import SteppedRuntime as SteppedRuntime
from ._runtime import SyncRuntime as SyncRuntime
from ._runtime import ThreadRuntime as ThreadRuntime
from ._runtime import start_runtime as start_runtime
from ._system import ActorSystem as ActorSystem
from .._errors import ActorCrashed as ActorCrashed
from .._errors import ActorStopped as ActorStopped

__all__ = [
    "Actor",
    "ActorCrashed",
    "ActorRef",
    "ActorStatistics",
    "ActorStopped",
    "ActorSystem",
    "Reply",
    "RestartPolicy",
    "SteppedRuntime",
    "SyncRuntime",
    "ThreadRuntime",
    "start_runtime",
]
