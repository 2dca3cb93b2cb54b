"""SGLang HiCache on kvstore in a real engine: a prompt computed, its pages backed up to a
``kvstore serve`` daemon, reloaded from it after ``/flush_cache``, and recomputed past a
damaged block, with the same output tokens every time.

``python bench/sglang_engine.py --probe``   the first import that fails, as JSON
``python bench/sglang_engine.py --json``    the run, as JSON (``bench/gpu_check.py``'s
                                            ``sglang`` step)

The backend's contract is tested without an engine (``tests/client/sglang``); what
only an engine shows is that SGLang's own controller, host pool and scheduler
drive it correctly. That needs SGLang's CUDA kernels, so the run first imports,
in order, ``PROBED``: where one fails (no SGLang, no ``sgl_kernel``, or host pools
whose import chain needs CUDA torch) it reports that import and measures nothing.

A run, every wait bounded by what is left of ``--budget-s`` (counted from the
start, imports included)::

    model     a 2-layer Llama, random weights, bf16, save_pretrained into a temp dir;
              no tokenizer: the server runs --skip-tokenizer-init and takes token ids
    daemon    kvstore serve over LMDB only: every read is verified, and the file
              can be damaged while the daemon is stopped
    server    python -m sglang.launch_server, HiCache write-through to the daemon
              (--hicache-storage-backend dynamic, the kvstore backend), prefetch
              policy wait_complete so a reload waits for every page it found
    cold      the prompt (PROMPT_PAGES full pages and a few tokens): nothing cached;
              then wait until the daemon holds its pages
    reload    /flush_cache (device and host caches), the prompt again: its full
              pages come from storage (cached_tokens_details["storage"]), the
              daemon served at least as many blocks, the same output tokens
    damaged   the daemon stopped, the first block in LMDB's key order damaged,
              the daemon restarted; /flush_cache, the prompt: the daemon found
              the corrupt block, the engine loaded only the pages before it and
              recomputed the rest, the same output tokens

JSON on stdout: ``{"failed_import": str | null, "figures": {...}, "checks":
{name: bool}, "error": str | null}``, with the tails of the server's and the
daemon's logs among the figures when a run failed; the exit code is 0 whenever that was
printed (the caller judges the checks), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import lmdb  # noqa: E402
import torch  # noqa: E402
from common import DaemonStats, ServerProcess, emit_json, temp_dir  # noqa: E402
from faults.campaign import DaemonSpec  # noqa: E402

from kvstore.block import HEADER_BYTES  # noqa: E402
from kvstore.local.processes import HOST, free_port, spawn, stop_process  # noqa: E402

# SGLang, its kernels, the host pools and server the engine run needs, and the backend.
PROBED = (
    "sglang",
    "sgl_kernel",
    "flashinfer",
    "sglang.srt.mem_cache.pool_host",
    "sglang.srt.entrypoints.http_server",
    "kvstore.client.sglang.backend",
)
PAGE = 64  # tokens per HiCache page
PROMPT_PAGES = 16
PROMPT_TOKENS = PROMPT_PAGES * PAGE + 8  # the tail past the last full page is never stored
NEW_TOKENS = 8  # the prompt and its output still end inside page PROMPT_PAGES
SHAPE: dict[str, Any] = {  # head_dim 64, 1 KiB of bf16 KV per token: a page is 64 KiB
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
}
BUDGET_S = 85.0
SERVER_START_S = 60.0  # the most of the budget the server's start may take
LOG_TAIL_BYTES = 3000  # of the server's and the daemon's logs, in a failed run's figures


class RunFailed(RuntimeError):
    """A bounded wait ran out, or the engine or daemon answered what it must not."""


def failed_import() -> str | None:
    """``"import NAME: ErrorType: message"`` for the first of ``PROBED`` that does not
    import here, ``None`` when all do."""
    for name in PROBED:
        try:
            importlib.import_module(name)
        except Exception as error:  # an import can fail with anything (OSError, RuntimeError)
            return f"import {name}: {type(error).__name__}: {error}"
    return None


class Deadline:
    """What is left of the run's budget; each wait takes at most ``cap`` of it."""

    def __init__(self, budget_s: float) -> None:
        self.end = time.monotonic() + budget_s

    def left(self, cap: float) -> float:
        left = min(cap, self.end - time.monotonic())
        if left <= 0:
            raise RunFailed("the run's budget is spent")
        return left


# -- the pieces ---------------------------------------------------------------------


def build_model(directory: Path) -> None:
    """A random-weight Llama in bf16 as a checkpoint directory SGLang can load."""
    # Imported here: the probe must answer where only SGLang's own pieces are missing.
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(LlamaConfig(**SHAPE))
    model.to(torch.bfloat16).save_pretrained(directory)


def prompt() -> list[int]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SHAPE["vocab_size"], (PROMPT_TOKENS,), generator=generator)
    return [int(token) for token in ids]


class Daemon:
    """``kvstore serve`` over LMDB alone in ``root``, stopped and started again around
    the damage (its files outlive a restart)."""

    def __init__(self, root: Path) -> None:
        self.lmdb = root / "lmdb"
        tiers = f'[tiers.ssd]\ncapacity = "1GiB"\npath = "{self.lmdb}"\n'
        self.spec = DaemonSpec(root, tiers=tiers, store={"promote_on_hit": False})
        self._server: ServerProcess | None = None
        self._stats: DaemonStats | None = None

    def start(self) -> None:
        self._server = self.spec.process().__enter__()
        self._stats = DaemonStats(self.spec.socket_path)

    def stop(self) -> None:
        stats, server, self._stats, self._server = self._stats, self._server, None, None
        if stats is not None:
            stats.close()
        if server is not None:
            server.__exit__()

    def ssd(self, counter: str) -> int:
        """One of the LMDB tier's counters since this start (``TierCounters``)."""
        if self._stats is None:
            raise RunFailed("the daemon is not running")
        return int(self._stats.tier("ssd")[counter])

    def __enter__(self) -> Daemon:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def damage_first_block(lmdb_dir: Path) -> None:
    """Flip one payload bit of the first block in LMDB's key order, as a failing disk
    would. Which page that is does not matter: the engine must recompute from it on."""
    env = lmdb.open(str(lmdb_dir), subdir=True)
    try:
        with env.begin(write=True) as txn:
            cursor = txn.cursor()
            if not cursor.first():
                raise RunFailed("LMDB holds no block to damage")
            damaged = bytearray(cursor.value())
            damaged[HEADER_BYTES + 100] ^= 0x10
            txn.put(cursor.key(), bytes(damaged))
    finally:
        env.close()


def server_argv(model_dir: Path, port: int, daemon_url: str) -> list[str]:
    backend = {
        "backend_name": "kvstore",
        "module_path": "kvstore.client.sglang",
        "class_name": "KVStoreHiCache",
        "interface_v1": 1,
        "url": daemon_url,
    }
    return [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model_dir), "--host", HOST, "--port", str(port),
        "--dtype", "bfloat16", "--skip-tokenizer-init", "--skip-server-warmup",
        "--random-seed", "0", "--log-level", "warning",
        "--mem-fraction-static", "0.2", "--max-total-tokens", "16384",
        "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
        "--page-size", str(PAGE),
        "--enable-hierarchical-cache", "--hicache-ratio", "2",
        "--hicache-write-policy", "write_through",
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend", "dynamic",
        "--hicache-storage-backend-extra-config", json.dumps(backend),
    ]  # fmt: skip


@contextlib.contextmanager
def sglang_server(argv: list[str], log: Path, deadline: Deadline) -> Iterator[httpx.Client]:
    """The server, answering ``/health``; stopped with every process of its session."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["HF_HUB_OFFLINE"] = "1"  # a local checkpoint; nothing to look up
    proc = spawn(argv, log, env=env, new_session=True)
    base = f"http://{HOST}:{argv[argv.index('--port') + 1]}"
    try:
        with httpx.Client(base_url=base, timeout=10.0) as http:
            until = time.monotonic() + deadline.left(SERVER_START_S)
            while not answers_health(http):
                if proc.poll() is not None:
                    raise RunFailed(f"the server exited with {proc.returncode}")
                if time.monotonic() > until:
                    raise RunFailed("the server did not answer /health in time")
                time.sleep(0.5)
            yield http
    finally:
        stop_process(proc, timeout_s=10.0)
        with contextlib.suppress(ProcessLookupError):  # its scheduler and detokenizer
            os.killpg(proc.pid, signal.SIGKILL)


def answers_health(http: httpx.Client) -> bool:
    try:
        return http.get("/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass(frozen=True)
class Answer:
    """What ``/generate`` said about one greedy run of the prompt."""

    output_ids: list[int]
    cached_tokens: int
    storage_tokens: int  # of cached_tokens, those loaded from the storage backend


def generate(http: httpx.Client, ids: list[int], deadline: Deadline) -> Answer:
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
    }
    response = http.post("/generate", json=body, timeout=deadline.left(30.0))
    response.raise_for_status()
    answer = response.json()
    meta = answer["meta_info"]
    details = meta.get("cached_tokens_details") or {}
    return Answer(
        [int(token) for token in answer["output_ids"]],
        int(meta["cached_tokens"]),
        int(details.get("storage", 0)),
    )


def flush(http: httpx.Client, deadline: Deadline) -> None:
    """``/flush_cache``: the device and host caches emptied, the storage left as it is."""
    wait = deadline.left(10.0)
    response = http.post("/flush_cache", params={"timeout": wait}, timeout=wait + 5.0)
    if response.status_code != 200:
        raise RunFailed(f"/flush_cache answered {response.status_code}: {response.text}")


def wait_for_blocks(daemon: Daemon, count: int, deadline: Deadline) -> int:
    """Wait until the daemon's LMDB holds ``count`` blocks (the backup is asynchronous)."""
    until = time.monotonic() + deadline.left(20.0)
    while (held := daemon.ssd("blocks")) < count:
        if time.monotonic() > until:
            raise RunFailed(f"the daemon holds {held} of the prompt's {count} pages")
        time.sleep(0.2)
    return held


# -- the run ------------------------------------------------------------------------


@dataclass
class Outcome:
    """What a run measured and which checks held; ``error`` when it could not finish."""

    figures: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)
    error: str | None = None


def run(deadline: Deadline) -> Outcome:
    outcome = Outcome()
    with temp_dir("kvs-sglang-") as root:
        build_model(root / "model")
        try:
            with contextlib.ExitStack() as stack:
                daemon = stack.enter_context(Daemon(root / "daemon"))
                argv = server_argv(root / "model", free_port(), daemon.spec.url)
                http = stack.enter_context(sglang_server(argv, root / "sglang.log", deadline))
                scenario(http, daemon, deadline, outcome)
        except (RuntimeError, httpx.HTTPError, OSError, KeyError, ValueError) as failure:
            outcome.error = f"{type(failure).__name__}: {failure}"
            for name in ("sglang.log", "daemon/daemon.log"):
                with contextlib.suppress(OSError):
                    tail = (root / name).read_bytes()[-LOG_TAIL_BYTES:]
                    outcome.figures[f"{name} tail"] = tail.decode(errors="replace")
    return outcome


def scenario(http: httpx.Client, daemon: Daemon, deadline: Deadline, outcome: Outcome) -> None:
    """Cold, reload, damaged (the module docstring); each check as soon as it can be told."""
    ids, full = prompt(), PROMPT_PAGES * PAGE
    checks, figures = outcome.checks, outcome.figures
    cold = generate(http, ids, deadline)
    checks["the cold prompt found nothing cached"] = cold.cached_tokens == 0
    figures["blocks_stored"] = wait_for_blocks(daemon, PROMPT_PAGES, deadline)

    hits = daemon.ssd("hits")
    flush(http, deadline)
    warm = generate(http, ids, deadline)
    figures["reload"] = asdict(warm) | {"blocks_served": daemon.ssd("hits") - hits}
    checks[f"after a flush, {full} tokens came from storage"] = warm.storage_tokens == full
    checks["the daemon served every page"] = figures["reload"]["blocks_served"] >= PROMPT_PAGES
    checks["reloaded: the same output tokens"] = warm.output_ids == cold.output_ids

    daemon.stop()
    damage_first_block(daemon.lmdb)
    daemon.start()
    flush(http, deadline)
    damaged = generate(http, ids, deadline)
    figures["damaged"] = asdict(damaged) | {"corrupt_blocks": daemon.ssd("corrupt_blocks")}
    figures["cold_output_ids"] = cold.output_ids
    checks["the daemon found the damaged block"] = figures["damaged"]["corrupt_blocks"] == 1
    checks["only the pages before it were loaded"] = (
        damaged.cached_tokens < warm.cached_tokens and damaged.cached_tokens % PAGE == 0
    )
    checks["past the damage: the same output tokens"] = damaged.output_ids == cold.output_ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--probe", action="store_true", help="only say which import fails")
    mode.add_argument("--json", action="store_true", help="the run, one JSON object on stdout")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole run's limit")
    args = parser.parse_args(argv)
    deadline = Deadline(args.budget_s)  # importing SGLang takes its share too
    failure = failed_import()
    if args.probe or failure is not None:
        emit_json({"failed_import": failure, "figures": {}, "checks": {}, "error": None})
        return 0
    emit_json({"failed_import": None, **asdict(run(deadline))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
