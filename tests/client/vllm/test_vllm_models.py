"""Attention beyond plain full attention, through the connector on vLLM's CPU build.

* **MLA**: a DeepSeek-V2-Lite-shaped model (two dense layers, random weights,
  DeepSeek-V2's 512-wide latent plus 64 of rope a token, no V) on vLLM's
  ``CPU_MLA`` backend, whose KV cache is one latent vector a token.
* **Sliding window + full attention**: a Llama whose first layer attends to a
  48-token window. vLLM turns its hybrid KV cache manager off for a connector
  that does not declare ``SupportsHMA``, so both layers share one KV cache
  group of full-attention pages (the window is applied when attending), which
  the connector stores as it stores any model's.

For each: a prompt's blocks are saved, vLLM's own cache is reset, and the same
prompt loads every full block back from the daemon and gives the same greedy
output. Run by ``make test-vllm``; skipped where vLLM is not installed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; `make test-vllm` runs these")

import torch  # noqa: E402
from support.daemon import Daemon, running_daemon  # noqa: E402
from support.vllm_engine import (  # noqa: E402
    PROMPT_TOKENS,
    generate,
    prompt,
    start_llm,
    stats,
    stats_once_stored,
    stop_llm,
)
from transformers import (  # noqa: E402
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

from kvstore.tiers.kinds import TierKind  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    r"ignore:::(torch|vllm|transformers|triton|numba|pydantic)(\.|$)"
)
SSD_ONLY = """\
data_dir = "{data_dir}"

[tiers.ssd]
capacity = "256MiB"
"""


def deepseek_v2() -> PreTrainedModel:
    config = DeepseekV2Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        kv_lora_rank=512,  # the latent: 512 + 64 of rope, as vLLM's CPU kernels require
        q_lora_rank=None,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        v_head_dim=64,
        first_k_dense_replace=2,  # both layers dense: MLA without the experts
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
    )
    return DeepseekV2ForCausalLM(config)


def sliding_and_full_llama() -> PreTrainedModel:
    config: PretrainedConfig = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=48,
    )
    return LlamaForCausalLM(config)


# name -> the model, vLLM's block size for it, and its attention backend. CPU_MLA is
# named: vLLM prefers AMX_MLA where the CPU has AMX, which takes other blocks and dtypes,
# and the reference backend runs on every x86-64 CPU.
KINDS: dict[str, tuple[Callable[[], PreTrainedModel], int, dict[str, Any]]] = {
    "mla": (deepseek_v2, 16, {"attention_config": {"backend": "CPU_MLA"}}),
    "sliding+full": (sliding_and_full_llama, 32, {}),
}


@pytest.fixture(scope="module")
def store_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("kvstore"), config_text=SSD_ONLY) as daemon:
        yield daemon


@pytest.fixture(scope="module", params=list(KINDS))
def engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, store_daemon: Daemon
) -> Iterator[tuple[Any, int]]:
    make, block_size, engine_options = KINDS[request.param]
    model_dir = tmp_path_factory.mktemp(request.param.replace("+", "-"))
    torch.manual_seed(0)
    make().save_pretrained(model_dir)
    connector = {"url": store_daemon.url, "session_events": False}
    llm = start_llm(model_dir, connector, block_size=block_size, **engine_options)
    try:
        yield llm, block_size
    finally:
        stop_llm(llm)


def test_a_reset_engine_loads_every_full_block_and_gives_the_same_output(
    engine: tuple[Any, int], store_daemon: Daemon
) -> None:
    llm, block_size = engine
    full_blocks = PROMPT_TOKENS // block_size  # the block holding the last token is computed
    tokens = prompt(21)
    before = stats(store_daemon)
    first, _ = generate(llm, tokens)
    stored = stats_once_stored(store_daemon, before.chunks_stored + full_blocks)

    assert llm.reset_prefix_cache()
    second, cached = generate(llm, tokens)
    after = stats(store_daemon)
    assert second == first
    assert cached == full_blocks * block_size
    assert after.tiers[TierKind.SSD].hits - stored.tiers[TierKind.SSD].hits == full_blocks
    assert after.get_misses == stored.get_misses
