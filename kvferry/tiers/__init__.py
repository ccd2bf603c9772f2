"""Tiers below host memory: chunk format, the local disk store, the shared Redis store,
and their I/O actors.

Driven by the connector (docs/architecture.md, "The disk tier"; docs/tiers.md for Redis).
The Redis store imports the ``redis`` package only when one is made (``kvferry[redis]``).
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
from ._breaker import BreakerStatistics as BreakerStatistics
from ._breaker import CircuitBreaker as CircuitBreaker
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
from ._redis import RedisStatistics as RedisStatistics
from ._redis import RedisStore as RedisStore
from ._redis_actor import GetRedisStatistics as GetRedisStatistics
from ._redis_actor import RedisIOActor as RedisIOActor
from ._redis_actor import RedisIOMsg as RedisIOMsg
from ._redis_actor import RedisIOStatistics as RedisIOStatistics

__all__ = [
    "ALIGNMENT",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAX_KEY_BYTES",
    "BreakerStatistics",
    "ChunkCorrupt",
    "ChunkForeign",
    "ChunkHeader",
    "CircuitBreaker",
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
    "GetRedisStatistics",
    "Outcome",
    "PollDiskJobs",
    "ReadChunks",
    "RedisIOActor",
    "RedisIOMsg",
    "RedisIOStatistics",
    "RedisStatistics",
    "RedisStore",
    "ScanDisk",
    "ScanReport",
    "WriteChunks",
    "aligned_buffer",
    "decode_header",
    "keys_array",
]
