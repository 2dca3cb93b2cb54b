"""Payload codecs: bit-exact round trips, spec parsing, and corrupt input."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import zstandard

from kvstore.block import Codec
from kvstore.codec import CodecSpec, decode_payload, encode_payload
from kvstore.errors import ConfigError, CorruptBlock, LayoutMismatch

DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "int8": torch.int8,
}
CODECS = [(Codec.NONE, 1), (Codec.ZSTD, 1), (Codec.ZSTD, 3), (Codec.ZSTD_BYTEPLANE, 1)]


def kv_bytes(dtype: str, numel: int, seed: int = 0) -> memoryview:
    """KV-like values of ``dtype`` as raw bytes, including a NaN, infs and -0.0."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == "int8":
        tensor = torch.randint(-128, 128, (numel,), generator=gen, dtype=torch.int8)
    else:
        values = torch.randn(numel, generator=gen) * 2.0
        special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
        values[: min(numel, 4)] = special[: min(numel, 4)]
        tensor = values.to(DTYPES[dtype])
    return tensor.view(torch.uint8).numpy().data


def round_trip(raw: memoryview, dtype: str, codec: Codec, level: int) -> bytes:
    stored = encode_payload(raw, dtype, codec, level)
    return bytes(decode_payload(stored, dtype, codec, raw.nbytes))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize(("codec", "level"), CODECS)
@pytest.mark.parametrize("numel", [0, 1, 7, 4097])
def test_round_trip_is_bit_exact(dtype: str, codec: Codec, level: int, numel: int) -> None:
    raw = kv_bytes(dtype, numel)
    assert round_trip(raw, dtype, codec, level) == raw.tobytes()


def test_round_trip_of_shaped_and_typed_views() -> None:
    chunk = (torch.randn(2, 2, 16, 4, 8) * 0.1).to(torch.float16).numpy()
    raw = chunk.data  # format "e", five dimensions
    for codec in Codec:
        assert round_trip(raw, "float16", codec, 1) == chunk.tobytes()


def test_none_passes_the_buffer_through() -> None:
    backing = bytearray(b"\x01\x02\x03\x04")
    stored = encode_payload(memoryview(backing), "float16", Codec.NONE)
    decoded = decode_payload(stored, "float16", Codec.NONE, 4)
    backing[0] = 9
    assert bytes(stored)[0] == 9 and bytes(decoded)[0] == 9


def test_byteplane_layout_is_plane_major() -> None:
    values = np.array([0x0102, 0x0304, 0x0506], dtype="<u2")
    stored = encode_payload(values.data, "bfloat16", Codec.ZSTD_BYTEPLANE)
    assert zstandard.ZstdDecompressor().decompress(stored) == bytes([2, 4, 6, 1, 3, 5])


def test_byteplane_beats_plain_zstd_on_bf16_activations() -> None:
    activations = torch.randn(64, 256, 128, generator=torch.Generator().manual_seed(1)) * 0.3
    raw = activations.to(torch.bfloat16).view(torch.uint8).numpy().data
    plain = len(encode_payload(raw, "bfloat16", Codec.ZSTD))
    planes = len(encode_payload(raw, "bfloat16", Codec.ZSTD_BYTEPLANE))
    assert planes < plain < raw.nbytes
    assert raw.nbytes / planes > 1.3


def test_incompressible_payload_grows_by_little() -> None:
    raw = np.random.default_rng(2).integers(0, 256, 1 << 20, dtype=np.uint8).data
    for codec in (Codec.ZSTD, Codec.ZSTD_BYTEPLANE):
        assert len(encode_payload(raw, "bfloat16", codec)) < raw.nbytes + 64


def test_odd_byte_count_for_a_wide_dtype_is_refused() -> None:
    with pytest.raises(LayoutMismatch):
        encode_payload(memoryview(b"\x00" * 3), "float16", Codec.ZSTD_BYTEPLANE)
    with pytest.raises(LayoutMismatch):
        encode_payload(memoryview(b"\x00" * 4), "float42", Codec.ZSTD)


def test_non_contiguous_input_is_refused() -> None:
    strided = np.arange(16, dtype=np.uint16)[::2]
    with pytest.raises(LayoutMismatch):
        encode_payload(strided.data, "float16", Codec.ZSTD)


# -- corrupt or mislabelled payloads --------------------------------------------------


@pytest.mark.parametrize("codec", [Codec.ZSTD, Codec.ZSTD_BYTEPLANE])
@pytest.mark.parametrize("delta", [-2, 2])
def test_wrong_raw_len_raises(codec: Codec, delta: int) -> None:
    raw = kv_bytes("bfloat16", 1000)
    stored = encode_payload(raw, "bfloat16", codec)
    with pytest.raises(CorruptBlock):
        decode_payload(stored, "bfloat16", codec, raw.nbytes + delta)


def test_wrong_raw_len_raises_for_none() -> None:
    with pytest.raises(CorruptBlock):
        decode_payload(b"\x00" * 8, "float16", Codec.NONE, 6)


def test_byteplane_raw_len_not_whole_elements_raises() -> None:
    stored = encode_payload(memoryview(b"\x00" * 5), "int8", Codec.ZSTD)
    with pytest.raises(CorruptBlock):
        decode_payload(stored, "float32", Codec.ZSTD_BYTEPLANE, 5)


@pytest.mark.parametrize("codec", [Codec.ZSTD, Codec.ZSTD_BYTEPLANE])
def test_corrupted_frames_raise(codec: Codec) -> None:
    raw = kv_bytes("bfloat16", 50_000)
    stored = bytes(encode_payload(raw, "bfloat16", codec))
    truncated = stored[: len(stored) // 2]
    trailing = stored + b"\x00"
    garbage = bytes(range(256)) * 4
    flipped = bytearray(stored)
    flipped[len(flipped) // 2] ^= 0xFF
    flipped[len(flipped) // 3] ^= 0x55
    for bad in (truncated, trailing, garbage, b""):
        with pytest.raises(CorruptBlock):
            decode_payload(bad, "bfloat16", codec, raw.nbytes)
    # A flipped bit inside a block either fails to decode or decodes to other
    # bytes of the right size; the block checksum, not the codec, catches the
    # latter. What must never happen is a wrong-size result.
    try:
        decoded = decode_payload(bytes(flipped), "bfloat16", codec, raw.nbytes)
    except CorruptBlock:
        return
    assert decoded.nbytes == raw.nbytes


def test_frame_without_content_size_is_refused() -> None:
    raw = kv_bytes("float16", 100)
    stored = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    with pytest.raises(CorruptBlock):
        decode_payload(stored, "float16", Codec.ZSTD, raw.nbytes)


# -- threads ---------------------------------------------------------------------------


def test_threads_encode_and_decode_concurrently() -> None:
    payloads = [kv_bytes("bfloat16", 20_000, seed) for seed in range(8)]
    expected = [p.tobytes() for p in payloads]
    failures: list[int] = []

    def work(index: int) -> None:
        for _ in range(5):
            for level in (1, 3):
                got = round_trip(payloads[index], "bfloat16", Codec.ZSTD_BYTEPLANE, level)
                if got != expected[index]:
                    failures.append(index)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(payloads))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


# -- spec strings ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("none", CodecSpec(Codec.NONE)),
        ("zstd", CodecSpec(Codec.ZSTD, 1)),
        ("zstd:3", CodecSpec(Codec.ZSTD, 3)),
        ("zstd-byteplane", CodecSpec(Codec.ZSTD_BYTEPLANE, 1)),
        ("zstd-byteplane:1", CodecSpec(Codec.ZSTD_BYTEPLANE, 1)),
        (" ZSTD-Byteplane : 19 ", CodecSpec(Codec.ZSTD_BYTEPLANE, 19)),
    ],
)
def test_spec_parses(text: str, spec: CodecSpec) -> None:
    assert CodecSpec.parse(text) == spec
    assert CodecSpec.parse(str(spec)) == spec


@pytest.mark.parametrize(
    "text",
    ["", "gzip", "zstd:", "zstd:x", "zstd:0", "zstd:-1", "zstd:23", "none:1", "zstd:1:2", "lz4"],
)
def test_bad_spec_raises_config_error(text: str) -> None:
    with pytest.raises(ConfigError):
        CodecSpec.parse(text)


def test_spec_constructor_checks_too() -> None:
    with pytest.raises(ConfigError):
        CodecSpec(Codec.ZSTD, 0)
    with pytest.raises(ConfigError):
        CodecSpec(Codec.NONE, 5)
    with pytest.raises(ConfigError):
        encode_payload(memoryview(b"\x00\x00"), "float16", Codec.ZSTD, level=99)
    assert str(CodecSpec(Codec.ZSTD_BYTEPLANE, 3)) == "zstd-byteplane:3"
    assert str(CodecSpec(Codec.NONE)) == "none"
