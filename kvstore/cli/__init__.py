"""``kvstore`` command line: run the daemon, or ask a running one how it is doing.

::

    kvstore serve [--config FILE]
    kvstore stats [--url unix:///path/kvstore.sock | http://host:port] [--token TOKEN]
                  [--config FILE] [--json]
    kvstore replay TRACE --hbm-gb X --dram-gb Y --ssd-gb Z [--policy ...] [--json] [--plot DIR]
    kvstore train-predictor TRACE... --out FILE [--format mooncake|tracelab]

``stats`` finds the daemon's socket from the same config ``serve`` reads
unless ``--url`` says otherwise; ``--token`` (or ``KVSTORE_AUTH_TOKEN``) is
only needed over TCP. It prints the predictor's quality per horizon beside
its two baselines. ``train-predictor`` writes a model a daemon starts from
(``[predictor] weights = FILE``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from kvstore.config import TOKEN_VARIABLE
from kvstore.errors import ConfigError, KVStoreError
from kvstore.predictor.replay import commands as replay_commands
from kvstore.server.config import ServiceConfig


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the daemon")
    serve.add_argument("--config", help="TOML file (default: $KVSTORE_CONFIG, else built in)")
    stats = commands.add_parser("stats", help="print a running daemon's statistics")
    stats.add_argument("--url", help="unix:///path/to/kvstore.sock or http://host:port")
    stats.add_argument("--token", help=f"bearer token for TCP (default: ${TOKEN_VARIABLE})")
    stats.add_argument("--config", help="find the socket from this config file")
    stats.add_argument("--json", action="store_true", help="print the raw JSON")
    stats.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    replay_commands.add_commands(commands)
    args = parser.parse_args(argv)
    if args.command in replay_commands.COMMANDS:
        return replay_commands.run(args)
    if args.command == "serve":
        return _serve(args.config)
    return _stats(args)


def _serve(config_path: str | None) -> int:
    from kvstore.errors import StartupError
    from kvstore.server.run import Server, configure_logging

    try:
        config = ServiceConfig.load(config_path)
    except ConfigError as error:
        print(f"kvstore serve: {error}", file=sys.stderr)
        return 2
    configure_logging(config.daemon)
    try:
        return Server(config).run()
    except StartupError as error:
        print(f"kvstore serve: {error}", file=sys.stderr)
        return 1
    except KVStoreError as error:  # the store could not open (a tier, a path)
        print(f"kvstore serve: cannot open the store: {error}", file=sys.stderr)
        return 1


def _stats(args: argparse.Namespace) -> int:
    # Here, not at the top: ``serve`` would spend tens of milliseconds importing httpx.
    import httpx

    from kvstore.cli.daemon_stats import fetch_stats, format_stats

    url = args.url
    if url is None:
        try:
            url = f"unix://{ServiceConfig.load(args.config).daemon.socket_path}"
        except ConfigError as error:
            print(f"kvstore stats: {error}", file=sys.stderr)
            return 2
    token = args.token or os.environ.get(TOKEN_VARIABLE)
    try:
        data = fetch_stats(url, token=token, timeout_s=args.timeout)
    except (httpx.HTTPError, KVStoreError) as error:
        print(f"kvstore stats: {url}: {error}", file=sys.stderr)
        return 1
    print(json.dumps(data, indent=2) if args.json else format_stats(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
