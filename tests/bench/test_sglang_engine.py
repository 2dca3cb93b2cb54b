"""``bench/sglang_engine.py`` where SGLang's engine cannot run: the run names the import
that fails and measures nothing; the pieces a run is made of work on their own (the
checkpoint SGLang would load, the daemon restarted around a damaged block)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import sglang_engine
import torch
from sglang_engine import Daemon
from support.kv import chunks, namespace, tokens
from transformers import AutoConfig, AutoModelForCausalLM

import kvstore


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is here")
def test_without_sglang_the_run_names_the_failing_import_and_measures_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert sglang_engine.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == {
        "failed_import": "import sglang: ModuleNotFoundError: No module named 'sglang'",
        "figures": {},
        "checks": {},
        "error": None,
    }


def test_the_checkpoint_is_a_bf16_llama_with_whole_pages_of_prompt(tmp_path: Path) -> None:
    sglang_engine.build_model(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.hidden_size // config.num_attention_heads == 64
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert next(model.parameters()).dtype == torch.bfloat16
    ids = sglang_engine.prompt()
    assert ids == sglang_engine.prompt() and max(ids) < config.vocab_size
    # Prompt and output end inside the page after the prompt's last full one: every
    # stored page is a page of the prompt.
    stored = (len(ids) + sglang_engine.NEW_TOKENS) // sglang_engine.PAGE
    assert stored == len(ids) // sglang_engine.PAGE == sglang_engine.PROMPT_PAGES


def test_a_block_damaged_while_the_daemon_is_down_is_found_after_its_restart(
    tmp_path: Path,
) -> None:
    ns = namespace()
    with Daemon(tmp_path) as daemon:
        with kvstore.connect(daemon.spec.url, timeout_s=10.0) as client:
            assert client.put(ns, tokens(3), chunks(3)) == 3
            keys = list(client.lookup(ns, tokens(3)).keys)
        assert daemon.ssd("blocks") == 3
        daemon.stop()
        sglang_engine.damage_first_block(daemon.lmdb)
        daemon.start()
        with kvstore.connect(daemon.spec.url, timeout_s=10.0) as client:
            got = client.get(ns, keys)
        assert sum(chunk is None for chunk in got) == 1
        assert daemon.ssd("corrupt_blocks") == 1
