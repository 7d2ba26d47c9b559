"""``--dtype auto``: bf16 where the CPU multiplies bf16 natively, fp32 elsewhere, said at start;
an explicit dtype always wins."""

from __future__ import annotations

import logging

import pytest
import torch

import paged_serve.engine.platform.dtype_choice as dtype_choice
from paged_serve.engine.config import EngineConfig
from paged_serve.engine.llm_engine import LLMEngine
from paged_serve.engine.platform.dtype_choice import choose_dtype, native_bf16_features
from tests.conftest import tiny_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Llama checkpoint on disk, so the engine loads it itself (in the chosen dtype)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    return path


def _caps(monkeypatch: pytest.MonkeyPatch, **flags: bool) -> None:
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: dict(flags))


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"avx512_bf16": True, "amx_bf16": False}, torch.bfloat16),
        ({"avx512_bf16": False, "amx_bf16": True}, torch.bfloat16),
        ({"avx512_bf16": False, "amx_bf16": False, "avx2": True}, torch.float32),
        ({}, torch.float32),
    ],
)
def test_auto_on_cpu_follows_native_bf16(monkeypatch, flags, expected) -> None:
    _caps(monkeypatch, **flags)
    choice = choose_dtype("auto", CPU)
    assert choice.dtype == expected
    assert choice.reason.startswith("auto:")
    if expected == torch.bfloat16:
        assert "float32" in choice.reason  # says how to get exact HF fp32 tokens


def test_explicit_dtypes_win_over_the_cpu(monkeypatch) -> None:
    _caps(monkeypatch, avx512_bf16=True)
    assert choose_dtype("float32", CPU).dtype == torch.float32
    _caps(monkeypatch)
    assert choose_dtype("bfloat16", CPU).dtype == torch.bfloat16
    assert choose_dtype("float16", CPU).dtype == torch.float16


def test_auto_on_cuda_is_bf16(monkeypatch) -> None:
    _caps(monkeypatch)
    assert choose_dtype("auto", torch.device("cuda")).dtype == torch.bfloat16


def test_no_capability_reader_means_no_native_bf16(monkeypatch) -> None:
    def broken() -> dict:
        raise RuntimeError("no cpuinfo")

    monkeypatch.setattr(torch.cpu, "get_capabilities", broken)
    assert native_bf16_features() == ()


def test_this_machine_reports_what_torch_sees() -> None:
    caps = torch.cpu.get_capabilities()
    assert native_bf16_features() == tuple(
        name for name in dtype_choice.NATIVE_BF16_FEATURES if caps.get(name)
    )


@pytest.mark.parametrize(("asked", "native", "expected"), [
    ("auto", True, torch.bfloat16),
    ("auto", False, torch.float32),
    ("float32", True, torch.float32),
])  # fmt: skip
def test_the_engine_loads_and_logs_the_choice(
    monkeypatch, caplog, tiny_model_dir, asked, native, expected
) -> None:
    _caps(monkeypatch, avx512_bf16=native)
    with caplog.at_level(logging.INFO, logger="paged_serve.engine.runner.build"):
        engine = LLMEngine(
            EngineConfig(model=str(tiny_model_dir), dtype=asked, kv_cache_memory=1 << 20)
        )
    assert next(engine.runner.model.parameters()).dtype == expected
    name = str(expected).removeprefix("torch.")
    assert any(r.getMessage().startswith(f"weights in {name} (") for r in caplog.records)
