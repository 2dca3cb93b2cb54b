"""Shared fixtures. Real backends only: LMDB in a temp dir, redis-server processes
started on free loopback ports (see ``support/redis_servers.py``)."""

from __future__ import annotations
