"""Shared fixtures. Real backends only: LMDB in a temp dir, redis-server processes
started on free loopback ports (see ``support/redis_servers.py``), ``kvstore serve``
daemons as subprocesses (see ``support/daemon.py``), hosts as network namespaces
(see ``support/netns.py``)."""

from __future__ import annotations

from support.daemon import (  # noqa: F401  (fixtures, registered by import)
    _shared_daemon,
    daemon,
    daemon_factory,
)
from support.http_kv import client, ns  # noqa: F401  (fixtures of the route tests)
from support.kv import two_level  # noqa: F401  (a DRAM + LMDB store)
from support.netns import netns_network  # noqa: F401  (a fixture, registered by import)
from support.redis_servers import (  # noqa: F401  (fixtures, registered by import)
    _secure_cluster,
    clean_redis,
    clean_redis_cluster,
    redis_cluster,
    redis_server,
    redis_server_factory,
    secure_redis_cluster,
    tls_files,
)
from support.redis_tiers import make_tier  # noqa: F401  (a fixture, registered by import)
