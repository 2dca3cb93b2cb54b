"""What one policy did over one workload (``PolicyResult``), and each call it served."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvstore.kinds import TierKind
from kvstore.predictor.placement.hooks import PrefetchStats
from kvstore.predictor.replay.engine import RequestCost


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One call as the replay served it (``RequestCost`` with its session and end)."""

    session: str
    cost: RequestCost
    end: float
    hit_tokens: int
    recomputed_tokens: int


@dataclass
class PolicyResult:
    """What one policy did over one workload."""

    name: str
    baseline: bool
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    hit_tokens_by_tier: dict[TierKind, int] = field(default_factory=dict)
    recomputed_tokens: int = 0
    gpu_seconds: float = 0.0
    load_seconds: float = 0.0
    load_seconds_by_turn: dict[str, dict[TierKind, float]] = field(default_factory=dict)
    """``load_seconds`` by who ended the idle time ("human", "tool") and the source tier:
    where the GPU-seconds placement can still save are. A load's waits on the links
    are shared among its tiers as its chunks' own copy times are."""
    link_wait_seconds: float = 0.0
    """The part of ``load_seconds`` spent waiting behind other copies on a tier's link
    (other requests' loads, prefetches and promotions: ``replay.links``)."""
    writeback_seconds: float = 0.0
    queue_seconds: float = 0.0
    admission_wait_seconds: float = 0.0
    """The part of ``queue_seconds`` spent waiting for a batch slot and HBM."""
    ttft_s: list[float] = field(default_factory=list)
    ttft_human_s: list[float] = field(default_factory=list)
    ttft_tool_s: list[float] = field(default_factory=list)
    service_human_s: list[float] = field(default_factory=list)
    """Human turns' time to first token without queueing: write-back + load + prefill,
    what placement decides (TTFT adds the waits, which bursts and admission set)."""
    hbm_byte_seconds_idle: float = 0.0
    prefetches: PrefetchStats = field(default_factory=PrefetchStats)
    prefetch_bytes: dict[str, float] = field(default_factory=dict)
    """Modeled bytes the policy's prefetches and promotions copied, by route
    (``"ssd->dram"``); ``"wasted"``: those of chunks that left unread."""
    demoted_at_idle: int = 0
    overload: dict[str, float] | None = None
    """The placement policy's fallback to LRU (``placement.overload``): how often, how long,
    and the placements and prefetches it held back; None for a baseline."""
    tier_counters: dict[str, dict[str, int]] = field(default_factory=dict)
    bytes_moved: dict[str, dict[str, float]] = field(default_factory=dict)
    quality: dict[str, dict[str, float]] | None = None
    human: dict[str, Any] | None = None
    calibration: list[tuple[float, float, int]] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list, repr=False)
    """Every call charged, in the order admitted."""

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else math.nan

    @property
    def hbm_gb_hours_idle(self) -> float:
        return self.hbm_byte_seconds_idle / 1e9 / 3600.0
