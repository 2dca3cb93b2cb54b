"""The ``sglang.launch_server`` flags of the GPU check's engine run
(``bench/sglang_engine.py``) are flags SGLang's own parser takes, with the values the
run means: that run happens only on a device with SGLang's kernels, so a flag renamed
by an SGLang upgrade shows here first. Run by ``make test-sglang``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

pytest.importorskip(
    "sglang.srt.server_args", reason="SGLang is not installed here; `make test-sglang` runs these"
)

import sglang_engine  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402


def test_sglang_parses_the_engine_runs_flags_as_meant() -> None:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    argv = sglang_engine.server_argv(Path("/models/tiny"), 30123, "unix:///run/kv.sock")
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    args = parser.parse_args(argv[3:])
    assert (args.model_path, args.port, args.page_size) == ("/models/tiny", 30123, 64)
    assert args.skip_tokenizer_init and args.enable_hierarchical_cache
    assert (args.hicache_write_policy, args.hicache_storage_prefetch_policy) == (
        "write_through",
        "wait_complete",
    )
    assert args.hicache_storage_backend == "dynamic"
    assert json.loads(args.hicache_storage_backend_extra_config) == {
        "backend_name": "kvstore",
        "module_path": "kvstore.client.sglang",
        "class_name": "KVStoreHiCache",
        "interface_v1": 1,
        "url": "unix:///run/kv.sock",
    }
    assert args.cuda_graph_backend_decode == args.cuda_graph_backend_prefill == "disabled"
