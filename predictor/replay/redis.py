"""A private ``redis-server`` for a replay with a Redis tier (``--redis-gb``).

Never the shared ``127.0.0.1:6379``: the replay starts its own server on a free
loopback port, without persistence, and stops it when the replay ends. Each
policy's run uses its own key prefix, so runs never see each other's blocks.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator

import redis

from kvstore.errors import ConfigError

_HOST = "127.0.0.1"
_START_ATTEMPTS = 100  # pings, 50 ms apart


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    """Start a throwaway ``redis-server``; yields its URL and stops it on exit."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ConfigError("--redis-gb needs redis-server on PATH")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="kvstore-replay-redis-") as directory:
        process = subprocess.Popen(
            [
                binary,
                "--bind", _HOST,
                "--port", str(port),
                "--save", "",
                "--appendonly", "no",
                "--dir", directory,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            url = f"redis://{_HOST}:{port}/0"
            _wait_ready(url, process)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_ready(url: str, process: subprocess.Popen[bytes]) -> None:
    client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
    try:
        for _ in range(_START_ATTEMPTS):
            if process.poll() is not None:
                raise ConfigError(f"redis-server exited with status {process.returncode}")
            try:
                if client.ping():
                    return
            except redis.RedisError:
                pass
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=0.05)
        raise ConfigError("redis-server did not answer within 5 s")
    finally:
        client.close()
