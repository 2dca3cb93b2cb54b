"""The block format: round trips, re-framing, and every corruption detected."""

from __future__ import annotations

import dataclasses
import random
import struct

import numpy as np
import pytest
import xxhash
from support import kv

from kvstore.block import (
    COPY_VERIFY_STEP,
    DTYPE_CODES,
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    TRAILER_BYTES,
    Block,
    BlockHeader,
    Codec,
    check_identity,
    check_trailer,
    checksum_trailer,
    copy_payload,
    encode_block,
    fill_sealed,
    fill_verified,
    frame_block,
    parse_header,
    payload_hasher,
    seal_block,
    stored_block,
    verify_block,
)
from kvstore.errors import CorruptBlock, LayoutMismatch
from kvstore.keys import DTYPE_SIZES, ChunkKey, KVLayout, Namespace, chunk_keys

LAYOUT = KVLayout(num_layers=2, num_kv_heads=3, head_dim=8, dtype="float16", chunk_tokens=16)
NS = Namespace("test-model", LAYOUT, tenant_salt="tenant")
KEYS = chunk_keys(NS, list(range(3 * LAYOUT.chunk_tokens)))
CHECKSUM_END = 96  # magic .. checksum; bytes [96, 128) are reserved


def payload_bytes(nbytes: int = LAYOUT.chunk_nbytes, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def make_block(
    payload: bytes | None = None, *, key_index: int = 1, codec: Codec = Codec.NONE
) -> tuple[Block, bytes]:
    raw = payload_bytes() if payload is None else payload
    parent = KEYS[key_index - 1] if key_index > 0 else None
    return encode_block(NS, KEYS[key_index], parent, memoryview(raw), codec=codec), raw


def stored(payload: bytes | None = None) -> bytes:
    return make_block(payload)[0].to_bytes()


# --- layout of the header ----------------------------------------------------------------


def test_header_layout_matches_the_documented_offsets() -> None:
    block, raw = make_block()
    data = block.to_bytes()
    assert len(block.header) == HEADER_BYTES == 128
    assert block.nbytes == len(data) == HEADER_BYTES + len(raw)
    assert data[0:4] == MAGIC == b"KVB1"
    assert struct.unpack_from("<H", data, 4)[0] == FORMAT_VERSION == 1
    assert data[6] == Codec.NONE
    assert data[7] == DTYPE_CODES["float16"]
    assert data[8:24] == NS.digest
    assert data[24:40] == KEYS[1]
    assert data[40:56] == KEYS[0]
    assert struct.unpack_from("<IIII", data, 56) == (2, 3, 8, 16)
    assert struct.unpack_from("<QQ", data, 72) == (len(raw), len(raw))
    checksum = xxhash.xxh3_64(data[:88] + data[HEADER_BYTES:]).intdigest()
    assert struct.unpack_from("<Q", data, 88)[0] == checksum
    assert data[96:128] == bytes(32)
    assert data[HEADER_BYTES:] == raw


def test_root_block_stores_zero_parent() -> None:
    block, _ = make_block(key_index=0)
    assert block.header[40:56] == bytes(16)
    assert verify_block(block.to_bytes()).parent is None


def test_every_dtype_has_a_code() -> None:
    assert set(DTYPE_CODES) == set(DTYPE_SIZES)
    assert len(set(DTYPE_CODES.values())) == len(DTYPE_CODES)
    for dtype in DTYPE_CODES:
        ns = Namespace("m", dataclasses.replace(LAYOUT, dtype=dtype))
        key = chunk_keys(ns, list(range(16)))[0]
        header = verify_block(encode_block(ns, key, None, memoryview(b"\x01" * 8)).to_bytes())
        assert header.dtype == dtype
        check_identity(header, ns, key)


# --- round trips -------------------------------------------------------------------------


@pytest.mark.parametrize("container", [bytes, bytearray, memoryview])
def test_round_trip(container: type) -> None:
    block, raw = make_block()
    data = container(block.to_bytes())
    header = verify_block(data)
    check_identity(header, NS, KEYS[1])
    assert bytes(stored_block(data).payload) == raw
    assert header == BlockHeader(
        codec=Codec.NONE,
        dtype="float16",
        namespace_digest=NS.digest,
        key=KEYS[1],
        parent=KEYS[0],
        num_layers=2,
        num_kv_heads=3,
        head_dim=8,
        chunk_tokens=16,
        raw_len=len(raw),
        payload_len=len(raw),
    )
    assert type(header.key) is ChunkKey
    assert type(header.parent) is ChunkKey
    assert header.matches(LAYOUT)
    assert parse_header(data) == header


def test_empty_payload_round_trips() -> None:
    block, _ = make_block(b"")
    data = block.to_bytes()
    assert len(data) == HEADER_BYTES
    assert verify_block(data).payload_len == 0
    assert bytes(stored_block(data).payload) == b""


def test_codec_and_raw_len_are_recorded() -> None:
    compressed = b"\x28\xb5\x2f\xfd" + bytes(60)
    block = encode_block(
        NS, KEYS[2], KEYS[1], memoryview(compressed), codec=Codec.ZSTD_BYTEPLANE, raw_len=4096
    )
    header = verify_block(block.to_bytes())
    assert header.codec is Codec.ZSTD_BYTEPLANE
    assert header.raw_len == 4096
    assert header.payload_len == len(compressed)


def test_typed_and_shaped_payload_views_are_framed_as_bytes() -> None:
    chunk = np.arange(np.prod(LAYOUT.chunk_shape), dtype=np.float16).reshape(LAYOUT.chunk_shape)
    view = memoryview(chunk)
    assert view.format == "e" and view.ndim == 5
    block = encode_block(NS, KEYS[1], KEYS[0], view)
    assert block.payload.format == "B" and block.payload.ndim == 1
    data = block.to_bytes()
    header = verify_block(data)
    assert header.payload_len == header.raw_len == LAYOUT.chunk_nbytes
    assert bytes(stored_block(data).payload) == chunk.tobytes()


def test_encode_does_not_copy_the_payload() -> None:
    backing = bytearray(payload_bytes())
    block = encode_block(NS, KEYS[1], KEYS[0], memoryview(backing))
    assert block.payload.obj is backing


def test_stored_block_splits_without_losing_identity() -> None:
    block, raw = make_block()
    data = block.to_bytes()
    again = stored_block(data)
    assert again.header == block.header
    assert bytes(again.payload) == raw
    assert again.to_bytes() == data
    assert stored_block(bytearray(data)).to_bytes() == data
    assert stored_block(memoryview(data)).to_bytes() == data


def test_frame_block_reframes_under_the_same_identity() -> None:
    block, raw = make_block()
    header = verify_block(block.to_bytes())
    # Same header and payload: identical bytes.
    assert frame_block(header, memoryview(raw)).to_bytes() == block.to_bytes()
    # A new codec and payload (as when a tier recompresses): identity kept.
    recoded = b"recoded-payload" * 3
    reframed = frame_block(
        dataclasses.replace(header, codec=Codec.ZSTD, payload_len=0), memoryview(recoded)
    )
    new_header = verify_block(reframed.to_bytes())
    check_identity(new_header, NS, KEYS[1])
    assert new_header.codec is Codec.ZSTD
    assert new_header.key == header.key
    assert new_header.parent == header.parent
    assert new_header.namespace_digest == header.namespace_digest
    assert new_header.raw_len == len(raw)
    assert new_header.payload_len == len(recoded)  # taken from the payload, not the header
    assert bytes(stored_block(reframed.to_bytes()).payload) == recoded


def test_header_from_stored_block_reframes_identically() -> None:
    block, _ = make_block(key_index=0)
    again = stored_block(block.to_bytes())
    header = parse_header(again.header)
    assert frame_block(header, again.payload).to_bytes() == block.to_bytes()


# --- corruption --------------------------------------------------------------------------


def _flip(data: bytes, bit: int) -> bytes:
    corrupted = bytearray(data)
    corrupted[bit // 8] ^= 1 << (bit % 8)
    return bytes(corrupted)


def test_every_header_bit_flip_is_detected() -> None:
    data = stored()
    undetected = []
    for bit in range(CHECKSUM_END * 8):
        try:
            verify_block(_flip(data, bit))
        except CorruptBlock:
            continue
        undetected.append(bit)
    assert undetected == []


def test_payload_bit_flips_are_detected() -> None:
    data = stored()
    rng = random.Random(1234)
    payload_bits = (len(data) - HEADER_BYTES) * 8
    bits = {0, 7, payload_bits - 1, payload_bits - 8} | set(rng.sample(range(payload_bits), 60))
    assert len(bits) >= 64
    for bit in sorted(bits):
        with pytest.raises(CorruptBlock, match="checksum"):
            verify_block(_flip(data, HEADER_BYTES * 8 + bit))


def test_multi_byte_payload_corruption_is_detected() -> None:
    data = bytearray(stored())
    data[HEADER_BYTES + 100 : HEADER_BYTES + 164] = bytes(64)
    with pytest.raises(CorruptBlock, match="checksum"):
        verify_block(bytes(data))


def test_payload_check_can_be_skipped_for_trusted_memory() -> None:
    data = stored()
    corrupted = _flip(data, HEADER_BYTES * 8 + 3)
    assert verify_block(corrupted, check_payload=False).key == KEYS[1]
    # Structure is still checked without the payload checksum.
    with pytest.raises(CorruptBlock):
        verify_block(corrupted[:-1], check_payload=False)
    with pytest.raises(CorruptBlock):
        verify_block(b"XXXX" + corrupted[4:], check_payload=False)


# copy_payload checksums step by step: a flip must be caught wherever it falls in a
# step (first byte, last byte, inside) and in whichever step (first, middle, last,
# the last one short), as well as in the header.
STEPPED = 2 * COPY_VERIFY_STEP + 1000
STEP_POSITIONS = [
    0,
    1,
    COPY_VERIFY_STEP // 2,
    COPY_VERIFY_STEP - 1,
    COPY_VERIFY_STEP,
    COPY_VERIFY_STEP + 1,
    2 * COPY_VERIFY_STEP - 1,
    2 * COPY_VERIFY_STEP,
    STEPPED - 1,
]


def test_copy_payload_copies_and_verifies() -> None:
    data = stored(payload_bytes(STEPPED))
    destination = bytearray(STEPPED)
    header = copy_payload(data[:HEADER_BYTES], memoryview(data)[HEADER_BYTES:], destination)
    assert header == verify_block(data) and bytes(destination) == data[HEADER_BYTES:]


@pytest.mark.parametrize("offset", STEP_POSITIONS)
def test_copy_payload_catches_a_flip_anywhere_in_any_step(offset: int) -> None:
    data = _flip(stored(payload_bytes(STEPPED)), (HEADER_BYTES + offset) * 8 + 5)
    with pytest.raises(CorruptBlock, match="checksum"):
        copy_payload(data[:HEADER_BYTES], data[HEADER_BYTES:], bytearray(STEPPED))


@pytest.mark.parametrize("offset", [8, 56, 80, 95])  # digest, layout, raw_len, checksum
def test_copy_payload_catches_a_flip_in_the_header(offset: int) -> None:
    data = _flip(stored(payload_bytes(STEPPED)), offset * 8)
    with pytest.raises(CorruptBlock):
        copy_payload(data[:HEADER_BYTES], data[HEADER_BYTES:], bytearray(STEPPED))


def test_copy_payload_checks_the_copy_not_the_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy that differs from its intact source (shared memory written while it was
    copied) fails: what is checksummed is what landed in the destination."""
    data = stored(payload_bytes(STEPPED))
    copyto = np.copyto

    def torn(destination: np.ndarray, source: np.ndarray) -> None:
        copyto(destination, source)
        destination[-1] ^= 1

    monkeypatch.setattr(np, "copyto", torn)
    with pytest.raises(CorruptBlock, match="checksum"):
        copy_payload(data[:HEADER_BYTES], data[HEADER_BYTES:], bytearray(STEPPED))


@pytest.mark.parametrize("cut", [1, 777, COPY_VERIFY_STEP - 1, COPY_VERIFY_STEP + 3, STEPPED])
def test_fill_verified_takes_reads_of_any_size(cut: int) -> None:
    data = stored(payload_bytes(STEPPED if cut > 1 else 3000))
    destination = bytearray(len(data) - HEADER_BYTES)
    reads = kv.socket_reads(data[HEADER_BYTES:], cut)
    header = fill_verified(data[:HEADER_BYTES], destination, reads)
    assert header == verify_block(data) and bytes(destination) == data[HEADER_BYTES:]


@pytest.mark.parametrize("offset", STEP_POSITIONS)
def test_fill_verified_catches_a_flip_in_any_step(offset: int) -> None:
    data = _flip(stored(payload_bytes(STEPPED)), (HEADER_BYTES + offset) * 8 + 5)
    with pytest.raises(CorruptBlock, match="checksum"):
        fill_verified(
            data[:HEADER_BYTES], bytearray(STEPPED), kv.socket_reads(data[HEADER_BYTES:], 100_000)
        )


def test_fill_verified_refuses_a_destination_of_another_size() -> None:
    data = stored(payload_bytes(STEPPED))
    with pytest.raises(CorruptBlock, match="payload is"):
        fill_verified(data[:HEADER_BYTES], bytearray(STEPPED - 1), kv.socket_reads(data, 100_000))


def unsealed(payload: bytes) -> bytes:
    return encode_block(NS, KEYS[1], KEYS[0], memoryview(payload), sealed=False).to_bytes()


def test_an_unsealed_block_has_a_zero_checksum_and_fails_verification() -> None:
    raw = payload_bytes()
    data = unsealed(raw)
    assert data[CHECKSUM_END - 8 : CHECKSUM_END] == bytes(8)
    assert data[: CHECKSUM_END - 8] == stored(raw)[: CHECKSUM_END - 8]  # the same identity
    with pytest.raises(CorruptBlock, match="checksum"):
        verify_block(data)


@pytest.mark.parametrize("cut", [1, 777, COPY_VERIFY_STEP + 3, STEPPED])
def test_fill_sealed_returns_the_header_a_sealed_block_would_carry(cut: int) -> None:
    raw = payload_bytes(STEPPED if cut > 1 else 3000)
    data = unsealed(raw)
    destination = bytearray(len(raw))
    header, sealed_header = fill_sealed(
        data[:HEADER_BYTES], destination, kv.socket_reads(data[HEADER_BYTES:], cut)
    )
    assert sealed_header == stored(raw)[:HEADER_BYTES]
    assert bytes(destination) == raw and header == verify_block(sealed_header + raw)


def test_fill_sealed_seals_what_landed_not_what_was_sent() -> None:
    """A checksum is of the bytes in the destination: a step changed after it was
    read would be sealed as changed, so only a reader's checksum can catch rot later."""
    raw = payload_bytes(STEPPED)
    data = unsealed(raw)
    destination = bytearray(STEPPED)
    reads = kv.socket_reads(_flip(data, (HEADER_BYTES + 10) * 8)[HEADER_BYTES:], 100_000)
    _, sealed_header = fill_sealed(data[:HEADER_BYTES], destination, reads)
    assert sealed_header != stored(raw)[:HEADER_BYTES]
    verify_block(sealed_header + bytes(destination))


def test_fill_sealed_refuses_a_destination_of_another_size() -> None:
    data = unsealed(payload_bytes(STEPPED))
    with pytest.raises(CorruptBlock, match="payload is"):
        fill_sealed(data[:HEADER_BYTES], bytearray(STEPPED + 1), kv.socket_reads(data, 100_000))


def test_a_trailer_is_the_checksum_a_header_would_carry() -> None:
    """Hashed slice by slice after an unsealed header, a payload's trailer is the
    sealed header's checksum, and ``check_trailer`` compares exactly that."""
    raw = payload_bytes(STEPPED)
    header = unsealed(raw)[:HEADER_BYTES]
    hasher = payload_hasher(header)
    for start in range(0, len(raw), 100_000):
        hasher.update(raw[start : start + 100_000])
    trailer = checksum_trailer(hasher)
    sealed = stored(raw)[:HEADER_BYTES]
    assert len(trailer) == TRAILER_BYTES and trailer == sealed[CHECKSUM_END - 8 : CHECKSUM_END]
    check_trailer(sealed, trailer, KEYS[1])
    for bit in range(TRAILER_BYTES * 8):
        with pytest.raises(CorruptBlock, match="checksum"):
            check_trailer(sealed, _flip(trailer, bit), KEYS[1])


def test_seal_block_writes_the_checksum_in_place() -> None:
    raw = payload_bytes()
    data = bytearray(unsealed(raw))
    seal_block(memoryview(data))
    assert bytes(data) == stored(raw)


@pytest.mark.parametrize("extra", [-1, 1])
def test_seal_block_refuses_a_block_of_another_length(extra: int) -> None:
    data = unsealed(payload_bytes())
    data = data[:extra] if extra < 0 else data + bytes(extra)
    with pytest.raises(CorruptBlock, match="header says"):
        seal_block(memoryview(bytearray(data)))


@pytest.mark.parametrize("size", [STEPPED - 1, STEPPED + 1])
def test_copy_payload_refuses_buffers_of_another_size(size: int) -> None:
    data = stored(payload_bytes(STEPPED))
    with pytest.raises(CorruptBlock, match="payload is"):
        copy_payload(data[:HEADER_BYTES], data[HEADER_BYTES:][:size], bytearray(size))


@pytest.mark.parametrize("length", [0, 1, 4, 95, 127, 128, 129, 1000, -1])
def test_truncation_is_detected(length: int) -> None:
    data = stored()
    cut = data[:length]
    assert len(cut) < len(data)
    with pytest.raises(CorruptBlock):
        verify_block(cut)


@pytest.mark.parametrize("extra", [b"\x00", b"\x00" * 7, b"trailing garbage" * 10])
def test_trailing_bytes_are_detected(extra: bytes) -> None:
    with pytest.raises(CorruptBlock, match="bytes"):
        verify_block(stored() + extra)


def test_payload_len_edited_with_matching_length_still_fails_checksum() -> None:
    data = bytearray(stored())
    struct.pack_into("<Q", data, 80, len(data) - HEADER_BYTES - 8)
    with pytest.raises(CorruptBlock, match="checksum"):
        verify_block(bytes(data[:-8]))


def test_wrong_key_is_refused() -> None:
    header = verify_block(stored())
    with pytest.raises(CorruptBlock, match="carries key"):
        check_identity(header, NS, KEYS[2])


def test_wrong_namespace_is_refused() -> None:
    header = verify_block(stored())
    for other in (
        Namespace("test-model", LAYOUT, tenant_salt="other-tenant"),
        Namespace("test-model", LAYOUT),
        Namespace("other-model", LAYOUT, tenant_salt="tenant"),
    ):
        with pytest.raises(CorruptBlock, match="another namespace"):
            check_identity(header, other, KEYS[1])


@pytest.mark.parametrize(
    "change",
    [
        {"dtype": "bfloat16"},
        {"num_layers": 3},
        {"num_kv_heads": 1},
        {"head_dim": 16},
        {"chunk_tokens": 32},
    ],
)
def test_wrong_layout_is_a_layout_mismatch(change: dict[str, object]) -> None:
    # A header whose namespace digest matches but whose layout fields do not
    # (a writer that got its header wrong) is refused as a layout mismatch.
    other_layout = dataclasses.replace(LAYOUT, **change)  # type: ignore[arg-type]
    header = dataclasses.replace(
        verify_block(stored()),
        dtype=other_layout.dtype,
        num_layers=other_layout.num_layers,
        num_kv_heads=other_layout.num_kv_heads,
        head_dim=other_layout.head_dim,
        chunk_tokens=other_layout.chunk_tokens,
    )
    data = frame_block(header, memoryview(payload_bytes())).to_bytes()
    reread = verify_block(data)
    assert not reread.matches(LAYOUT)
    assert reread.matches(other_layout)
    with pytest.raises(LayoutMismatch):
        check_identity(reread, NS, KEYS[1])


def _with_byte(data: bytes, offset: int, value: int, *, fix_checksum: bool = True) -> bytes:
    """``data`` with one header byte replaced, the checksum recomputed to match."""
    edited = bytearray(data)
    edited[offset] = value
    if fix_checksum:
        checksum = xxhash.xxh3_64(bytes(edited[:88]) + bytes(edited[HEADER_BYTES:])).intdigest()
        struct.pack_into("<Q", edited, 88, checksum)
    return bytes(edited)


@pytest.mark.parametrize("code", [3, 7, 255])
def test_unknown_codec_is_rejected(code: int) -> None:
    data = _with_byte(stored(), 6, code)
    with pytest.raises(CorruptBlock, match="unknown codec"):
        parse_header(data)
    with pytest.raises(CorruptBlock, match="unknown codec"):
        verify_block(data)


@pytest.mark.parametrize("code", [0, 8, 255])
def test_unknown_dtype_code_is_rejected(code: int) -> None:
    data = _with_byte(stored(), 7, code)
    with pytest.raises(CorruptBlock, match="unknown dtype"):
        parse_header(data)
    with pytest.raises(CorruptBlock, match="unknown dtype"):
        verify_block(data)


def test_bad_magic_and_version_are_rejected_even_with_a_valid_checksum() -> None:
    with pytest.raises(CorruptBlock, match="magic"):
        verify_block(_with_byte(stored(), 0, ord("X")))
    with pytest.raises(CorruptBlock, match="version"):
        verify_block(_with_byte(stored(), 4, 2))


@pytest.mark.parametrize("length", [0, 1, 96, 127])
def test_parse_header_rejects_short_input(length: int) -> None:
    with pytest.raises(CorruptBlock, match="shorter than its header"):
        parse_header(stored()[:length])


def test_parse_header_does_not_check_the_payload() -> None:
    data = _flip(stored(), HEADER_BYTES * 8 + 10)
    assert parse_header(data).key == KEYS[1]
    assert parse_header(data[:HEADER_BYTES]).payload_len == LAYOUT.chunk_nbytes
