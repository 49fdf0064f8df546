"""node_manager.kv.segments: the SSD segment file header."""

from __future__ import annotations

import hashlib
import struct

import pytest

from node_manager.kv.pages import KEY_ID_BYTES, PageMac
from node_manager.kv.segments import (
    ALIGN,
    MAGIC,
    MIN_READ_VERSION,
    SUFFIX,
    VERSION,
    OutdatedSegment,
    SegmentEntry,
    SegmentFormatError,
    SegmentHeader,
    decode_header,
    encode_header,
    fixed_header_size,
    header_length,
    parse_header,
    segment_name,
)
from symphony.kv_addressing import BlockKey
from tests.helpers import TEST_MODEL

KEY_ID = PageMac(b"a secret of the segment tests").key_id


def key(n: int) -> BlockKey:
    return BlockKey(hashlib.sha256(str(n).encode()).digest())


def entries(count: int) -> list[SegmentEntry]:
    return [SegmentEntry(key(i), i % 5, (i * 0x9E3779B97F4A7C15) % 2**64) for i in range(count)]


@pytest.mark.parametrize("count", [0, 1, 3, 92, 93, 200])
def test_header_round_trip(count: int) -> None:
    written = entries(count)
    data = encode_header(seq=0xDEADBEEF01, page_bytes=64, model=TEST_MODEL, entries=written, key_id=KEY_ID)
    header = parse_header(data)
    assert isinstance(header, SegmentHeader)
    assert header.seq == 0xDEADBEEF01
    assert header.page_bytes == 64
    assert header.entries == tuple(written)
    assert header.model == TEST_MODEL
    assert header.key_id == KEY_ID
    assert header.owner == TEST_MODEL + KEY_ID
    assert header.header_len == len(data)
    assert decode_header(data[: fixed_header_size()]) == (count, len(data))


@pytest.mark.parametrize("count", [0, 1, 3, 92, 93, 200, 1000])
def test_header_length_is_4096_aligned(count: int) -> None:
    length = header_length(count)
    data = encode_header(1, 64, TEST_MODEL, entries(count), KEY_ID)
    assert len(data) == length
    assert length % ALIGN == 0
    assert ALIGN == 4096
    assert length >= fixed_header_size() + count * (32 + 4 + 8)
    assert length - (fixed_header_size() + count * (32 + 4 + 8)) < ALIGN


def test_header_grows_past_one_alignment_unit() -> None:
    per_entry = 32 + 4 + 8
    fits = (ALIGN - fixed_header_size()) // per_entry
    assert header_length(fits) == ALIGN
    assert header_length(fits + 1) == 2 * ALIGN


def test_page_offsets_and_file_size() -> None:
    header = parse_header(encode_header(7, 64, TEST_MODEL, entries(3), KEY_ID))
    assert header.page_offset(0) == 4096
    assert header.page_offset(2) == 4096 + 128
    assert header.file_bytes == 4096 + 3 * 64


def test_segment_name() -> None:
    assert segment_name(0x1F) == "seg-000000000000001f" + SUFFIX
    assert SUFFIX == ".kvseg"


def test_bad_magic() -> None:
    data = bytearray(encode_header(1, 64, TEST_MODEL, entries(2), KEY_ID))
    data[0:8] = b"NOTMAGIC"
    with pytest.raises(SegmentFormatError, match="magic"):
        parse_header(bytes(data))


def test_bad_version() -> None:
    data = bytearray(encode_header(1, 64, TEST_MODEL, entries(2), KEY_ID))
    assert data[:8] == MAGIC
    struct.pack_into("<H", data, 8, VERSION + 1)
    with pytest.raises(SegmentFormatError, match="version") as raised:
        parse_header(bytes(data))
    assert not isinstance(raised.value, OutdatedSegment)


def test_older_version_is_outdated_not_damaged() -> None:
    data = bytearray(encode_header(1, 64, TEST_MODEL, entries(2), KEY_ID))
    struct.pack_into("<H", data, 8, MIN_READ_VERSION - 1)
    with pytest.raises(OutdatedSegment, match="predates"):
        parse_header(bytes(data))


def test_partial_tail_flags_round_trip_without_touching_the_layer() -> None:
    written = [SegmentEntry(key(i), layer=7 - i, checksum=i, tail=i % 2 == 1) for i in range(4)]
    header = parse_header(encode_header(1, 64, TEST_MODEL, written, KEY_ID))
    assert list(header.entries) == written
    assert [entry.layer for entry in header.entries] == [7, 6, 5, 4]


@pytest.mark.parametrize("offset_in_table", [0, 31, 32, 36, 44, 87])
def test_flipped_byte_in_entry_table(offset_in_table: int) -> None:
    data = bytearray(encode_header(1, 64, TEST_MODEL, entries(2), KEY_ID))
    data[fixed_header_size() + offset_in_table] ^= 0x01
    with pytest.raises(SegmentFormatError, match="checksum"):
        parse_header(bytes(data))


CRC_AT = 8 + 2 + 2 + 4 + 4 + 8 + 4 + 4  # magic, version, reserved, page_bytes, count, seq, header_len, reserved


def test_flipped_table_crc() -> None:
    data = bytearray(encode_header(1, 64, TEST_MODEL, entries(2), KEY_ID))
    data[CRC_AT + 7] ^= 0x80
    with pytest.raises(SegmentFormatError):
        parse_header(bytes(data))


@pytest.mark.parametrize("offset", [0, 17, 31])
def test_the_crc_covers_the_model_fingerprint(offset: int) -> None:
    """A damaged fingerprint is damage, not another model: the segment is dropped as damaged."""
    data = bytearray(encode_header(1, 64, TEST_MODEL, entries(2), KEY_ID))
    assert data[CRC_AT + 8 : CRC_AT + 40] == TEST_MODEL  # before the key id, which ends the fixed header
    data[CRC_AT + 8 + offset] ^= 0x01
    with pytest.raises(SegmentFormatError, match="checksum"):
        parse_header(bytes(data))


@pytest.mark.parametrize("offset", [0, 7])
def test_the_crc_covers_the_key_id(offset: int) -> None:
    """A damaged key id is damage, not another cluster's secret."""
    data = bytearray(encode_header(1, 64, TEST_MODEL, entries(2), KEY_ID))
    assert data[CRC_AT + 40 : CRC_AT + 48] == KEY_ID and fixed_header_size() == CRC_AT + 48
    data[CRC_AT + 40 + offset] ^= 0x01
    with pytest.raises(SegmentFormatError, match="checksum"):
        parse_header(bytes(data))


def test_a_key_id_must_be_8_bytes() -> None:
    assert KEY_ID_BYTES == 8
    with pytest.raises(ValueError, match="8 bytes"):
        encode_header(1, 64, TEST_MODEL, entries(1), KEY_ID[:4])


def test_a_version_4_segment_is_outdated() -> None:
    """Version 4 pages carry unkeyed xxh3 checksums, which no MAC check can pass: dropped as outdated."""
    data = bytearray(encode_header(1, 64, TEST_MODEL, entries(2), KEY_ID))
    struct.pack_into("<H", data, 8, 4)
    with pytest.raises(OutdatedSegment):
        parse_header(bytes(data))


def test_a_fingerprint_must_be_32_bytes() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        encode_header(1, 64, TEST_MODEL[:16], entries(1), KEY_ID)  # type: ignore[arg-type]


def test_a_version_2_header_is_outdated() -> None:
    """Format 2 (no fingerprint: its pages may be any model's) is recognised by its first 10 bytes,
    though its fixed header is shorter than this format's."""
    v2 = struct.pack("<8sHHIIQIIQ", MAGIC, 2, 0, 64, 1, 1, 4096, 0, 0).ljust(4096, b"\x00")
    with pytest.raises(OutdatedSegment):
        decode_header(v2[: fixed_header_size()])


def test_inconsistent_header_length() -> None:
    data = bytearray(encode_header(1, 64, TEST_MODEL, entries(2), KEY_ID))
    struct.pack_into("<I", data, 8 + 2 + 2 + 4 + 4 + 8, 8192)  # header_len field
    with pytest.raises(SegmentFormatError, match="length"):
        parse_header(bytes(data))


def test_count_larger_than_data_is_truncated_table() -> None:
    data = bytearray(encode_header(1, 64, TEST_MODEL, entries(2), KEY_ID))
    struct.pack_into("<I", data, 8 + 2 + 2 + 4, 500)  # count field
    struct.pack_into("<I", data, 8 + 2 + 2 + 4 + 4 + 8, header_length(500))  # keep header_len consistent
    with pytest.raises(SegmentFormatError, match="truncated"):
        parse_header(bytes(data))


@pytest.mark.parametrize("length", [0, 1, 9, 43, 75, 82])
def test_short_input(length: int) -> None:
    data = encode_header(1, 64, TEST_MODEL, entries(1), KEY_ID)[:length]
    with pytest.raises(SegmentFormatError):
        parse_header(data)
    with pytest.raises(SegmentFormatError):
        decode_header(data)


def test_format_error_is_a_value_error() -> None:
    assert issubclass(SegmentFormatError, ValueError)
