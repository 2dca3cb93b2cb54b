"""The in-process fuzz targets: kvstore's frames decoder and block decoders fed
mutated valid bodies and blocks, each call bounded by ``CALL_S``; only kvstore's
own errors (``KVStoreError``) are answers."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from faults import fuzz_inputs as fi
from faults.fuzz_driver import Findings, Target
from faults.fuzz_seeds import block_seed, frames, fuzz_chain, put_parts, put_seed
from kvstore.block import (
    HEADER_BYTES,
    Codec,
    copy_payload,
    fill_sealed,
    fill_verified,
    parse_header,
    seal_block,
    stored_block,
    verify_block,
    verify_parts,
)
from kvstore.block import check_identity as check_block_identity
from kvstore.codec import decode_payload
from kvstore.errors import KVStoreError
from kvstore.keys import ChunkKey, Namespace
from kvstore.wire.frames import (
    META_LENGTH,
    FrameDecoder,
    FrameLimits,
    meta_length,
    parse_meta,
)

CALL_S = 2.0  # an in-process decoder call taking longer hangs
IN_PROCESS_TARGETS = ("frame_decoder", "block_header")

# -- in-process targets ------------------------------------------------------------------


class _Overran(BaseException):
    """Raised by the alarm in a decoder call past ``CALL_S`` (a BaseException, so no
    ``except Exception`` in the code under test swallows it)."""


@contextlib.contextmanager
def _bounded(seconds: float) -> Iterator[None]:
    """Interrupt the block with ``_Overran`` after ``seconds`` (main thread only: the
    alarm is a signal; elsewhere the caller's clock judges)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def overran(signum: int, frame: Any) -> None:
        raise _Overran

    previous = signal.signal(signal.SIGALRM, overran)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _call_checked(
    findings: Findings, target: str, what: str, data: bytes, call: Callable[[], object]
) -> None:
    """Run ``call``: kvstore's own errors are answers; anything else, or a call past
    ``CALL_S``, is recorded."""
    start = time.monotonic()
    try:
        with _bounded(CALL_S):
            call()
    except KVStoreError:
        pass
    except _Overran:
        findings.record("hangs", target, f"{what}: still running after {CALL_S:g} s", data)
        return
    except Exception as error:
        detail = f"{what}: {type(error).__name__}: {error}\n{traceback.format_exc()}"
        findings.record("unexpected_exceptions", target, detail, data)
        return
    if time.monotonic() - start > CALL_S:
        findings.record("hangs", target, f"{what}: took {time.monotonic() - start:.1f} s", data)


@dataclass(frozen=True)
class FrameCase:
    """A frames body to decode, the step it is fed in, the decoder's mode and limits."""

    data: bytes
    step: int
    mode: str  # "copying", "fresh" (one-copy into new buffers), "caller" (into ours)
    limits: FrameLimits


def _decode_frames(case: FrameCase) -> None:
    into: Callable[[int, bytes, int], memoryview | None] | None = None
    if case.mode == "fresh":
        into = lambda index, header, size: None  # noqa: E731
    elif case.mode == "caller":
        into = lambda index, header, size: memoryview(bytearray(size)) if size < 1 << 20 else None  # noqa: E731
    decoder = FrameDecoder(case.limits, into=into)
    view = memoryview(case.data)
    for start in range(0, len(view), case.step):
        decoder.feed(view[start : start + case.step])
    decoder.finish()


def _parse_put_head(case: FrameCase) -> None:
    """What the put route reads of a body before its blocks (``put._receive``)."""
    length = meta_length(case.data[: META_LENGTH.size].ljust(META_LENGTH.size, b"\0"), case.limits)
    parse_meta(case.data[META_LENGTH.size : META_LENGTH.size + length], case.limits)


def _block_calls(
    data: bytes, namespace: Namespace, key: ChunkKey
) -> list[tuple[str, Callable[[], object]]]:
    """Every decoder of a block, on ``data``: each must refuse bad bytes with kvstore's errors."""
    view = memoryview(data)
    head, payload = view[:HEADER_BYTES], view[HEADER_BYTES:]

    def identity() -> None:
        header = parse_header(view)
        check_block_identity(header, namespace, key, whole_chunk=True)
        decode_payload(stored_block(view).payload, header.dtype, header.codec, header.raw_len)

    return [
        ("parse_header", lambda: parse_header(view)),
        ("verify_block", lambda: verify_block(view)),
        ("verify_block(check_payload=False)", lambda: verify_block(view, check_payload=False)),
        ("verify_parts", lambda: verify_parts(bytes(head), payload)),
        ("stored_block", lambda: stored_block(view)),
        ("copy_payload", lambda: copy_payload(head, payload, bytearray(payload.nbytes))),
        ("seal_block", lambda: seal_block(memoryview(bytearray(data)))),
        ("fill_verified", lambda: fill_verified(head, bytearray(payload.nbytes), _reader(payload))),
        ("fill_sealed", lambda: fill_sealed(head, bytearray(payload.nbytes), _reader(payload))),
        ("check_identity + decode_payload", identity),
    ]


def _reader(payload: memoryview) -> Callable[[memoryview], None]:
    """A ``fill`` (``block.fill_verified``) that reads ``payload`` in order, as a socket would."""
    taken = 0

    def fill(step: memoryview) -> None:
        nonlocal taken
        step[:] = payload[taken : taken + step.nbytes]
        taken += step.nbytes

    return fill


def in_process_targets(findings: Findings) -> list[Target]:
    """The frames decoder and the block decoders, fed mutations of the fuzz chain's
    put bodies, a get answer and blocks of every codec."""
    namespace, keys, payloads = fuzz_chain()
    blocks = [block_seed(namespace, keys, payloads[0], codec) for codec in Codec]
    puts = [put_seed(*put_parts(namespace, keys, payloads, seal)) for seal in ("header", "trailer")]
    answer = {
        "blocks": [
            {"key": keys[0].hex(), "length": len(blocks[0].data), "tier": "dram"},
            {"key": keys[1].hex(), "length": None, "tier": None},
        ]
    }
    frame_seeds = [*puts, fi.Seed(frames(answer, blocks[0].data), ((0, 4),))]
    limits = st.sampled_from(
        (FrameLimits(), FrameLimits(max_meta_bytes=64, max_blocks=2, max_block_bytes=200))
    )
    frame_cases = st.builds(
        FrameCase,
        st.one_of(fi.mutated(frame_seeds), fi.mutated(frame_seeds), fi.garbage()),
        st.sampled_from((1, 3, 4, 127, 128, 129, 4096, 1 << 20)),
        st.sampled_from(("copying", "fresh", "caller")),
        limits,
    )

    def check_frames(case: FrameCase) -> None:
        _call_checked(
            findings,
            "frame_decoder",
            f"FrameDecoder({case.mode}, step {case.step})",
            case.data,
            lambda: _decode_frames(case),
        )
        _call_checked(
            findings,
            "frame_decoder",
            "meta_length + parse_meta",
            case.data,
            lambda: _parse_put_head(case),
        )

    def check_block(data: bytes) -> None:
        for what, call in _block_calls(data, namespace, keys[1]):
            _call_checked(findings, "block_header", what, data, call)

    block_inputs = st.one_of(
        fi.mutated(blocks), fi.mutated(blocks), fi.mutated(blocks), fi.garbage()
    )
    return [
        Target("frame_decoder", frame_cases, check_frames, over_http=False),
        Target("block_header", block_inputs, check_block, over_http=False),
    ]
