"""The exceptions kvferry raises, each for one reason."""

from __future__ import annotations


class KVFerryError(Exception):
    """Base class of every kvferry error."""


class ConfigError(KVFerryError, ValueError):
    """A configuration value is missing, unknown or out of range.

    The message names the offending key.
    """

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"kvferry config {key!r}: {message}")
        self.key = key
        self.detail = message


class ActorStopped(KVFerryError):
    """The actor an ask was sent to stopped (or crashed) before it answered."""


class ActorCrashed(KVFerryError):
    """An actor's ``tell`` handler raised and its supervisor gave up on it."""


class HostMemoryError(KVFerryError, MemoryError):
    """The host pool could not be allocated (the machine can't give the bytes asked for)."""


class TransferError(KVFerryError):
    """A copy between device and host memory failed."""


class InvariantError(KVFerryError):
    """kvferry's own bookkeeping broke one of its invariants (docs/architecture.md,
    "Invariants and where they are held"): a bug, never the caller's doing.

    Engine-facing code does not raise it: it fails the job or request concerned, logs the
    error once with its context (event ``invariant_broken``), and the engine keeps
    running. ``invariant`` names what broke, in snake_case.
    """

    def __init__(self, invariant: str, message: str) -> None:
        super().__init__(f"{invariant}: {message}")
        self.invariant = invariant
