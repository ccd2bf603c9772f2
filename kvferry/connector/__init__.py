"""The vLLM adapter. Load it with ``kv_connector_module_path="kvferry.connector"``.

This is the only sub-package that imports vLLM.
"""

from __future__ import annotations

from ._connector import KVFerryConnector as KVFerryConnector
from ._metadata import KVFerryMetadata as KVFerryMetadata
from ._metadata import KVFerryWorkerMetadata as KVFerryWorkerMetadata
from ._report import SchedulerStatistics as SchedulerStatistics

__all__ = ["KVFerryConnector", "KVFerryMetadata", "KVFerryWorkerMetadata", "SchedulerStatistics"]
