"""Tiny real transformers models (random weights, float32, eval mode) and stores for the
``tests/test_hf_*`` tests. Nothing is downloaded: every model is built from a config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from kvstore import TierKind
from kvstore.client.embedded import EmbeddedClient
from kvstore.store.config import StoreConfig
from kvstore.tiers.registry import TierConfig

CHUNK = 16
VOCAB = 256
_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 1024,
}
ARCHITECTURES = {
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(**_SHAPE)),
    "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**_SHAPE)),
    # Sliding windows shorter than the prompts, so the window really cuts.
    "mistral-sliding": (MistralForCausalLM, lambda: MistralConfig(sliding_window=24, **_SHAPE)),
    "gemma3": (
        Gemma3ForCausalLM,
        lambda: Gemma3TextConfig(sliding_window=24, head_dim=16, **_SHAPE),
    ),
}


def model(name: str = "llama", seed: int = 0) -> Any:
    cls, config = ARCHITECTURES[name]
    torch.manual_seed(seed)
    return cls(config()).eval()


def prompt(n: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, n), generator=generator)


def store_config(tmp_path: Path, *, dram: bool = True, ssd: bool = True) -> StoreConfig:
    tiers = []
    if dram:
        tiers.append(TierConfig(TierKind.DRAM, 64 << 20))
    if ssd:
        tiers.append(TierConfig(TierKind.SSD, 256 << 20, path=tmp_path / "lmdb"))
    return StoreConfig(tiers=tuple(tiers), promote_on_hit=False)


def embedded(tmp_path: Path, **tiers: bool) -> EmbeddedClient:
    """An embedded client over DRAM + LMDB (or the tiers asked for) in ``tmp_path``."""
    return EmbeddedClient(store_config(tmp_path, **tiers))


def full_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model(ids).logits
    return logits


def greedy(model: Any, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Reference generation: plain ``model.generate``, no kvstore."""
    with torch.no_grad():
        out: torch.Tensor = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return out
