"""Scheduler-side bookkeeping of the host tier."""

from __future__ import annotations

from ._actor import ClearAll as ClearAll
from ._actor import CompleteLoad as CompleteLoad
from ._actor import CompleteStore as CompleteStore
from ._actor import DirectoryActor as DirectoryActor
from ._actor import DirectoryMsg as DirectoryMsg
from ._actor import GetStatistics as GetStatistics
from ._actor import Lookup as Lookup
from ._actor import PrepareLoad as PrepareLoad
from ._actor import PrepareStore as PrepareStore
from ._directory import Directory as Directory
from ._directory import DirectoryStatistics as DirectoryStatistics
from ._directory import Key as Key

__all__ = [
    "ClearAll",
    "CompleteLoad",
    "CompleteStore",
    "Directory",
    "DirectoryActor",
    "DirectoryMsg",
    "DirectoryStatistics",
    "GetStatistics",
    "Key",
    "Lookup",
    "PrepareLoad",
    "PrepareStore",
]
