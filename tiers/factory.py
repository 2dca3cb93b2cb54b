"""Build a tier from its configuration; the only place that knows every tier class."""

from __future__ import annotations

from kvstore.config import TierConfig
from kvstore.errors import ConfigError
from kvstore.tiers.base import Tier, TierKind


def open_tier(config: TierConfig) -> Tier:
    """Open the backend ``config`` describes (imports each backend only when used)."""
    if config.kind is TierKind.HBM:
        from kvstore.tiers.hbm import HBMTier

        return HBMTier(config.capacity_bytes, device=config.device)
    if config.kind is TierKind.DRAM:
        from kvstore.tiers.dram import DRAMTier

        return DRAMTier(config.capacity_bytes, prefault=config.prefault)
    if config.kind is TierKind.SSD:
        from kvstore.tiers.lmdb_tier import LMDBTier

        if config.path is None:
            raise ConfigError("the ssd tier needs a path")
        return LMDBTier(
            config.path,
            config.capacity_bytes,
            map_size=config.map_size_bytes,
            sync=config.sync,
        )
    from kvstore.tiers.redis_tier import RedisTier

    target = list(config.nodes) if config.cluster else config.url
    if not target:
        raise ConfigError("the redis tier needs a url (or nodes with cluster = true)")
    return RedisTier(
        target,
        config.capacity_bytes,
        cluster=config.cluster,
        key_prefix=config.key_prefix,
        ttl_s=config.ttl_s,
        socket_timeout_s=config.socket_timeout_s,
        connect_timeout_s=config.connect_timeout_s,
    )
