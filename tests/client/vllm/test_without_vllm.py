"""Where vLLM is not installed (the main suite), the connector says so plainly when vLLM
asks for it; the rest of the connector package (pages, plans) imports without vLLM."""

from __future__ import annotations

import importlib
import importlib.util

import pytest


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None,
    reason="vLLM is installed here",
)
def test_the_connector_module_names_what_is_missing() -> None:
    # As vLLM resolves ``kv_connector_module_path`` and ``kv_connector``.
    package = importlib.import_module("kvstore.client.vllm")
    with pytest.raises(ImportError, match=r"needs vLLM installed .*make install-vllm"):
        package.KVStoreConnector  # noqa: B018
