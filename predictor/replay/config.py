"""What a replay depends on besides its workload and its policy: ``ReplayConfig``, the
chunk it keys by, and the shape of its progress reports."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.predictor.learning.model import REHEARSAL, Rehearsal
from kvstore.predictor.placement.policy import PlacementConfig
from kvstore.predictor.replay.costs import LLAMA_8B_KV_BYTES_PER_TOKEN, Sizing
from kvstore.predictor.replay.engine import EngineModel
from kvstore.store.config import CostModel

Progress = Callable[[str, int, int], None]
"""``progress(policy, calls done, calls in all)``."""


@dataclass(frozen=True)
class ReplayConfig:
    """Everything a replay depends on besides the workload and the policy."""

    sizing: Sizing
    kv_bytes_per_token: int = LLAMA_8B_KV_BYTES_PER_TOKEN
    costs: CostModel = field(default_factory=CostModel)
    engine: EngineModel = field(default_factory=EngineModel)
    chunk_blocks: int = 1
    """Trace blocks per chunk (kv-cache-tester's 64-token blocks: 16, a 1024-token chunk)."""
    tick_s: float = 10.0
    max_requests: int | None = None
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    horizons: tuple[float, ...] | None = None
    """The model's horizons; ``None``: those of ``DEFAULT_HORIZONS`` the workload can label."""
    model_path: Path | None = None
    model_hidden: int = 16
    """Hidden units of a fresh model (0: logistic regression)."""
    model_out: Path | None = None
    """Where to save the predictor's model when its replay ends (``kvstore train-predictor``
    on conversations: the model a daemon would have learnt serving them)."""
    seed: int = 0
    redis_url: str | None = None
    rehearsal: Rehearsal | None = REHEARSAL
    """The predictor's rehearsal of recent labels (``model.Rehearsal``); None: off."""
    score_from: float = -math.inf
    """Charge only calls that arrive at or after this time; earlier ones still run (they
    warm the store and the learner)."""


CHUNK_TOKENS = 1024
"""The chunk a replay keys by default where a trace's blocks are smaller (64-token ones:
16 a chunk). Coarser chunks replay faster; each request recomputes up to one chunk
of its prompt's tail whatever the policy, so finer ones measure the cached part
more closely."""


def chunk_blocks_for(block_tokens: int) -> int:
    """Trace blocks per chunk by default: ``CHUNK_TOKENS`` a chunk, at least one block."""
    return max(1, CHUNK_TOKENS // block_tokens)
