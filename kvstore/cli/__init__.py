"""The ``kvstore`` command: run the daemon, ask a running one, replay traces.

::

    kvstore serve [--config FILE]
    kvstore stats | ready | namespaces [--json]
    kvstore sessions [ID] [--limit N] [--json]
    kvstore evict --namespace DIGEST [--tier T]      kvstore delete --namespace DIGEST
    kvstore replay TRACE... --hbm-gb X --dram-gb Y --ssd-gb Z [--policy ...] [--json]
    kvstore train-predictor TRACE... --out FILE
    kvstore --version

The daemon commands (``admin.py``) find the daemon's socket from the config
``serve`` reads unless ``--url`` says otherwise (``daemon_client.py``: one JSON
request over its socket); ``--token`` (or ``KVSTORE_AUTH_TOKEN``) is only needed
over TCP. ``daemon_stats.py`` draws ``kvstore stats``' answer, and ``tables.py``
the plain-text tables and units every answer uses.

Only the chosen command's module is imported, and only it builds its options:
``kvstore --help`` and the daemon commands load neither torch, nor aiohttp, nor
the store. A failure is one line on stderr and a non-zero exit, never a
traceback; output cut short by a closed pipe (``kvstore namespaces | head``) ends
quietly.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from kvstore.cli.admin import DAEMON_COMMANDS
from kvstore.cli.daemon_client import CommandFailed

_REPLAY_COMMANDS = {
    "replay": "replay traces through the real store under several placement policies",
    "train-predictor": "train the return-time model offline from traces",
}
_HELP = {"serve": "run the daemon", **DAEMON_COMMANDS, **_REPLAY_COMMANDS}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    parser = _parser(chosen)
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except CommandFailed as failure:
        print(f"kvstore {args.command}: {failure}", file=sys.stderr)
        return failure.exit_code
    except BrokenPipeError:
        # The reader went away (``| head``): nothing to say, and nobody to say it to.
        # Python would still complain flushing stdout at exit, so point it at /dev/null.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _parser(chosen: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstore",
        description="A hierarchical KV-cache store for LLM inference: the daemon, "
        "the commands that ask it, and the replay of traces.",
    )
    parser.add_argument("--version", action="version", version=f"kvstore {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    if chosen in _REPLAY_COMMANDS:
        from kvstore.predictor.replay import commands as replay_commands

        replay_commands.add_commands(commands)
    for name, help_text in _HELP.items():
        if chosen in _REPLAY_COMMANDS and name in _REPLAY_COMMANDS:
            continue
        command = commands.add_parser(name, help=help_text, description=help_text)
        if name != chosen:
            continue
        if name == "serve":
            command.add_argument(
                "--config", help="TOML file (default: $KVSTORE_CONFIG, else built in)"
            )
        elif name in DAEMON_COMMANDS:
            from kvstore.cli import admin

            admin.add_arguments(name, command)
    return parser


def _run(args: argparse.Namespace) -> int:
    if args.command in _REPLAY_COMMANDS:
        from kvstore.predictor.replay import commands as replay_commands

        return replay_commands.run(args)
    if args.command == "serve":
        return _serve(args.config)
    from kvstore.cli import admin

    return admin.run(args)


def _serve(config_path: str | None) -> int:
    from kvstore.errors import ConfigError, KVStoreError, StartupError
    from kvstore.server.config import ServiceConfig
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


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvstore")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
