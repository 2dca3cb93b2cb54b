"""Where SGLang is not installed (the main suite), the backend says so plainly when SGLang
asks for it; the rest of the package (pages, the page store) imports without SGLang."""

from __future__ import annotations

import importlib
import importlib.util

import pytest


@pytest.mark.skipif(
    importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here"
)
def test_the_backend_names_what_is_missing() -> None:
    # As SGLang's dynamic backend loader resolves module_path and class_name.
    package = importlib.import_module("kvstore.client.sglang")
    with pytest.raises(ImportError, match=r"needs SGLang installed .*make install-sglang"):
        package.KVStoreHiCache  # noqa: B018
