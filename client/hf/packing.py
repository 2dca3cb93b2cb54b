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
every layer, in the order transformers keeps a layer (``[batch=1, H, seq, D]``),
tagged ``HF_LAYOUT = "LKHTD"`` in the namespace's layout::

    payload = [ layer 0 | layer 1 | ... | layer L-1 ]
    layer l = [ K | V ]                      2 x H*T*D elements
    K       = [ head 0 | head 1 | ... | head H-1 ]
    head h  = [ token 0 | ... | token T-1 ]  T x D elements, model dtype
                          (keys after RoPE, as the cache holds them)

Why not kvstore's standard ``LKTHD`` (token-major): unpacking a run of
chunks into a cache layer is then one strided copy whose contiguous runs are
a whole head of a chunk (``T*D`` elements, 64 KiB for T=256, D=64 in
float32), not a ``D``-element row per token and head; on the host it runs
near memcpy speed (see ``unpack_layer``). The tag is part of the namespace
digest, so chunks stored in another order (an older ``LKTHD`` namespace)
are never found, let alone decoded wrongly.

A run of ``n`` chunks is staged as ``(n, L, 2, H, T, D)`` (``staging_buffer``)
and copied from there into the cache's own tensors (``cache_tensors``,
``unpack``): all layers at once, or one layer at a time for the layer-wise
loader.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvstore.client.buffers import BufferPool
from kvstore.errors import ConfigError, LayoutMismatch
from kvstore.keys import KVLayout, Namespace

# The memory order of a block (module docstring); part of every namespace digest.
HF_LAYOUT = "LKHTD"
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
        name=HF_LAYOUT,
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


def block_shape(layout: KVLayout) -> tuple[int, int, int, int, int]:
    """One chunk's payload as a tensor: ``(L, 2, H, T, D)`` (``HF_LAYOUT``)."""
    layers, _, tokens, heads, head_dim = layout.chunk_shape
    return (layers, 2, heads, tokens, head_dim)


def staging_buffer(
    layout: KVLayout, chunks: int, *, pool: BufferPool | None = None, pin: bool = False
) -> torch.Tensor:
    """Host memory for ``chunks`` chunks, ``(n, L, 2, H, T, D)``; row ``i`` is chunk ``i``'s
    payload, so ``get(..., out=list(buffer))`` lands each block in place.

    From ``pool`` when given (host, unpinned): reused memory whose pages are
    already mapped, so the get's copy does not pay a page fault per 4 KiB.
    """
    shape = (chunks, *block_shape(layout))
    if pool is None or pin or not chunks:
        return torch.empty(shape, dtype=torch_dtype(layout), pin_memory=pin)
    buffer = pool.take(chunks * layout.chunk_nbytes)
    return torch.frombuffer(buffer, dtype=torch_dtype(layout)).view(shape)


def cache_tensors(
    layout: KVLayout, tokens: int, device: torch.device, pool: BufferPool | None = None
) -> torch.Tensor:
    """Empty K and V of every layer for ``tokens`` tokens, ``(L, 2, 1, H, tokens, D)``:
    ``block[l, 0]`` and ``block[l, 1]`` are layer ``l``'s ``[1, H, tokens, D]`` K and V,
    each contiguous, as a ``DynamicLayer`` holds them.

    One block for all layers, so the whole unpack is one copy (``unpack``). On
    the host it comes from ``pool`` when given, sized for whole chunks so that
    prompts with the same number of chunks reuse each other's memory once the
    cache that held it is gone (transformers replaces a layer's tensors on
    its first ``update``: right after the first forward).
    """
    shape = (layout.num_layers, 2, 1, layout.num_kv_heads, tokens, layout.head_dim)
    dtype = torch_dtype(layout)
    if pool is None or device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    chunks = -(-tokens // layout.chunk_tokens)
    count = layout.num_layers * 2 * layout.num_kv_heads * tokens * layout.head_dim
    buffer = pool.take(chunks * layout.chunk_nbytes)
    return torch.frombuffer(buffer, dtype=dtype)[:count].view(shape)


def unpack(staged: torch.Tensor, block: torch.Tensor, layers: slice = slice(None)) -> None:
    """Copy ``layers`` of the staged chunks into the same layers of ``block``
    (``cache_tensors``: ``S <= n*T`` tokens, the first ``S`` of the run).

    Each chunk holds a layer's K as ``H x T x D``, so this is one strided
    copy (two when ``S`` cuts a chunk) whose contiguous runs are ``T*D``
    elements (64 KiB for T=256, D=64 in float32): a memcpy in a loop. On the
    host it runs in numpy, not torch: torch splits a copy this size across
    its OpenMP threads, and on a busy machine the copy then waits for a
    descheduled thread (measured: a 0.5 MiB copy taking 10-20 ms on a loaded
    2-core box, 0.03 ms alone). On a GPU the layers are moved to the device
    first and rearranged there.
    """
    tokens = staged.shape[4]
    seq = block.shape[4]
    full, rest = divmod(seq, tokens)
    source = staged[:, layers]  # (n, l, 2, H, T, D)
    if block.device != staged.device:
        source = _to_device(source, block.device)
    target = block[layers, :, 0]  # (l, 2, H, S, D)
    if full:
        whole = target[..., : full * tokens, :].unflatten(3, (full, tokens))
        _copy(whole, source[:full].permute(1, 2, 3, 0, 4, 5))  # (l, 2, H, n, T, D)
    if rest:
        _copy(target[..., full * tokens : seq, :], source[full, ..., :rest, :])


def _to_device(source: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``source`` (pinned host, ``(n, ...)``) on ``device``, one DMA per contiguous piece:
    torch would first gather a strided host tensor (one layer of every chunk) into
    unpinned memory, and copy from there synchronously."""
    if source.is_contiguous():
        return source.to(device, non_blocking=True)
    moved = torch.empty(source.shape, dtype=source.dtype, device=device)
    for row, chunk in zip(moved, source, strict=True):
        row.copy_(chunk, non_blocking=True)
    return moved


_RAW_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)``, on the host as one single-threaded numpy copy of the raw
    bits (bfloat16 has no numpy dtype; a same-size integer view copies the same bytes)."""
    if target.device.type != "cpu":
        target.copy_(source, non_blocking=True)
        return
    raw = _RAW_DTYPES[target.element_size()]
    np.copyto(target.view(raw).numpy(), source.view(raw).numpy())


def pack_chunks(
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
    layout: KVLayout,
    first: int,
    end: int,
) -> list[np.ndarray]:
    """Chunks ``first..end-1`` of a cache's per-layer ``[1, H, seq, D]`` K and V, as host
    payloads (flat bytes in ``HF_LAYOUT`` order); ``LayoutMismatch`` if the cache is not
    ``layout``'s."""
    if end <= first:
        return []
    if len(layers) != layout.num_layers:
        raise LayoutMismatch(f"cache has {len(layers)} layers, the namespace {layout.num_layers}")
    tokens = layout.chunk_tokens
    out = torch.empty((end - first, *block_shape(layout)), dtype=torch_dtype(layout))
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
            span = tensor[0, :, first * tokens : end * tokens, :].to("cpu")  # (H, n*T, D)
            span = span.unflatten(1, (end - first, tokens))  # (H, n, T, D)
            _copy(out[:, index, kind], span.transpose(0, 1))
    return list(out.view(torch.uint8).reshape(end - first, -1).numpy())
