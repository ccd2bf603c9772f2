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


class ActorStopped(KVFerryError):
    """The actor an ask was sent to stopped (or crashed) before it answered."""


class ActorCrashed(KVFerryError):
    """An actor's ``tell`` handler raised and its supervisor gave up on it."""


class HostMemoryError(KVFerryError, MemoryError):
    """The host pool could not be allocated (the machine can't give the bytes asked for)."""


class TransferError(KVFerryError):
    """A copy between device and host memory failed."""
