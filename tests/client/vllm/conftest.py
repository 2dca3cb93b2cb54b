"""Import vLLM once, before the tests, with third-party warnings ignored.

The suite turns warnings into errors, and importing vLLM's CPU build warns
from torch, vLLM and transformers themselves (deprecations inside those
packages, not in kvstore). Importing here, under a filter scoped to those
packages' modules, keeps every warning kvstore's own code raises an error.
The tests carry the same filter (``pytestmark``) for what vLLM imports
lazily while it runs.
"""

from __future__ import annotations

import importlib.util
import warnings

THIRD_PARTY = r"(torch|vllm|transformers|triton|numba|pydantic)(\.|$)"

if importlib.util.find_spec("vllm") is not None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=THIRD_PARTY)
        import vllm.entrypoints.llm  # noqa: F401
