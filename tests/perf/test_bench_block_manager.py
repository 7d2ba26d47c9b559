"""The block-manager benchmark reports the seed's fragmentation figures for its default input."""

from __future__ import annotations

import json

import pytest

from perf.engine.bench_block_manager import main

SEED_ARGS = ["--block-size", "16", "--total-blocks", "64", "--request-tokens", "9,17,33,5,41,12"]


def test_seed_figures(capsys: pytest.CaptureFixture[str]) -> None:
    report = main(SEED_ARGS)
    assert json.loads(capsys.readouterr().out) == report
    assert report["block_size"] == 16
    assert report["total_blocks"] == 64
    assert report["request_tokens"] == [9, 17, 33, 5, 41, 12]
    assert report["block_usage"] == {
        "allocated_tokens": 117,
        "reserved_tokens": 176,
        "internal_fragmentation_tokens": 59,
        "block_utilization": 0.6648,
        "used_blocks": 11,
        "free_blocks": 53,
    }
    assert report["contiguous_fixed_slot_baseline"] == {
        "reserved_tokens": 246,
        "internal_fragmentation_tokens": 129,
        "utilization": 0.4756,
    }
    assert report["fragmentation_tokens_saved_vs_contiguous"] == 70


def test_exact_block_multiples_waste_nothing() -> None:
    report = main(["--block-size", "4", "--total-blocks", "8", "--request-tokens", "4,8"])
    assert report["block_usage"]["internal_fragmentation_tokens"] == 0
    assert report["block_usage"]["used_blocks"] == 3
    assert report["contiguous_fixed_slot_baseline"]["reserved_tokens"] == 16
    assert report["fragmentation_tokens_saved_vs_contiguous"] == 4


def test_pool_too_small_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--block-size", "16", "--total-blocks", "2", "--request-tokens", "40"])
    assert exc.value.code == 2
    assert "need 3 blocks for 40 tokens, 2 free" in capsys.readouterr().err
