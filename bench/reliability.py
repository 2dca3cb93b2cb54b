#!/usr/bin/env python3
"""The reliability campaign: every fault scenario in ``bench/faults/`` against a real
daemon, with the figures that must be zero checked.

    python bench/reliability.py [--scale short|long] [--only kill_loop,soak]
                                [--cycles N] [--requests N] [--seconds S] [--json]
    make soak        # the long form (kill loop of 200 cycles, 30-minute soak, ...)

Each scenario runs in a temp dir of its own and reports figures (counts, times,
growth); ``must_be_zero`` names those that fail the campaign unless 0 (wrong
bytes, 5xx, crashes, acknowledged blocks lost). The short form of each runs in
``make test`` (``tests/reliability/``). A table goes to stderr; with ``--json``
one object goes to stdout. The exit code is 1 when any must-be-zero figure is not.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from types import ModuleType

from common import (
    bench_arguments,
    bench_session,
    emit_json,
    format_table,
    log,
    machine_info,
    temp_dir,
)
from faults import fuzzing, kill_loop, redis_faults, resources, soak
from faults.campaign import LONG, SHORT, Report

SCENARIOS: dict[str, ModuleType] = {
    "kill_loop": kill_loop,
    "redis_faults": redis_faults,
    "fuzzing": fuzzing,
    "resources": resources,
    "soak": soak,
}


def main() -> int:
    parser = bench_arguments(__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=("short", "long"), default="short")
    parser.add_argument(
        "--only", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}"
    )
    parser.add_argument("--cycles", type=int, help="fault cycles per scenario (the scale's)")
    parser.add_argument("--requests", type=int, help="requests or cases per cycle")
    parser.add_argument("--seconds", type=float, help="wall clock per scenario (soak: its length)")
    args = parser.parse_args()
    names = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenario(s): {unknown}")
    scale = LONG if args.scale == "long" else SHORT
    sized = {"cycles": args.cycles, "requests": args.requests, "seconds": args.seconds}
    scale = dataclasses.replace(
        scale, **{name: value for name, value in sized.items() if value is not None}
    )
    reports: dict[str, Report] = {}
    elapsed: dict[str, float] = {}
    with bench_session() as stack:
        for name in names:
            workdir = stack.enter_context(temp_dir(f"kvs-reliability-{name}-"))
            started = time.monotonic()
            log(f"{name} ({scale.name}) ...")
            reports[name] = SCENARIOS[name].run(scale, Path(workdir))
            elapsed[name] = round(time.monotonic() - started, 1)
    rows = [
        [name, figure, value, "must be 0" if figure in report.must_be_zero else ""]
        for name, report in reports.items()
        for figure, value in report.figures.items()
    ]
    log(format_table(["scenario", "figure", "value", ""], rows))
    failed = {name: report.failures() for name, report in reports.items() if report.failures()}
    log("every must-be-zero figure is 0" if not failed else f"FAILED: {failed}")
    if args.json:
        emit_json(
            {
                "machine": machine_info(),
                "scale": scale.name,
                "scenarios": {
                    name: {**report.to_dict(), "elapsed_s": elapsed[name]}
                    for name, report in reports.items()
                },
            }
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
