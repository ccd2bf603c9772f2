"""The chunk format: a stable fingerprint digest, a header that round-trips, and a
decode that names the check that failed."""

from __future__ import annotations

import os
import subprocess
import sys

import attrs
import pytest

from kvferry.tiers import (
    HEADER_SIZE,
    MAX_KEY_BYTES,
    ChunkCorrupt,
    ChunkForeign,
    ChunkHeader,
    Fingerprint,
    decode_header,
)

FP = Fingerprint(
    model="tiny-llama",
    dtype="bfloat16",
    layout="LBHNC",
    block_size=128,
    tp_rank=0,
    tp_world_size=2,
    block_hash_algorithm="sha256_cbor",
)
KEY = bytes(range(36))


def header(**changes: object) -> ChunkHeader:
    fields: dict[str, object] = {
        "fingerprint": FP.digest,
        "key": KEY,
        "payload_length": 2 << 20,
        "payload_checksum": 0x0123456789ABCDEF,
    }
    fields.update(changes)
    return ChunkHeader(**fields)  # type: ignore[arg-type]


def test_fingerprint_digest_is_the_same_in_another_process() -> None:
    code = (
        "from kvferry.tiers import Fingerprint;"
        "print(Fingerprint(model='tiny-llama', dtype='bfloat16', layout='LBHNC',"
        " block_size=128, tp_rank=0, tp_world_size=2,"
        " block_hash_algorithm='sha256_cbor').digest.hex())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True
    )
    assert out.stdout.strip() == FP.digest.hex()
    assert len(FP.digest) == 16


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other"},
        {"dtype": "float16"},
        {"layout": "BLHNC"},
        {"block_size": 64},
        {"tp_rank": 1},
        {"tp_world_size": 4},
        {"block_hash_algorithm": "sha256"},
        {"extra": {"pp_rank": "1"}},
    ],
)
def test_every_field_changes_the_digest(change: dict[str, object]) -> None:
    assert attrs.evolve(FP, **change).digest != FP.digest  # type: ignore[arg-type]


def test_extra_order_does_not_change_the_digest() -> None:
    a = attrs.evolve(FP, extra={"a": "1", "b": "2"})  # type: ignore[arg-type]
    b = attrs.evolve(FP, extra=[("b", "2"), ("a", "1")])  # type: ignore[arg-type]
    assert a.digest == b.digest and a == b


def test_fingerprint_refuses_a_rank_outside_the_world() -> None:
    with pytest.raises(ValueError, match="tp_rank"):
        attrs.evolve(FP, tp_rank=2)


def test_header_round_trips_and_is_one_aligned_block() -> None:
    raw = header().encode()
    assert len(raw) == HEADER_SIZE
    assert decode_header(raw, fingerprint=FP.digest, key=KEY, payload_length=2 << 20) == header()


def test_header_refuses_a_key_too_long_to_name_a_file() -> None:
    with pytest.raises(ValueError, match="key"):
        header(key=bytes(MAX_KEY_BYTES + 1)).encode()


def flip(raw: bytes, offset: int) -> bytes:
    return raw[:offset] + bytes([raw[offset] ^ 0x01]) + raw[offset + 1 :]


@pytest.mark.parametrize(
    ("offset", "check"),
    [
        (0, "magic"),
        (8, "version"),
        (49, "key"),  # the key length field: out of range
        (16, "header_checksum"),  # a fingerprint byte
        (32, "header_checksum"),  # a payload length byte
        (50, "header_checksum"),  # a key byte
        (50 + 36, "header_checksum"),  # the header checksum itself
    ],
)
def test_a_flipped_header_bit_names_its_check(offset: int, check: str) -> None:
    with pytest.raises(ChunkCorrupt) as caught:
        decode_header(flip(header().encode(), offset), fingerprint=FP.digest, key=KEY)
    assert caught.value.field == check


def test_a_valid_header_of_another_fingerprint_is_foreign() -> None:
    other = attrs.evolve(FP, tp_rank=1)
    with pytest.raises(ChunkForeign) as caught:
        decode_header(header(fingerprint=other.digest).encode(), fingerprint=FP.digest)
    assert caught.value.field == "fingerprint"


def test_another_key_and_another_length_are_named() -> None:
    raw = header().encode()
    with pytest.raises(ChunkCorrupt) as key_error:
        decode_header(raw, key=b"another key")
    assert key_error.value.field == "key"
    with pytest.raises(ChunkCorrupt) as length_error:
        decode_header(raw, payload_length=1 << 20)
    assert length_error.value.field == "length"
