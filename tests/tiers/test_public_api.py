from __future__ import annotations

import kvferry.tiers

EXPECTED = [
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


def test_tiers_exports_exactly_its_public_api() -> None:
    assert sorted(kvferry.tiers.__all__) == sorted(EXPECTED)
    for name in EXPECTED:
        assert getattr(kvferry.tiers, name) is not None
