"""``paged-generate`` on the default model: completion on stdout, stats on stderr."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from paged_serve.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from paged_serve.engine.engine_args import add_engine_args, engine_kwargs
from paged_serve.engine.llm_engine import LLMEngine
from tests.conftest import loaded, tiny_model


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "paged_serve.engine.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_generate_chat_with_stats(default_model):  # the fixture makes sure the cache exists
    proc = run_cli(
        "--prompt",
        "What is the capital of France?",
        "--chat",
        "--max-tokens",
        "12",
        "--show-stats",
        "--kv-cache-memory",
        str(64 << 20),
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    for field in (
        "prompt tokens:",
        "generated tokens:",
        "TTFT:",
        "TPOT:",
        "tokens/s:",
        "KV blocks used:",
    ):
        assert field in proc.stderr


def test_bad_arguments_exit_2_with_a_message(default_model):
    proc = run_cli("--prompt", "hi", "--max-tokens", "0", "--kv-cache-memory", str(64 << 20))
    assert proc.returncode == 2
    assert "max_tokens must be an integer >= 1" in proc.stderr


def test_engine_flags_reach_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    defaults = EngineConfig(**engine_kwargs(parser.parse_args([])))
    assert defaults.enforce_eager is False and defaults.enable_prefix_caching is True
    assert defaults.kv_cache_memory is None and defaults.cpu_decode_kernel is True
    flags = parser.parse_args(
        ["--enforce-eager", "--no-prefix-caching", "--max-num-seqs", "7", "--no-cpu-decode-kernel"]
    )
    config = EngineConfig(**engine_kwargs(flags))
    assert config.enforce_eager is True
    assert config.enable_prefix_caching is False
    assert config.max_num_seqs == 7
    assert config.cpu_decode_kernel is False
    assert defaults.state_snapshot_interval == 256 and defaults.mm_processor_kwargs is None
    more = parser.parse_args(
        [
            "--state-snapshot-interval", "64", "--num-state-snapshots", "3",
            "--mm-processor-kwargs", '{"do_normalize": false}',
        ]
    )  # fmt: skip
    config = EngineConfig(**engine_kwargs(more))
    assert (config.state_snapshot_interval, config.num_state_snapshots) == (64, 3)
    assert config.mm_processor_kwargs == {"do_normalize": False}


def test_kv_cache_memory_default_and_validation():
    model = tiny_model("llama")
    hf = model.config
    block_bytes = hf.num_hidden_layers * 2 * 16 * hf.num_key_value_heads * hf.head_dim * 4
    engine = LLMEngine(EngineConfig(), loaded=loaded(model))  # None: 1 GiB on a CPU
    assert engine.block_manager.num_blocks == DEFAULT_CPU_KV_CACHE_BYTES // block_bytes
    engine = LLMEngine(EngineConfig(kv_cache_memory=3 * block_bytes), loaded=loaded(model))
    assert engine.block_manager.num_blocks == 3
    with pytest.raises(ValueError, match="kv_cache_memory must be > 0"):
        EngineConfig(kv_cache_memory=0)
