"""Hugging Face transformers on kvstore: load a cached prompt prefix instead of recomputing it.

::

    generation.py  HFKVStore: lookup, load, prefill the rest, generate, save
    loading.py     a DynamicCache filled from the store, at once or layer by layer
    packing.py     a model's namespace, and its KV cache as kvstore chunks

Needs transformers (the ``hf`` extra); the store itself never imports this package.
May import: the rest of ``kvstore.client`` and the format.
"""

from kvstore.client.hf.generation import Generation, HFKVStore, Prefill, RequestReport

__all__ = ["Generation", "HFKVStore", "Prefill", "RequestReport"]
