"""The chunk format of the tiers below host memory: every chunk describes itself.

A chunk is one offloaded block of one KV-cache group, every layer back to back (a host
slot's bytes). On disk it is a header of :data:`HEADER_SIZE` bytes followed by the
payload, zero-padded to :data:`ALIGNMENT`, so that the payload starts, and the file
ends, on an O_DIRECT boundary.

Header layout (little-endian), then zeros up to :data:`HEADER_SIZE`::

    magic            8s   b"KVFCHUNK"
    format version   u16  FORMAT_VERSION
    flags            u16  0 (reserved)
    header size      u32  HEADER_SIZE
    fingerprint      16s  Fingerprint.digest (xxh3_128)
    payload length   u64
    payload checksum u64  xxh3_64 of the payload
    key length       u16  <= MAX_KEY_BYTES
    key              key length bytes
    header checksum  u64  xxh3_64 of every header byte before it

In a Redis value (:mod:`._redis`) the same header is *compact*: its ``header size``
field is the header's own length (no zero padding; nothing there needs alignment), and
the payload follows at once. :meth:`ChunkHeader.encode` and :func:`decode_header` spell
both, one code path.

Decoding checks, in this order, and names the first that fails (:class:`ChunkCorrupt`):
``magic``, ``version``, ``key`` (its length field out of range), ``header_checksum``,
``fingerprint`` (:class:`ChunkForeign`: a valid chunk of another engine), ``key`` (not
the key asked for), ``length``; the payload's own check is ``checksum``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from typing import Literal

import attrs
import xxhash

from .._errors import KVFerryError

ALIGNMENT = 4096
"""O_DIRECT alignment of file offsets, lengths and memory: covers 512- and 4096-byte
sectors (the logical block size of every disk in use)."""

HEADER_SIZE = ALIGNMENT
"""The header takes one aligned block, whatever the key's length."""

MAGIC = b"KVFCHUNK"
FORMAT_VERSION = 1

MAX_KEY_BYTES = 120
"""Keys are vLLM's block-hash bytes plus the group index (36 bytes with sha256); the
limit keeps a key's hex spelling (the file's name) under the file systems' 255 bytes."""

_FIXED = struct.Struct("<8sHHI16sQQH")
_CHECK = struct.Struct("<Q")

Field = Literal["magic", "version", "header_checksum", "fingerprint", "key", "length", "checksum"]


class ChunkCorrupt(KVFerryError):
    """A chunk failed verification; ``field`` names the check that failed.

    A chunk that fails is a miss, never a load.
    """

    def __init__(self, field: Field, detail: str) -> None:
        super().__init__(f"chunk {field} check failed: {detail}")
        self.field: Field = field
        self.detail = detail


class ChunkForeign(ChunkCorrupt):
    """A well-formed chunk written under another :class:`Fingerprint` (another model,
    dtype, layout, rank...): not ours to load, and not ours to delete."""

    def __init__(self, detail: str) -> None:
        super().__init__("fingerprint", detail)


def _sorted_pairs(
    value: Mapping[str, object] | Iterable[tuple[str, object]],
) -> tuple[tuple[str, str], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((str(k), str(v)) for k, v in items))


@attrs.frozen(kw_only=True)
class Fingerprint:
    """Everything that makes a chunk's bytes valid for an engine.

    Two engines may load each other's chunks only if their fingerprints are equal.
    ``layout`` is the KV layout's own description (e.g. ``"LBHNC"`` with the per-layer
    byte runs); ``block_size`` is tokens per offloaded chunk; ``block_hash_algorithm``
    is vLLM's ``prefix_caching_hash_algo``. ``extra`` holds anything else that changes
    the bytes (pipeline rank, KV-cache dtype of a quantized cache, ...), as string pairs.
    """

    model: str
    dtype: str
    layout: str
    block_size: int
    tp_rank: int
    tp_world_size: int
    block_hash_algorithm: str
    extra: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_sorted_pairs)
    _digest: bytes = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if not 0 <= self.tp_rank < self.tp_world_size:
            raise ValueError(
                f"tp_rank must be in [0, tp_world_size={self.tp_world_size}), got {self.tp_rank}"
            )
        object.__setattr__(self, "_digest", xxhash.xxh3_128_digest(self.canonical()))

    def canonical(self) -> bytes:
        """The stable encoding the digest is taken of (sorted JSON, UTF-8)."""
        doc = {
            "kvferry_fingerprint": 1,
            "model": self.model,
            "dtype": self.dtype,
            "layout": self.layout,
            "block_size": self.block_size,
            "tp_rank": self.tp_rank,
            "tp_world_size": self.tp_world_size,
            "block_hash_algorithm": self.block_hash_algorithm,
            "extra": [list(p) for p in self.extra],
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @property
    def digest(self) -> bytes:
        """16 bytes: xxh3_128 of :meth:`canonical`; the same in every process and run."""
        return self._digest


@attrs.frozen(kw_only=True)
class ChunkHeader:
    """The decoded header of one chunk."""

    fingerprint: bytes
    key: bytes
    payload_length: int
    payload_checksum: int
    version: int = FORMAT_VERSION

    def encode(self, *, compact: bool = False) -> bytes:
        """:data:`HEADER_SIZE` bytes (see the module docstring); ``compact``: only the
        header's own bytes (:func:`compact_header_size`), as a Redis value holds it."""
        if not 0 < len(self.key) <= MAX_KEY_BYTES:
            raise ValueError(f"a key is 1 to {MAX_KEY_BYTES} bytes, got {len(self.key)}")
        if len(self.fingerprint) != 16:
            raise ValueError(f"a fingerprint digest is 16 bytes, got {len(self.fingerprint)}")
        body = (
            _FIXED.pack(
                MAGIC,
                self.version,
                0,
                compact_header_size(len(self.key)) if compact else HEADER_SIZE,
                self.fingerprint,
                self.payload_length,
                self.payload_checksum,
                len(self.key),
            )
            + self.key
        )
        body += _CHECK.pack(xxhash.xxh3_64_intdigest(body))
        return body if compact else body + bytes(HEADER_SIZE - len(body))


def compact_header_size(key_length: int) -> int:
    """Bytes of a compact header (no padding) for a key of ``key_length`` bytes."""
    return _FIXED.size + key_length + _CHECK.size


def payload_checksum(payload: memoryview | bytes) -> int:
    """xxh3_64 of the payload (a kept library, not hand-written)."""
    return xxhash.xxh3_64_intdigest(payload)


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to :data:`ALIGNMENT`."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def file_size(payload_length: int) -> int:
    """Bytes a chunk of ``payload_length`` takes on disk."""
    return HEADER_SIZE + padded(payload_length)


def decode_header(
    raw: bytes | memoryview,
    *,
    fingerprint: bytes | None = None,
    key: bytes | None = None,
    payload_length: int | None = None,
    compact: bool = False,
) -> ChunkHeader:
    """Decode and verify the first :data:`HEADER_SIZE` bytes of a chunk (``compact``:
    the first :func:`compact_header_size` bytes; the payload follows them).

    Checks ``fingerprint``, ``key`` and ``payload_length`` against the given values
    (None: not checked). Raises :class:`ChunkCorrupt` (or :class:`ChunkForeign`) naming
    the first check that failed.
    """
    raw = bytes(raw[:HEADER_SIZE])
    if len(raw) < _FIXED.size:
        raise ChunkCorrupt("length", f"header of {len(raw)} bytes")
    magic, version, _flags, header_size, fp, length, checksum, key_len = _FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise ChunkCorrupt("magic", f"{magic!r}")
    if version != FORMAT_VERSION or (not compact and header_size != HEADER_SIZE):
        raise ChunkCorrupt("version", f"version {version} header size {header_size}")
    end = _FIXED.size + key_len
    if not 0 < key_len <= MAX_KEY_BYTES or end + _CHECK.size > len(raw):
        raise ChunkCorrupt("key", f"key length {key_len}")
    if compact and header_size != compact_header_size(key_len):
        raise ChunkCorrupt("version", f"version {version} header size {header_size}")
    (stored_check,) = _CHECK.unpack_from(raw, end)
    if xxhash.xxh3_64_intdigest(raw[:end]) != stored_check:
        raise ChunkCorrupt("header_checksum", "header bytes do not match their checksum")
    if fingerprint is not None and fp != fingerprint:
        raise ChunkForeign(f"written by fingerprint {fp.hex()}, not {fingerprint.hex()}")
    found_key = raw[_FIXED.size : end]
    if key is not None and found_key != key:
        raise ChunkCorrupt("key", f"holds key {found_key.hex()}, not {key.hex()}")
    if payload_length is not None and length != payload_length:
        raise ChunkCorrupt("length", f"payload of {length} bytes, expected {payload_length}")
    return ChunkHeader(
        fingerprint=fp,
        key=found_key,
        payload_length=length,
        payload_checksum=checksum,
        version=version,
    )
