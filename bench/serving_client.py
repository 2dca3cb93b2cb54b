"""Drive a workload through vLLM's OpenAI server, and the figures of one run.

Every request is a streamed ``/v1/completions`` with the prompt as token ids,
``temperature 0``, ``ignore_eos`` and ``return_token_ids``: each streamed chunk
carries the ids it added, so the client sees every token's arrival time and
the exact greedy output. Timestamps are the client's (``time.monotonic``)::

    sent        the request is written
    TTFT        first chunk with a token - sent
    ITL         gap between consecutive chunks, shared equally by the tokens of
                the later chunk (vLLM streams one token per chunk by default)

"ITL while loading" is the stall a decoding user feels while another request
is admitted: an ITL sample of request A counts when its gap overlaps
``[sent, first token]`` of another request B that is a returning turn (B's
context is loaded from a store, or recomputed where there is none).

Counters come from vLLM's Prometheus ``/metrics``, read before and after the
workload (so the warm-up request is not counted): the external hit rate is
``external_prefix_cache_hits / external_prefix_cache_queries`` in tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from common import percentile
from serving_workloads import Turn, Workload

MODEL_NAME = "bench"  # --served-model-name
METRICS = (
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
)


@dataclass
class Record:
    """One request as the client saw it; filled in by ``_complete``."""

    session: int
    turn: int
    returning: bool
    prompt_tokens: int
    sent: float = 0.0
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens in chunk)
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int | None = None  # vLLM's usage.prompt_tokens_details (local + external)
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.arrivals[0][0] - self.sent

    def itl_samples(self) -> list[tuple[float, float, float]]:
        """``(gap start, gap end, seconds per token)`` for every token after the first:
        a chunk of ``n`` tokens gives ``n`` samples of its gap divided by ``n``."""
        return [
            (start, end, (end - start) / count)
            for (start, _), (end, count) in zip(self.arrivals, self.arrivals[1:], strict=False)
            for _ in range(count)
        ]


@dataclass(frozen=True)
class RunResult:
    records: tuple[Record, ...]
    wall_s: float
    counters: Mapping[str, float]  # METRICS, after minus before


async def run_workload(
    base_url: str, workload: Workload, request_timeout_s: float, run_timeout_s: float
) -> RunResult:
    """Every session of ``workload`` as a closed loop, ``in_flight`` requests at most."""
    timeout = httpx.Timeout(request_timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=workload.in_flight + 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as http:
        before = await read_counters(http)
        gate = asyncio.Semaphore(workload.in_flight)
        records: list[Record] = []
        start = time.monotonic()
        async with asyncio.timeout(run_timeout_s):
            await asyncio.gather(
                *(
                    _session(http, gate, index, turns, records)
                    for index, turns in enumerate(workload.sessions)
                )
            )
        wall = time.monotonic() - start
        after = await read_counters(http)
    counters = {name: after[name] - before[name] for name in METRICS}
    return RunResult(tuple(records), wall, counters)


async def _session(
    http: httpx.AsyncClient,
    gate: asyncio.Semaphore,
    session: int,
    turns: Sequence[Turn],
    records: list[Record],
) -> None:
    prompt: list[int] = []
    output: list[int] = []
    for index, turn in enumerate(turns):
        await asyncio.sleep(turn.think_s)
        prompt = [*prompt, *output, *turn.tokens] if turn.extends else list(turn.tokens)
        record = Record(session, index, turn.returning, len(prompt))
        async with gate:
            await _complete(http, prompt, turn.max_tokens, record)
        records.append(record)
        if record.error is not None:
            return  # the rest of the session would not be the same conversation
        output = record.output_ids


async def _complete(
    http: httpx.AsyncClient, prompt: list[int], max_tokens: int, record: Record
) -> None:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    record.sent = time.monotonic()
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:300]}"
                return
            async for line in response.aiter_lines():
                _read_event(line, record, time.monotonic())
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return
    if len(record.output_ids) != max_tokens:
        record.error = f"{len(record.output_ids)} of {max_tokens} output tokens"


def _read_event(line: str, record: Record, now: float) -> None:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return
    event = json.loads(line[len("data: ") :])
    for choice in event.get("choices") or ():
        ids = choice.get("token_ids") or []
        if ids:
            record.arrivals.append((now, len(ids)))
            record.output_ids.extend(int(t) for t in ids)
    usage = event.get("usage")
    if usage:
        details = usage.get("prompt_tokens_details") or {}
        record.cached_tokens = details.get("cached_tokens")


async def read_counters(http: httpx.AsyncClient) -> dict[str, float]:
    """The ``METRICS`` counters, summed over their label sets."""
    response = await http.get("/metrics")
    response.raise_for_status()
    totals = dict.fromkeys(METRICS, 0.0)
    for line in response.text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


async def warm_up(base_url: str, tokens: list[int], timeout_s: float) -> None:
    """One short request, so that no timed one pays for a first call's setup."""
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s) as http:
        record = Record(-1, 0, False, len(tokens))
        await _complete(http, tokens, 2, record)
    if record.error is not None:
        raise RuntimeError(f"the warm-up request failed: {record.error}")


# -- figures -------------------------------------------------------------------


def run_figures(result: RunResult) -> dict[str, float | int | None]:
    """The figures of one run (seconds, tokens/s, fractions; ``None`` where undefined)."""
    done = [r for r in result.records if r.error is None]
    first = [r.ttft for r in done if not r.returning]
    returning = [r.ttft for r in done if r.returning]
    itl = [gap for r in done for *_, gap in r.itl_samples()]
    loading = loading_itl(done)
    counters = result.counters
    output_tokens = sum(len(r.output_ids) for r in done)
    return {
        "requests": len(result.records),
        "completed": len(done),
        "wall_s": result.wall_s,
        "output_tokens_per_s": output_tokens / result.wall_s,
        "requests_per_s": len(done) / result.wall_s,
        **_quantiles("ttft_first_s", first),
        **_quantiles("ttft_returning_s", returning),
        **_quantiles("itl_s", itl),
        **_quantiles("itl_while_loading_s", loading),
        "itl_while_loading_samples": len(loading),
        "external_hit_rate": _ratio(
            counters["vllm:external_prefix_cache_hits_total"],
            counters["vllm:external_prefix_cache_queries_total"],
        ),
        "local_hit_rate": _ratio(
            counters["vllm:prefix_cache_hits_total"], counters["vllm:prefix_cache_queries_total"]
        ),
    }


def per_request(records: Sequence[Record]) -> list[dict[str, Any]]:
    """Each request in the order it finished, for reading a tail: which session and
    turn it was, how much of its prompt vLLM found cached, and its TTFT."""
    start = min((r.sent for r in records), default=0.0)
    return [
        {
            "session": r.session,
            "turn": r.turn,
            "returning": r.returning,
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "sent_s": r.sent - start,
            "ttft_s": r.ttft if r.error is None else None,
        }
        for r in records
    ]


def loading_itl(records: Sequence[Record]) -> list[float]:
    """ITL samples of each request whose gap overlaps another returning request's
    ``[sent, first token]`` window (see the module docstring)."""
    windows = [(r.sent, r.arrivals[0][0], r) for r in records if r.returning]
    samples = []
    for record in records:
        for start, end, per_token in record.itl_samples():
            if any(
                b is not record and start < until and end > since for since, until, b in windows
            ):
                samples.append(per_token)
    return samples


def identical_fraction(records: Sequence[Record], reference: Sequence[Record]) -> float | None:
    """The fraction of ``reference``'s requests that this run answered with the same ids."""
    mine = {(r.session, r.turn): r.output_ids for r in records if r.error is None}
    theirs = [r for r in reference if r.error is None]
    if not theirs:
        return None
    return sum(mine.get((r.session, r.turn)) == r.output_ids for r in theirs) / len(theirs)


def _quantiles(name: str, values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {f"{name}_p50": None, f"{name}_p99": None}
    return {f"{name}_p50": percentile(values, 0.5), f"{name}_p99": percentile(values, 0.99)}


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None
