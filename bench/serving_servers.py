"""The processes behind one run of ``bench/serving.py``: the model, the store, vLLM.

Each run starts everything fresh, so no run finds another's cache::

    vllm        vLLM-CPU alone (.venv-vllm)
    kvstore     kvstore serve (DRAM + LMDB, main env) on a Unix socket in the
                run's directory  <-  vLLM (.venv-vllm) with KVStoreConnector
    kvstore-async  the same with every load asynchronous (async_load_mib 0)
    kvstore-fixed-wait  the same with the scheduler's wait for lookups fixed at
                lookup_wait_ms (lookup_wait_share 0), not a share of a step
    kvstore-ask the same with no memory of held blocks (held_blocks 0): every
                ask waits for its request's lookup
    lmcache-shm lmcache server (.venv-lmcache) on loopback TCP  <-  vLLM
    lmcache     (.venv-lmcache) with LMCacheMPConnector, lmcache_driven (the
                worker's KV cache moved to shared memory) or engine_driven
    vllm-big    vLLM alone with a KV cache that holds every session

Fairness:

* vLLM's worker is pinned by ``VLLM_CPU_OMP_THREADS_BIND`` in every
  configuration: with a connector configured, vLLM-CPU reserves a core for it
  and on 2 cores would otherwise bind its worker to both (a ~1.85x prefill
  "win" that is only a second core).
* vLLM's own prefix caching stays on; its cache (``--num-gpu-blocks-override``)
  holds a fraction of the sessions' contexts, so returning turns find their
  context evicted and come from the external store, if any.
* The same model, block size, dtype and seed everywhere; prompts are token ids
  (``--skip-tokenizer-init``), so no tokenizer is involved.

Every process runs in a session of its own and is stopped with its whole
process group (vLLM's engine core and workers are its children); LMCache's
``lmcache_driven`` mode leaves a ``/dev/shm/lmcache_kv_*`` segment the size of
vLLM's KV cache at every vLLM stop, so the ones a run created are removed.
"""

from __future__ import annotations

import contextlib
import enum
import json
import math
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from common import DaemonStats, GiB, ServerProcess
from serving_client import MODEL_NAME

from kvstore.local.processes import HOST, LIVE, free_port, spawn

REPO = Path(__file__).resolve().parents[1]
SHM = Path("/dev/shm")


@dataclass(frozen=True)
class ModelShape:
    """A random-weight Llama; 8 KiB of bf16 KV per token by default."""

    layers: int = 8
    hidden: int = 1024
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 2816
    vocab: int = 32000
    dtype: str = "bfloat16"

    @property
    def kv_bytes_per_token(self) -> int:
        head_dim = self.hidden // self.heads
        return 2 * self.layers * self.kv_heads * head_dim * (2 if self.dtype == "bfloat16" else 4)


def build_model(shape: ModelShape, path: Path, max_positions: int, seed: int) -> None:
    """Save a random-weight Llama of ``shape`` with ``save_pretrained`` (no download)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.hidden // shape.heads,
        vocab_size=shape.vocab,
        max_position_embeddings=max_positions,
    )
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if shape.dtype == "bfloat16" else torch.float32
    model = LlamaForCausalLM(config)
    model.to(dtype)  # type: ignore[arg-type]  # transformers types `to` as a wrapper
    model.save_pretrained(path)


class Connector(enum.Enum):
    NONE = "none"
    KVSTORE = "kvstore"
    LMCACHE_SHM = "lmcache_driven"
    LMCACHE = "engine_driven"


@dataclass(frozen=True)
class Configuration:
    name: str
    connector: Connector
    big_cache: bool = False
    connector_config: Mapping[str, Any] = field(default_factory=dict)  # KVStoreConnector's


CONFIGURATIONS = {
    c.name: c
    for c in (
        Configuration("vllm", Connector.NONE),
        Configuration("kvstore", Connector.KVSTORE),
        Configuration("kvstore-async", Connector.KVSTORE, connector_config={"async_load_mib": 0}),
        Configuration(
            "kvstore-fixed-wait", Connector.KVSTORE, connector_config={"lookup_wait_share": 0}
        ),
        Configuration("kvstore-ask", Connector.KVSTORE, connector_config={"held_blocks": 0}),
        Configuration("lmcache-shm", Connector.LMCACHE_SHM),
        Configuration("lmcache", Connector.LMCACHE),
        Configuration("vllm-big", Connector.NONE, big_cache=True),
    )
}


@dataclass(frozen=True)
class Environments:
    """Where each side's interpreter lives."""

    vllm_python: Path = REPO / ".venv-vllm/bin/python"
    lmcache_bin: Path = REPO / ".venv-lmcache/bin"
    kvstore_python: Path = REPO / ".venv/bin/python"

    def python_for(self, connector: Connector) -> Path:
        lmcache = connector in (Connector.LMCACHE, Connector.LMCACHE_SHM)
        return self.lmcache_bin / "python" if lmcache else self.vllm_python


@dataclass(frozen=True)
class Sizing:
    """vLLM's cache and context for one workload."""

    block_size: int
    max_model_len: int
    cache_blocks: int


@dataclass(frozen=True)
class ServerOptions:
    """What every run shares: the model, pinning, stores' sizes, timeouts."""

    model_dir: Path
    shape: ModelShape
    envs: Environments
    omp_bind: str = "0"
    kvstore_dram: str = "4GiB"
    kvstore_ssd: str = "16GiB"
    kvstore_connector: Mapping[str, Any] = field(default_factory=dict)
    lmcache_l1_gb: float = 4.0
    lmcache_chunk_tokens: int = 256
    start_timeout_s: float = 600.0
    seed: int = 0


# -- one run -------------------------------------------------------------------


@contextlib.contextmanager
def serving(
    configuration: Configuration, sizing: Sizing, options: ServerOptions, workdir: Path
) -> Iterator[str]:
    """Start the configuration's store and vLLM; yield vLLM's base URL; stop them all."""
    workdir.mkdir(parents=True, exist_ok=True)
    shm_before = _lmcache_segments()
    try:
        with contextlib.ExitStack() as stack:
            transfer = None
            if configuration.connector is Connector.KVSTORE:
                transfer = stack.enter_context(
                    _kvstore(options, configuration.connector_config, workdir)
                )
            elif configuration.connector is not Connector.NONE:
                transfer = stack.enter_context(_lmcache(configuration.connector, options, workdir))
            yield stack.enter_context(_vllm(configuration, sizing, options, transfer, workdir))
    finally:
        for segment in _lmcache_segments() - shm_before:
            with contextlib.suppress(OSError):
                segment.unlink()


def _lmcache_segments() -> set[Path]:
    return set(SHM.glob("lmcache_kv_*"))


@contextlib.contextmanager
def _kvstore(
    options: ServerOptions, connector_config: Mapping[str, Any], workdir: Path
) -> Iterator[dict[str, Any]]:
    """A ``kvstore serve`` with DRAM and LMDB; yields vLLM's kv-transfer-config."""
    socket_path = workdir / "kvstore.sock"
    config = workdir / "kvstore.toml"
    config.write_text(
        f'data_dir = "{workdir / "kvstore-data"}"\n\n'
        f'[tiers.dram]\ncapacity = "{options.kvstore_dram}"\nprefault = true\n\n'
        f'[tiers.ssd]\ncapacity = "{options.kvstore_ssd}"\n\n'
        f'[daemon]\nsocket_path = "{socket_path}"\nlog_level = "warning"\n'
    )
    argv = [str(options.envs.kvstore_python), "-m", "kvstore", "serve", "--config", str(config)]
    with ServerProcess("kvstore serve", argv, socket_path, workdir / "kvstore.log"):
        stats = DaemonStats(socket_path)
        try:
            stats.wait_prefaulted(options.start_timeout_s)
        finally:
            stats.close()
        yield {
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore.client.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "url": f"unix://{socket_path}",
                **connector_config,
                **options.kvstore_connector,
            },
        }


@contextlib.contextmanager
def _lmcache(
    connector: Connector, options: ServerOptions, workdir: Path
) -> Iterator[dict[str, Any]]:
    """An ``lmcache server`` (multiprocess mode) on loopback; yields vLLM's kv-transfer-config."""
    port, http_port = free_port(), free_port()
    argv = [
        str(options.envs.lmcache_bin / "lmcache"), "server",
        "--host", HOST, "--port", str(port),
        "--http-host", HOST, "--http-port", str(http_port),
        "--prometheus-port", str(free_port()),
        "--l1-size-gb", str(options.lmcache_l1_gb),
        "--chunk-size", str(options.lmcache_chunk_tokens),
        "--eviction-policy", "LRU",
        "--supported-transfer-mode", "auto",
    ]  # fmt: skip
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1"}
    proc = spawn(argv, workdir / "lmcache.log", env=env, new_session=True)
    try:
        _wait_http(proc, f"http://{HOST}:{http_port}/healthcheck", options, workdir / "lmcache.log")
        extra: dict[str, Any] = {"lmcache.mp.host": f"tcp://{HOST}", "lmcache.mp.port": port}
        if connector is Connector.LMCACHE_SHM:
            extra["lmcache.mp.mp_transfer_mode"] = "lmcache_driven"
        yield {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    finally:
        stop_group(proc)


@contextlib.contextmanager
def _vllm(
    configuration: Configuration,
    sizing: Sizing,
    options: ServerOptions,
    transfer: Mapping[str, Any] | None,
    workdir: Path,
) -> Iterator[str]:
    port = free_port()
    python = options.envs.python_for(configuration.connector)
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(options.model_dir), "--served-model-name", MODEL_NAME,
        "--host", HOST, "--port", str(port),
        "--skip-tokenizer-init", "--dtype", options.shape.dtype,
        "--block-size", str(sizing.block_size),
        "--max-model-len", str(sizing.max_model_len),
        "--num-gpu-blocks-override", str(sizing.cache_blocks),
        "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
        "--seed", str(options.seed),
    ]  # fmt: skip
    if transfer is not None:
        argv += ["--kv-transfer-config", json.dumps(transfer)]
    cache_bytes = sizing.cache_blocks * sizing.block_size * options.shape.kv_bytes_per_token
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "VLLM_"))},
        "VLLM_CPU_OMP_THREADS_BIND": options.omp_bind,
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(cache_bytes / GiB))),
        "LMCACHE_TRACK_USAGE": "false",
    }
    log_path = workdir / "vllm.log"
    proc = spawn(argv, log_path, env=env, new_session=True)
    try:
        base_url = f"http://{HOST}:{port}"
        _wait_http(proc, f"{base_url}/health", options, log_path)
        yield base_url
    finally:
        stop_group(proc)


def _wait_http(
    proc: subprocess.Popen[bytes], url: str, options: ServerOptions, log_path: Path
) -> None:
    """Wait until ``url`` answers 200; raise with the log's tail if the process exits first."""
    deadline = time.monotonic() + options.start_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited while starting:\n{log_tail(log_path)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(
        f"{url} did not answer in {options.start_timeout_s:.0f} s:\n{log_tail(log_path)}"
    )


def stop_group(proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    """SIGTERM the server, which stops its children in order (signalled together, vLLM's
    engine core dies under its API server); SIGKILL the group if any of it is still
    there after ``timeout_s``."""
    if proc.poll() is None:
        proc.terminate()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (proc.poll() is None or _group_alive(proc.pid)):
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=timeout_s)
    LIVE.discard(proc)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def log_tail(path: Path, nbytes: int = 6000) -> str:
    with contextlib.suppress(OSError):
        return path.read_bytes()[-nbytes:].decode(errors="replace")
    return ""


def missing(envs: Environments, names: Sequence[str]) -> dict[str, str]:
    """The configurations among ``names`` whose environment is not installed, and why."""
    absent = {}
    for name in names:
        python = envs.python_for(CONFIGURATIONS[name].connector)
        if not python.exists():
            absent[name] = f"{python} not found"
    if "kvstore" in names and not envs.kvstore_python.exists():
        absent["kvstore"] = f"{envs.kvstore_python} not found"
    return absent
