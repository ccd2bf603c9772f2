"""Tiers below host memory: chunk format, the local disk store and its I/O actor.

Driven by the connector (docs/architecture.md, "The disk tier").
"""

from __future__ import annotations

from ._actor import DeleteChunks as DeleteChunks
from ._actor import DiskIOActor as DiskIOActor
from ._actor import DiskIOMsg as DiskIOMsg
from ._actor import DiskIOStatistics as DiskIOStatistics
from ._actor import DiskJobResult as DiskJobResult
from ._actor import GetDiskStatistics as GetDiskStatistics
from ._actor import PollDiskJobs as PollDiskJobs
from ._actor import ReadChunks as ReadChunks
from ._actor import ScanDisk as ScanDisk
from ._actor import WriteChunks as WriteChunks
from ._actor import keys_array as keys_array
from ._disk import DiskStatistics as DiskStatistics
from ._disk import DiskStore as DiskStore
from ._disk import FileOps as FileOps
from ._disk import Outcome as Outcome
from ._disk import ScanReport as ScanReport
from ._disk import aligned_buffer as aligned_buffer
from ._format import ALIGNMENT as ALIGNMENT
from ._format import FORMAT_VERSION as FORMAT_VERSION
from ._format import HEADER_SIZE as HEADER_SIZE
from ._format import MAX_KEY_BYTES as MAX_KEY_BYTES
from ._format import ChunkCorrupt as ChunkCorrupt
from ._format import ChunkForeign as ChunkForeign
from ._format import ChunkHeader as ChunkHeader
from ._format import Fingerprint as Fingerprint
from ._format import decode_header as decode_header

__all__ = [
    "ALIGNMENT",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAX_KEY_BYTES",
    "ChunkCorrupt",
    "ChunkForeign",
    "ChunkHeader",
    "DeleteChunks",
    "DiskIOActor",
    "DiskIOMsg",
    "DiskIOStatistics",
    "DiskJobResult",
    "DiskStatistics",
    "DiskStore",
    "FileOps",
    "Fingerprint",
    "GetDiskStatistics",
    "Outcome",
    "PollDiskJobs",
    "ReadChunks",
    "ScanDisk",
    "ScanReport",
    "WriteChunks",
    "aligned_buffer",
    "decode_header",
    "keys_array",
]
