"""What kvstore starts on this machine for itself: the replay's, the benchmarks' and the
tests' private servers. Nothing a deployment's tiers or daemon import.

::

    processes.py     child processes that die with their parent, and free loopback ports
    redis_server.py  private redis-server processes on free ports (``RedisServer``)
    redis_cluster.py a private Redis Cluster of them: fail-over, slot migration

May import: the format (``kvstore.errors``) and nothing above it; the tiers, the
store, the wire, the server and the client never import it (a test,
``tests/layout/test_imports.py``, keeps it so).
"""
