"""Fixtures the placement tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support import kv
from support.sessions import Sessions

from kvstore.predictor.placement.policy import PlacementConfig, PlacementPolicy
from kvstore.store.tiered_store import TieredStore


@pytest.fixture
def three_tiers(tmp_path: Path) -> Iterator[Sessions]:
    """HBM and DRAM of 8 chunks over LMDB, with a ``PlacementPolicy`` that looks every 10 s."""
    policy = PlacementPolicy(PlacementConfig(check_min_s=10.0, check_fraction=0.0))
    config = kv.config(kv.hbm(8), kv.dram(8), kv.ssd(tmp_path / "lmdb"))
    with TieredStore(config, policy=policy) as store:
        yield Sessions(store, policy)
