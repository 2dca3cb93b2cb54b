"""The replay gives the same JSON whatever vector instructions its kernels pick.

A second machine is played here by the switches that pick kernels: torch's
``ATEN_CPU_CAPABILITY`` (scalar, AVX2, AVX-512), numpy's
``NPY_DISABLE_CPU_FEATURES`` (every dispatched kernel off: its baseline) and MKL's
``MKL_ENABLE_INSTRUCTIONS``. The predictor learns online over four real
conversations, so a forecast rounded one way on one of them and another way on
another would show in its scores (``predictor.learning.portable``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

KERNEL_CHOICES = {"avx2": ("avx2", "fma"), "avx512": ("avx512f", "avx512bw", "avx512vl")}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _numpy_dispatch() -> str:
    """numpy's dispatched instruction sets, by its own names for them (they change
    between releases)."""
    from numpy._core import _multiarray_umath

    return " ".join(_multiarray_umath.__cpu_dispatch__)


def _machines() -> dict[str, dict[str, str]]:
    flags = _cpu_flags()
    machines = {"scalar torch": {"ATEN_CPU_CAPABILITY": "default"}}
    for capability, needs in KERNEL_CHOICES.items():
        if all(flag in flags for flag in needs):
            machines[f"torch {capability}"] = {"ATEN_CPU_CAPABILITY": capability}
    machines["baseline x86-64"] = {
        "ATEN_CPU_CAPABILITY": "default",
        "NPY_DISABLE_CPU_FEATURES": _numpy_dispatch(),
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    }
    return machines


def _replay(conversations: Path, settings: dict[str, str]) -> str:
    command = [sys.executable, "-c", "import sys; from kvstore.cli import main; sys.exit(main())"]
    argv = [*command, "replay", str(conversations), "--users", "2"]
    argv += ["--policy", "lru,predictor", "--hbm-gb", "0.3", "--dram-gb", "0.6"]
    argv += ["--ssd-gb", "4", "--jobs", "1", "--json", "--no-progress"]
    env = {**os.environ, **settings}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_replay_is_the_same_json_on_every_kernel_choice(conversations: Path) -> None:
    runs = {name: _replay(conversations, settings) for name, settings in _machines().items()}
    first = next(iter(runs.values()))
    brier = json.loads(first)["policies"]["predictor"]["brier"]
    assert all(0.0 < value < 1.0 for value in brier.values())  # it forecast and was scored
    differing = [name for name, out in runs.items() if out != first]
    assert not differing, f"{differing} differ from {next(iter(runs))}"
