"""``KVStoreConnector``: vLLM loads cached prefixes from kvstore instead of recomputing them.

Enable it with::

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                           "kv_connector_module_path": "kvstore.client.vllm",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"url": "unix:///run/kvstore.sock"}}'

Process split. vLLM builds one connector per role, in different processes
that share nothing but the metadata vLLM passes and the kvstore daemon:

* scheduler side (EngineCore process, ``client.vllm.scheduler``):
  ``on_new_request`` sends the request's lookup on a thread of its own
  (``client.vllm.lookups``); ``get_num_new_matched_tokens`` answers from it,
  waiting at most what is left of the step's wait (``lookup_wait_ms``, or
  ``lookup_wait_share`` of a step's time if longer; ``None``, "ask again",
  while it is on its way; 0 once ``lookup_deadline_ms`` passed), unless it
  remembers the blocks held (``client.vllm.held_blocks``: those it planned to
  save, those lookups found), which answer at once;
  a load of ``async_load_mib`` or more is asynchronous (the request waits in
  ``WAITING_FOR_REMOTE_KVS`` while others run); ``update_state_after_alloc``
  turns the hit into a load plan on the blocks vLLM allocated;
  ``build_connector_meta`` adds the save plan of the blocks each step
  completes; ``request_finished`` holds the blocks of a request with saves
  planned, or with its asynchronous load on its way, until the workers report.
* worker side (each worker process, ``client.vllm.worker``): ``start_load_kv``
  runs the synchronous loads before the forward and hands the asynchronous ones
  to a thread of their own (``client.vllm.loads``); ``wait_for_save`` gathers
  the step's saves into a bounded pool and returns, a thread of its own puts
  them (``client.vllm.saves``); ``get_finished`` names the finished requests
  whose saves are out and the requests whose asynchronous loads are done;
  ``wait_for_layer_load`` and ``save_kv_layer`` have nothing to do.

What travels in the metadata (``KVStoreConnectorMetadata``): two lists of
``BlockTransfer`` (request id, ``cache_salt``, the first moving block, vLLM's
hashes of the moving blocks, the vLLM block ids they are in, their KV cache
group, and for a save the hash of the block before them), and whether blocks a
gather may still read were freed (a preemption, a sliding window moving on).
Workers derive keys from the hashes themselves, each in its own
tensor-parallel namespace. The page format both sides assume is in
``client.vllm.pages``.

Failure handling. A block that misses, fails verification or cannot be
fetched (daemon down or slow) is reported through
``get_block_ids_with_load_errors``, vLLM rolls the request back to that
block, discards the step's work for it and recomputes; set
``kv_load_failure_policy`` to ``"recompute"`` (vLLM's default, ``"fail"``,
fails the request instead). A model of several KV cache groups loads
asynchronously only, and a load that fails anywhere is reported as the
request's (``failed_recving``): vLLM recomputes it whole. A request with a
failed load saves nothing in that step. A lookup that fails or is late answers
zero tokens; a save that fails is logged and dropped, and one the store is too
slow to take is dropped and counted: the store is a cache, and the engine
never stops for it.

Session events. The scheduler side also tells the daemon when each request
starts and finishes, with its chain, so the daemon's return-time predictor learns
the sessions' idle gaps and moves their KV (``client.vllm.sessions``: how a session
is inferred, or named in ``kv_transfer_params``).

Extra config keys: ``url`` (default ``$KVSTORE_URL``, else the daemon's
default socket), ``timeout_s`` (per I/O phase, default 2), ``batch_blocks``
(blocks per put, or per get through staging, default 32), ``load_batch_blocks``
(blocks per get of a load into a CPU cache's pages, default 256 MiB of them, at
most 1,024: keep it within the daemon's ``max_batch_chunks``), ``lookup_wait_ms`` (default 2)
and ``lookup_wait_share`` (default 0.05: a step waits for lookups this part of a step's
time, if longer than ``lookup_wait_ms``),
``lookup_deadline_ms`` (default 100: a lookup is waited for this long at least, or
``lookup_deadline_share`` of its prompt's prefill time, default 0.1, if longer),
``async_load_mib`` (the smallest load made off the step, default 256),
``held_blocks`` (block hashes the scheduler remembers the store holds, answered
from while a lookup is on its way, per salt; default 131,072, 0 for none),
``save_pool_mib`` (host memory for saves on their way, default 256),
``session_events`` (default true), ``tool_call_end_token_ids`` (default none: no
request reports a running tool).

Hybrid models (``SupportsHMA``): vLLM's hybrid KV cache manager stays on, and
each KV cache group (full attention, sliding window, MLA) is stored in a
namespace of its own, a sliding-window group only for the blocks in its window
(``client.vllm.pages``, ``client.vllm.scheduler``). SSM state and other specs
are refused when the connector starts.

Limits: with tensor parallelism the scheduler asks rank 0's namespace and
other ranks report what they lack as load errors; loads are whole-model, not
layer-wise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
        SupportsHMA,
    )
except ImportError as error:  # the main test suite and plain installs have no vLLM
    raise ImportError(
        "kvstore.client.vllm is a vLLM KV connector and needs vLLM installed "
        "(`make install-vllm` builds a virtual environment with the CPU build)"
    ) from error

import torch

from kvstore.client.address import engine_url
from kvstore.client.connect import KVClient, connect
from kvstore.client.vllm.block_keys import KEYS_KEPT
from kvstore.client.vllm.held_blocks import HeldBlocks
from kvstore.client.vllm.loads import BYTES as ASYNC_LOAD_BYTES
from kvstore.client.vllm.lookups import DEADLINE_S, SHARE, WAIT_S, WAIT_SHARE
from kvstore.client.vllm.pages import BlockTransfer, PageFormat, lookup_group, page_formats
from kvstore.client.vllm.saves import POOL_BYTES
from kvstore.client.vllm.scheduler import SchedulerSide
from kvstore.client.vllm.sessions import SessionEvents
from kvstore.client.vllm.worker import WorkerSide
from kvstore.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVStoreConnector", "KVStoreConnectorMetadata"]


def _log_where_vllm_logs() -> None:
    """kvstore's lines go to vLLM's log handlers at vLLM's level, unless the operator
    set up the ``kvstore`` logger: vLLM configures its own logger only, so the
    connector's reports (the lookups' counts, a failed put) would otherwise be
    dropped below WARNING, or printed in another format."""
    ours, vllms = logging.getLogger("kvstore"), logging.getLogger("vllm")
    if ours.handlers or not vllms.handlers:
        return
    for handler in vllms.handlers:
        ours.addHandler(handler)
    ours.setLevel(vllms.getEffectiveLevel())
    ours.propagate = False


def _session_events(config: Any, store: KVClient, pages: PageFormat) -> SessionEvents | None:
    """The scheduler side's session reports as the extra config asks (None: off)."""
    enabled = config.get_from_extra_config("session_events", True)
    if isinstance(enabled, str):  # JSON gives a bool; a hand-written value may be a string
        enabled = {"true": True, "false": False}.get(enabled.strip().lower(), enabled)
    if not isinstance(enabled, bool):
        raise ConfigError(f"session_events must be true or false, not {enabled!r}")
    tool_call_end = config.get_from_extra_config("tool_call_end_token_ids", [])
    if not isinstance(tool_call_end, list) or not all(
        isinstance(token, int) and not isinstance(token, bool) for token in tool_call_end
    ):
        raise ConfigError(f"tool_call_end_token_ids must be a list of token ids: {tool_call_end!r}")
    return SessionEvents(store, pages, tool_call_end) if enabled else None


def _milliseconds(config: Any, name: str, default_s: float) -> float:
    """Extra config ``name``, in milliseconds, as seconds (``default_s`` when absent)."""
    value = config.get_from_extra_config(name, default_s * 1e3)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e7:
        raise ConfigError(f"{name} must be a number of milliseconds, not {value!r}")
    return float(value) / 1e3


def _fraction(config: Any, name: str, default: float) -> float:
    """Extra config ``name``, a number from 0 to 1 (``default`` when absent)."""
    value = config.get_from_extra_config(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ConfigError(f"{name} must be a number from 0 to 1, not {value!r}")
    return float(value)


def _count(config: Any, name: str, default: int, least: int = 1) -> int:
    """Extra config ``name``, an integer of at least ``least`` (``default`` when absent)."""
    value = config.get_from_extra_config(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{name} must be an integer of at least {least}, not {value!r}")
    return value


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler side to every worker."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    # The scheduler may have freed blocks a gather still reads: a preempted request's,
    # or a sliding window's that moved on.
    freed: bool = False


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's ``KVConnectorBase_V1`` over a kvstore daemon; see the module docstring."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_where_vllm_logs()
        transfer_config = self._kv_transfer_config
        url = engine_url(transfer_config.get_from_extra_config("url", None))
        timeout_s = float(transfer_config.get_from_extra_config("timeout_s", 2.0))
        batch_blocks = _count(transfer_config, "batch_blocks", 32)
        self._store: KVClient = connect(url, timeout_s=timeout_s)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            groups = page_formats(vllm_config, kv_cache_config, tp_rank=0)
            cache_config = vllm_config.cache_config
            hash_block_size = cache_config.hash_block_size or cache_config.block_size
            events = _session_events(transfer_config, self._store, groups[lookup_group(groups)])
            async_mib = _count(transfer_config, "async_load_mib", ASYNC_LOAD_BYTES >> 20, least=0)
            held_blocks = _count(transfer_config, "held_blocks", KEYS_KEPT, least=0)
            self._scheduler = SchedulerSide(
                self._store,
                groups,
                int(hash_block_size),
                events,
                lookup_wait_s=_milliseconds(transfer_config, "lookup_wait_ms", WAIT_S),
                lookup_wait_share=_fraction(transfer_config, "lookup_wait_share", WAIT_SHARE),
                lookup_deadline_s=_milliseconds(transfer_config, "lookup_deadline_ms", DEADLINE_S),
                lookup_deadline_share=_fraction(transfer_config, "lookup_deadline_share", SHARE),
                async_load_bytes=async_mib << 20,
                held=HeldBlocks(held_blocks) if held_blocks else None,
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            groups = page_formats(
                vllm_config, kv_cache_config, tp_rank=get_tensor_model_parallel_rank()
            )
            pool_mib = _count(transfer_config, "save_pool_mib", POOL_BYTES >> 20)
            load_batch = transfer_config.get_from_extra_config("load_batch_blocks", None)
            self._worker = WorkerSide(
                self._store,
                groups,
                batch_blocks,
                pool_mib << 20,
                None if load_batch is None else _count(transfer_config, "load_batch_blocks", 1),
            )

    @property
    def scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise ConfigError("scheduler method called on a worker-side kvstore connector")
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise ConfigError("worker method called on a scheduler-side kvstore connector")
        return self._worker

    # -- worker side -----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Run the synchronous loads (before the forward, when the step has any); hand
        the asynchronous ones to the load thread."""
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVStoreConnectorMetadata)
        self.worker_side.load([load for load in metadata.loads if not load.asynchronous])
        self.worker_side.load_async([load for load in metadata.loads if load.asynchronous])

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: ``start_load_kv`` loaded every layer before the forward."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Nothing per layer: ``wait_for_save`` copies all layers' pages of a block at once."""

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Freed blocks may be reused by this step: gathers still reading them finish first."""
        assert isinstance(kv_connector_metadata, KVStoreConnectorMetadata)
        if kv_connector_metadata.freed:
            self.worker_side.saves.settle()

    def wait_for_save(self) -> None:
        """Queue this step's saves (``client.vllm.saves``); the store is not waited for."""
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVStoreConnectorMetadata)
        self.worker_side.save(metadata.saves)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The finished requests whose saves are out, the requests whose asynchronous
        loads are done, and those of them whose load failed (a model of several KV
        cache groups: vLLM recomputes them whole)."""
        transfers = self.worker_side.finished(finished_req_ids)
        return KVConnectorTransferResults(transfers.saved, transfers.loaded, transfers.failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_failed_blocks()

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.close()
        self._store.close()

    # -- scheduler side ----------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        self.scheduler_side.arrived(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_side.matched_tokens(request, num_computed_tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_side.loaded(set(connector_output.finished_recving or ()))

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler_side.allocated(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        scheduler = self.scheduler_side
        loads, saves = scheduler.step(scheduler_output)
        freed = bool(scheduler_output.preempted_req_ids) or scheduler.frees_blocks_while_running
        return KVStoreConnectorMetadata(loads=loads, saves=saves, freed=freed)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks of a request with saves planned until the workers put them."""
        return self.scheduler_side.finished(request), None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` for vLLM's hybrid KV cache manager: every group's blocks
        are held alike."""
        return self.scheduler_side.finished(request), None

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache, not a hand-off: a save a preemption cut short is a later miss."""
        return False
