"""Payload codecs: how a tier stores a block's KV bytes.

A codec is chosen per tier and applied to the payload before it is framed
(``kvstore.block.encode_block`` records ``codec``, ``raw_len`` and
``payload_len``), so every block says how to read itself back and tiers with
different codecs can hand blocks to each other::

    Codec.NONE            payload = raw
    Codec.ZSTD            payload = zstd(raw)
    Codec.ZSTD_BYTEPLANE  payload = zstd(plane 0 || plane 1 || ... || plane k-1)

    raw (bfloat16, little endian, k = 2):
        e0.b0 e0.b1 | e1.b0 e1.b1 | e2.b0 e2.b1 | ...
    planes:
        e0.b0 e1.b0 e2.b0 ...   (low byte: 7 mantissa bits + lowest exponent bit)
        e0.b1 e1.b1 e2.b1 ...   (high byte: sign + 7 exponent bits)

Why byte planes: in a 16-bit float the sign and exponent bits of K and V cluster
in a handful of values (a few bits of entropy) while the mantissa bits are
close to random. Interleaved, every other byte is noise, which leaves zstd's
match finder nothing to match and spreads the exponent bytes' skew over
literals that are mostly noise. Split, the exponent plane compresses well and
the mantissa plane is stored near raw, and the two are coded separately. A
4-byte dtype gets 4 planes; a 1-byte dtype has no planes to split and gets
plain zstd. The split and merge are whole-array numpy operations, one per plane.

Every decode checks that the output is exactly ``raw_len`` bytes (the size the
block header recorded) before and after decompressing and raises
``CorruptBlock`` on any zstd error or mismatch: a wrong-size payload would be
read as another token's KV.

The measured ratios and speeds, and the per-tier defaults that follow, are in
``docs/codec.md``; ``bench/codec.py`` reproduces them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import zstandard

from kvstore.block import Codec
from kvstore.errors import ConfigError, CorruptBlock, LayoutMismatch
from kvstore.keys import DTYPE_SIZES

MIN_LEVEL = 1
MAX_LEVEL = zstandard.MAX_COMPRESSION_LEVEL
DEFAULT_LEVEL = 1

_NAMES: dict[str, Codec] = {
    "none": Codec.NONE,
    "zstd": Codec.ZSTD,
    "zstd-byteplane": Codec.ZSTD_BYTEPLANE,
}
_CODEC_NAMES = {codec: name for name, codec in _NAMES.items()}


def _check_level(level: int) -> None:
    if not MIN_LEVEL <= level <= MAX_LEVEL:
        raise ConfigError(f"zstd level must lie in [{MIN_LEVEL}, {MAX_LEVEL}], got {level}")


@dataclass(frozen=True, slots=True)
class CodecSpec:
    """A tier's codec setting, written ``"none"``, ``"zstd:3"``, ``"zstd-byteplane:1"``.

    ``level`` is zstd's (1-22; 1 when omitted). Negative ("fast") zstd levels
    are not offered: on a bf16 exponent plane they give up most of the gain
    (level -1: 1.48x against 2.67x at level 1) for at most 1.5x the speed.
    """

    codec: Codec
    level: int = DEFAULT_LEVEL

    def __post_init__(self) -> None:
        _check_level(self.level)
        if self.codec is Codec.NONE and self.level != DEFAULT_LEVEL:
            raise ConfigError("codec 'none' takes no level")

    @classmethod
    def parse(cls, text: str) -> CodecSpec:
        """Parse a spec string as tier configs write it (case and spaces ignored)."""
        name, sep, level_text = text.strip().lower().partition(":")
        name = name.strip()
        if name not in _NAMES:
            raise ConfigError(f"unknown codec {text!r}; expected one of {sorted(_NAMES)}")
        codec = _NAMES[name]
        if not sep:
            return cls(codec)
        if codec is Codec.NONE:
            raise ConfigError(f"codec 'none' takes no level: {text!r}")
        try:
            level = int(level_text.strip())
        except ValueError:
            raise ConfigError(f"codec level must be an integer: {text!r}") from None
        return cls(codec, level)

    def __str__(self) -> str:
        name = _CODEC_NAMES[self.codec]
        return name if self.codec is Codec.NONE else f"{name}:{self.level}"


class _ThreadCodecs(threading.local):
    """This thread's zstd contexts.

    A ``ZstdCompressor`` or ``ZstdDecompressor`` wraps one zstd context, which
    must not be used by two threads at once (python-zstandard documents its
    objects as not thread safe), yet creating one per call costs an allocation
    of the context's tables (megabytes at higher levels) on every block. Tiers
    encode from worker threads, so each thread keeps its own, one compressor
    per level.
    """

    def __init__(self) -> None:
        self.compressors: dict[int, zstandard.ZstdCompressor] = {}
        self.decompressor = zstandard.ZstdDecompressor()

    def compressor(self, level: int) -> zstandard.ZstdCompressor:
        compressor = self.compressors.get(level)
        if compressor is None:
            _check_level(level)
            compressor = zstandard.ZstdCompressor(level=level, write_content_size=True)
            self.compressors[level] = compressor
        return compressor


_local = _ThreadCodecs()


def _byte_view(data: memoryview | bytes | bytearray) -> memoryview:
    """``data`` as a flat unsigned-byte view (no copy); it must be contiguous."""
    view = memoryview(data)
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.c_contiguous:
        raise LayoutMismatch("payload must be a contiguous buffer")
    return view.cast("B")


def _itemsize(dtype: str) -> int:
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise LayoutMismatch(
            f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_SIZES)}"
        ) from None


def encode_payload(
    raw: memoryview, dtype: str, codec: Codec, level: int = DEFAULT_LEVEL
) -> memoryview | bytes:
    """Encode a chunk's raw KV bytes with ``codec``; ``Codec.NONE`` returns ``raw`` itself.

    The result goes to ``encode_block(..., codec=codec, raw_len=raw.nbytes)``.
    An incompressible payload comes back a few bytes larger than ``raw`` (the
    zstd frame header and block headers), never much larger.
    """
    view = _byte_view(raw)
    if codec is Codec.NONE:
        return view
    itemsize = _itemsize(dtype)
    compressor = _local.compressor(level)
    if codec is Codec.ZSTD or itemsize == 1:
        return compressor.compress(view)
    if view.nbytes % itemsize:
        raise LayoutMismatch(
            f"payload of {view.nbytes} bytes is not a whole number of {dtype} elements"
        )
    elements = np.frombuffer(view, dtype=np.uint8).reshape(-1, itemsize)
    planes = np.empty((itemsize, elements.shape[0]), dtype=np.uint8)
    for byte in range(itemsize):
        planes[byte] = elements[:, byte]
    return compressor.compress(planes.data)


def _decompress(stored: memoryview, raw_len: int) -> bytes:
    """One zstd frame of exactly ``raw_len`` bytes, or ``CorruptBlock``.

    The frame's declared size is checked before decompressing, so a corrupt
    header cannot make zstd allocate an arbitrary amount of memory.
    """
    try:
        declared = zstandard.frame_content_size(stored)
        if declared != raw_len:
            raise CorruptBlock(f"zstd frame declares {declared} bytes, block header {raw_len}")
        out = _local.decompressor.decompress(stored, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CorruptBlock(f"zstd payload does not decompress: {exc}") from None
    if len(out) != raw_len:
        raise CorruptBlock(f"zstd payload decompressed to {len(out)} bytes, expected {raw_len}")
    return out


def decode_payload(
    stored: memoryview | bytes, dtype: str, codec: Codec, raw_len: int
) -> memoryview:
    """Decode a stored payload back to exactly ``raw_len`` raw KV bytes.

    ``Codec.NONE`` returns a view of ``stored`` (no copy). The result may be
    read-only (stored bytes passed through, or zstd's output), so callers copy
    it into their destination rather than writing through it. Raises
    ``CorruptBlock`` if the payload is not exactly ``raw_len`` bytes once decoded.
    """
    view = _byte_view(stored)
    if codec is Codec.NONE:
        if view.nbytes != raw_len:
            raise CorruptBlock(f"raw payload is {view.nbytes} bytes, block header says {raw_len}")
        return view
    itemsize = _itemsize(dtype)
    if codec is Codec.ZSTD or itemsize == 1:
        return memoryview(_decompress(view, raw_len))
    if raw_len % itemsize:
        raise CorruptBlock(f"raw_len {raw_len} is not a whole number of {dtype} elements")
    planes = np.frombuffer(_decompress(view, raw_len), dtype=np.uint8).reshape(itemsize, -1)
    # Shift-and-or into little-endian words: two contiguous passes per plane,
    # about twice as fast as scattering each plane with a strided copy.
    words = planes[itemsize - 1].astype(f"<u{itemsize}")
    for byte in range(itemsize - 2, -1, -1):
        words <<= 8
        words |= planes[byte]
    return words.view(np.uint8).data
