from __future__ import annotations

import kvferry.tiers

EXPECTED = [
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


def test_tiers_exports_exactly_its_public_api() -> None:
    assert sorted(kvferry.tiers.__all__) == sorted(EXPECTED)
    for name in EXPECTED:
        assert getattr(kvferry.tiers, name) is not None
