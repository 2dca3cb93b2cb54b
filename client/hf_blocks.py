"""A transformers model's namespace, and how its KV cache maps to kvstore chunks.

**Which models.** Decoder-only models whose attention layers keep one K and
one V of the same shape per token: ``full_attention`` and
``sliding_attention`` layer types (Llama, Qwen2/3, Mistral, Gemma 2/3, ...).
Sliding-window layers are *handled* by keeping every token of them: the
cache built here uses a full ``DynamicLayer`` for every layer, and
transformers' sliding mask works from absolute positions, so the logits are
the same as with its own window-trimmed layers (checked bit for bit in the
tests) at the price of holding the whole prefix for those layers too. That
is what makes the prefix storable: a trimmed layer has forgotten the tokens
a later request needs. Anything else (chunked attention, linear or
recurrent state, KV shared between layers, encoder-decoder models, padded
batches) is refused with ``ConfigError`` before anything is loaded or stored.

**Namespace.** ``Namespace(model=<identity>, layout=KVLayout(...))``, where the
identity binds the architecture, the name the model was loaded under, a
digest of its whole config (RoPE settings change K) and a fingerprint of its
weights (two fine-tunes of one config must not share chunks, nor two
random-weight models), and the layout binds layers, KV heads, head dim, dtype
and chunk size. A tenant salt goes into the namespace as usual.

**Block payload.** One block per chunk of ``T = chunk_tokens`` tokens holds
every layer, in kvstore's standard ``LKTHD`` order (``KVLayout.chunk_shape``)::

    payload = [ layer 0 | layer 1 | ... | layer L-1 ]
    layer l = [ K | V ]                      2 x T*H*D elements
    K       = [ token 0 | token 1 | ... | token T-1 ]
    token t = [ head 0 | ... | head H-1 ]    H x D elements, model dtype
                          (keys after RoPE, as the cache holds them)

transformers holds a layer as ``[batch=1, H, seq, D]``, so packing and
unpacking transpose tokens and heads; a layer's K (or V) of a run of ``n``
chunks is rebuilt by one strided copy per layer from a staging buffer of
shape ``(n, L, 2, T, H, D)`` (``unpack_layer``), which is what the layer-wise
loader does one layer at a time.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch

from kvstore.errors import ConfigError, LayoutMismatch
from kvstore.keys import KVLayout, Namespace

SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# Config fields that do not change what K and V a model computes.
_VOLATILE_CONFIG_FIELDS = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "use_cache",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "_experts_implementation",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)
_FINGERPRINT_ELEMENTS = 32  # sampled from each end of every parameter


def text_config(model: Any) -> Any:
    """The decoder's config (multimodal wrappers keep it under ``text_config``)."""
    config = model.config
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config


def check_supported(model: Any) -> None:
    """Refuse, with ``ConfigError``, a model whose cache this module cannot store."""
    config = text_config(model)
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise ConfigError(f"{name} is an encoder-decoder model; only decoder-only models load KV")
    layer_types = getattr(config, "layer_types", None) or []
    unsupported = sorted(set(layer_types) - SUPPORTED_LAYER_TYPES)
    if unsupported:
        raise ConfigError(
            f"{name} has layer types {unsupported}; kvstore.client.hf stores only "
            f"{sorted(SUPPORTED_LAYER_TYPES)} layers"
        )
    if getattr(config, "attention_chunk_size", None) is not None:
        raise ConfigError(f"{name} uses chunked attention, which kvstore.client.hf does not store")
    if any(mode == "reuse" for mode in getattr(config, "kv_sharing_modes", None) or ()):
        raise ConfigError(
            f"{name} shares KV between layers, which kvstore.client.hf does not store"
        )


def model_layout(model: Any, chunk_tokens: int) -> KVLayout:
    """The chunk layout of ``model``'s KV cache (see the module docstring)."""
    config = text_config(model)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    dtype = str(model.dtype).removeprefix("torch.")
    return KVLayout(
        num_layers=config.num_hidden_layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        chunk_tokens=chunk_tokens,
    )


def model_identity(model: Any, model_id: str | None = None) -> str:
    """Architecture, name, config digest and weights fingerprint, as one string."""
    config = model.config
    fields = json.loads(config.to_json_string(use_diff=False))
    for volatile in _VOLATILE_CONFIG_FIELDS:
        fields.pop(volatile, None)
    config_digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    architecture = type(model).__name__
    name = model_id or getattr(config, "name_or_path", "") or "-"
    return f"hf:{architecture}:{name}:config={config_digest[:16]}:weights={_fingerprint(model)}"


def _fingerprint(model: Any) -> str:
    """A digest of every parameter's name, shape and first and last elements.

    Cheap (two small copies per parameter, also for an 8B model on a GPU) and
    enough to tell fine-tunes and random initialisations apart; pass
    ``model_id`` where two checkpoints could differ only in the middle of
    every tensor.
    """
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            flat = parameter.detach().reshape(-1)
            sample = torch.cat([flat[:_FINGERPRINT_ELEMENTS], flat[-_FINGERPRINT_ELEMENTS:]])
            digest.update(f"{name}:{tuple(parameter.shape)}:{parameter.dtype}".encode())
            digest.update(sample.to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def model_namespace(
    model: Any,
    *,
    chunk_tokens: int,
    tenant_salt: str | None = None,
    model_id: str | None = None,
) -> Namespace:
    """The namespace of ``model``'s chunks (module docstring: what separates two)."""
    check_supported(model)
    return Namespace(
        model_identity(model, model_id),
        model_layout(model, chunk_tokens),
        tenant_salt=tenant_salt,
    )


def torch_dtype(layout: KVLayout) -> torch.dtype:
    dtype = getattr(torch, layout.dtype)
    assert isinstance(dtype, torch.dtype)
    return dtype


def staging_buffer(layout: KVLayout, chunks: int, *, pin: bool = False) -> torch.Tensor:
    """Host memory for ``chunks`` chunks, ``(n, L, 2, T, H, D)``; row ``i`` is chunk ``i``'s
    payload, so ``get(..., out=list(buffer))`` lands each block in place."""
    return torch.empty((chunks, *layout.chunk_shape), dtype=torch_dtype(layout), pin_memory=pin)


def unpack_layer(
    staged: torch.Tensor, layer: int, device: torch.device, max_tokens: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s K and V of every staged chunk as ``[1, H, n*T, D]`` on ``device``,
    cut to the first ``max_tokens`` tokens when given.

    The (strided) host rows are copied to the device first and transposed
    there, so on a GPU the transpose runs at device bandwidth.
    """
    chunks, _, _, tokens, heads, head_dim = staged.shape
    moved = staged[:, layer].to(device, non_blocking=True)  # (n, 2, T, H, D)
    kv = moved.permute(1, 3, 0, 2, 4).reshape(2, 1, heads, chunks * tokens, head_dim)
    if max_tokens is not None:
        kv = kv[:, :, :, :max_tokens]
    return kv[0], kv[1]


def pack_chunks(
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
    layout: KVLayout,
    first: int,
    end: int,
) -> list[torch.Tensor]:
    """Chunks ``first..end-1`` of a cache's per-layer ``[1, H, seq, D]`` K and V, as host
    tensors of ``layout.chunk_shape``; ``LayoutMismatch`` if the cache is not ``layout``'s."""
    if end <= first:
        return []
    if len(layers) != layout.num_layers:
        raise LayoutMismatch(f"cache has {len(layers)} layers, the namespace {layout.num_layers}")
    tokens = layout.chunk_tokens
    out = torch.empty((end - first, *layout.chunk_shape), dtype=torch_dtype(layout))
    for index, (keys, values) in enumerate(layers):
        for kind, tensor in enumerate((keys, values)):
            expected = (1, layout.num_kv_heads, layout.head_dim)
            if (tensor.shape[0], tensor.shape[1], tensor.shape[3]) != expected:
                raise LayoutMismatch(
                    f"layer {index} holds KV of shape {tuple(tensor.shape)}; the namespace "
                    f"expects [1, {layout.num_kv_heads}, seq, {layout.head_dim}]"
                )
            if tensor.dtype != out.dtype:
                raise LayoutMismatch(f"layer {index} holds {tensor.dtype}, not {layout.dtype}")
            span = tensor[0, :, first * tokens : end * tokens, :]  # (H, n*T, D)
            span = span.reshape(layout.num_kv_heads, end - first, tokens, layout.head_dim)
            out[:, index, kind].copy_(span.permute(1, 2, 0, 3))
    return list(out.unbind(0))
