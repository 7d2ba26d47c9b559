"""Checkpoints stored quantized (GPTQ, AWQ, compressed-tensors, fine-grained FP8), loaded from
their folders by the engine: greedy tokens equal Hugging Face ``generate`` (fp32) over the
dequantized weights token for token, alone and batched, through chunked prefill, after
preemption and on the Triton backend (interpreted); the block pool is intact after every
scenario. ``--quantization`` is vLLM's override; options not served are refused by name before
any weight is read; a quantized tensor no projection reads is refused."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from paged_serve.engine import LLM, SamplingParams
from paged_serve.engine.model import quantized_loading
from paged_serve.engine.model.loader import load_model
from paged_serve.engine.platform.cpu.quantized_linears import IntGemmLinear
from paged_serve.engine.quant.linear import QuantizedLinear
from tests.conftest import assert_pool_clean, hf_greedy, random_prompts
from tests.engine.quant.checkpoints import (
    QuantizedCheckpoint,
    set_quantization_config,
    tiny_model,
    write_awq,
    write_compressed_tensors,
    write_fp8_block,
    write_gptq,
)

CPU = torch.device("cpu")
PROMPTS = random_prompts([5, 17, 33], seed=11)
STEPS = 8
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
KV = 2 << 20

Writer = Callable[[PreTrainedModel, Path], QuantizedCheckpoint]
# case -> (family, writer, what the engine reports, packed integer projections kept packed on the
# CPU: on the C integer GEMM)
CASES: dict[str, tuple[str, Writer, str, bool]] = {
    "gptq-w4-g32-asym": (
        "llama",
        lambda m, f: write_gptq(m, f, bits=4, group_size=32, sym=False),
        "gptq (W4A16 g32 asym)",
        True,
    ),
    "gptq-w4-act-order": (
        "llama",
        lambda m, f: write_gptq(m, f, bits=4, group_size=32, desc_act=True),
        "gptq (W4A16 g32)",
        True,
    ),
    "gptq-w8-channel-sym-bias": (
        "qwen2",
        lambda m, f: write_gptq(m, f, bits=8, group_size=-1),
        "gptq (W8A16 channel)",
        True,
    ),
    "gptq_v2-w4-g64-asym": (
        "qwen3",
        lambda m, f: write_gptq(
            m, f, bits=4, group_size=64, sym=False, checkpoint_format="gptq_v2"
        ),
        "gptq (W4A16 g64 asym)",
        True,
    ),
    "awq-g32": ("llama", lambda m, f: write_awq(m, f, group_size=32), "awq (W4A16 g32 asym)", True),
    "ct-w4a16-g32-asym": (
        "llama",
        lambda m, f: write_compressed_tensors(m, f, "W4A16_ASYM_G32"),
        "compressed-tensors (W4A16 g32 asym)",
        True,
    ),
    "ct-w4a16-channel": (
        "mistral",
        lambda m, f: write_compressed_tensors(m, f, "W4A16_CHANNEL"),
        "compressed-tensors (W4A16 channel)",
        True,
    ),
    "ct-w8a8-int8": (
        "llama",
        lambda m, f: write_compressed_tensors(m, f, "W8A8"),
        "compressed-tensors (INT8 W8A8 channel)",
        False,
    ),
    "ct-fp8-tensor": (
        "llama",
        lambda m, f: write_compressed_tensors(m, f, "FP8_TENSOR"),
        "compressed-tensors (FP8 W8A8 tensor)",
        False,
    ),
    "ct-fp8-channel": (
        "qwen3",
        lambda m, f: write_compressed_tensors(m, f, "FP8_DYNAMIC"),
        "compressed-tensors (FP8 W8A8 channel)",
        False,
    ),
    "ct-fp8-block": (
        "llama",
        lambda m, f: write_compressed_tensors(m, f, "FP8_BLOCK"),
        "compressed-tensors (FP8 W8A8 block 128x128)",
        False,
    ),
    # two config groups: the class-wide group listed first, a name pattern for down_proj second
    # (compressed-tensors gives a module the group naming it, whatever the order)
    "ct-two-groups": (
        "llama",
        lambda m, f: write_compressed_tensors(
            m,
            f,
            {"group_0": ("W4A16_G32", ["Linear"]), "group_1": ("W8A16", ["re:.*down_proj$"])},
        ),
        "compressed-tensors (W4A16 g32, W8A16 g128)",
        True,
    ),
    "fp8-block-128": (
        "llama",
        lambda m, f: write_fp8_block(m, f, block=(128, 128)),
        "fp8 (FP8 W8A8 block 128x128)",
        False,
    ),
    "fp8-block-uneven": (  # blocks that divide neither the rows nor the columns
        "qwen2",
        lambda m, f: write_fp8_block(m, f, block=(48, 80)),
        "fp8 (FP8 W8A8 block 48x80)",
        False,
    ),
    "gptq-moe-w4-g32": (
        "qwen3_moe",
        lambda m, f: write_gptq(m, f, bits=4, group_size=32),
        "gptq (W4A16 g32)",
        True,
    ),
    "fp8-moe-block-32": (
        "qwen3_moe",
        lambda m, f: write_fp8_block(m, f, block=(32, 32)),
        "fp8 (FP8 W8A8 block 32x32)",
        False,
    ),
}


def _written(factory: pytest.TempPathFactory, name: str) -> tuple[QuantizedCheckpoint, list]:
    family, writer, _, _ = CASES[name]
    ckpt = writer(tiny_model(family), factory.mktemp("quant") / name)
    return ckpt, [hf_greedy(ckpt.reference, p, STEPS) for p in PROMPTS]


_CACHE: dict[str, tuple[QuantizedCheckpoint, list]] = {}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory):
    """``written(case)``: the case's checkpoint and HF's greedy tokens for PROMPTS, written
    once per module."""

    def get(name: str) -> tuple[QuantizedCheckpoint, list]:
        if name not in _CACHE:
            _CACHE[name] = _written(tmp_path_factory, name)
        return _CACHE[name]

    yield get
    _CACHE.clear()


def _quantized(llm: LLM) -> list[QuantizedLinear]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]


def _on_the_cpu_int_gemm(llm: LLM) -> list[IntGemmLinear]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, IntGemmLinear)]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_hf_over_the_dequantized_weights(written, case: str) -> None:
    ckpt, want = written(case)
    llm = LLM(str(ckpt.folder), kv_cache_memory=KV, dtype="float32")
    # 4- and 8-bit packed projections stay packed on the CPU, on the C integer GEMM; FP8 and
    # int8 W8A8 are dequantized at load
    assert bool(_on_the_cpu_int_gemm(llm)) == CASES[case][3]
    assert not _quantized(llm)
    for prompt, tokens in zip(PROMPTS, want):
        [result] = llm.generate([prompt], GREEDY)
        assert result.token_ids == tokens
    assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == want
    assert_pool_clean(llm.engine.block_manager)


def test_chunked_prefill(written) -> None:
    """8 tokens a step: the long prompts in chunks beside the others' decodes."""
    ckpt, want = written("gptq-w4-act-order")
    llm = LLM(str(ckpt.folder), kv_cache_memory=KV, dtype="float32", max_num_batched_tokens=8)
    assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == want
    assert_pool_clean(llm.engine.block_manager)


def test_preemption(written) -> None:
    """A pool of 4 blocks admits four prompts of one block each; as each decodes into its second
    block the pool runs out, and requests are preempted and recomputed."""
    ckpt, _ = written("awq-g32")
    prompts = random_prompts([15, 14, 13, 15], seed=12)
    want = [hf_greedy(ckpt.reference, p, STEPS) for p in prompts]
    hf = ckpt.reference.config
    block_bytes = hf.num_hidden_layers * 2 * 16 * hf.num_key_value_heads * hf.head_dim * 4
    llm = LLM(str(ckpt.folder), kv_cache_memory=4 * block_bytes, dtype="float32",
              max_num_batched_tokens=64)  # fmt: skip
    assert llm.engine.block_manager.num_blocks == 4
    results = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_clean(llm.engine.block_manager)


def test_four_bit_on_the_triton_backend(written) -> None:
    """The W4A16 GEMM (interpreted on a CPU) with zero points and act-order's gathered inputs."""
    ckpt, want = written("gptq-w4-act-order")
    llm = LLM(str(ckpt.folder), kv_cache_memory=KV, dtype="float32", attention_backend="triton",
              max_num_batched_tokens=24)  # fmt: skip
    assert llm.engine.backend_name == "triton"
    packed = _quantized(llm)
    assert packed and all(m.kernel == "triton" for m in packed)
    assert any(m.stored.perm is not None for m in packed)
    prompts, steps = PROMPTS[:2], 4
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    assert [r.token_ids for r in llm.generate(prompts, params)] == [w[:steps] for w in want[:2]]
    assert_pool_clean(llm.engine.block_manager)


@pytest.mark.parametrize("case", ["gptq-w4-g32-asym", "ct-w8a8-int8", "fp8-block-128"])
def test_the_model_is_reported_quantized(written, case: str) -> None:
    ckpt, _ = written(case)
    loaded = load_model(str(ckpt.folder), dtype=torch.float32, device=CPU)
    assert loaded.quantization == CASES[case][2]


def test_an_unquantized_checkpoint_is_reported_so(written) -> None:
    ckpt, _ = written("awq-g32")
    loaded = load_model(str(ckpt.reference_folder()), dtype=torch.float32, device=CPU)
    assert loaded.quantization is None


# ---- --quantization -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case, flag",
    [("gptq-w4-g32-asym", "gptq_marlin"), ("gptq-w4-g32-asym", "gptq"),
     ("awq-g32", "awq_marlin"), ("ct-w8a8-int8", "compressed_tensors"),
     ("fp8-block-128", "fp8")],
)  # fmt: skip
def test_quantization_flag_naming_the_checkpoints_method_is_accepted(written, case, flag):
    ckpt, want = written(case)
    llm = LLM(str(ckpt.folder), kv_cache_memory=KV, dtype="float32", quantization=flag)
    [result] = llm.generate([PROMPTS[0]], GREEDY)
    assert result.token_ids == want[0]
    assert_pool_clean(llm.engine.block_manager)


@pytest.mark.parametrize(
    "case, flag, message",
    [
        ("gptq-w4-g32-asym", "awq", "--quantization awq: the checkpoint is stored as gptq"),
        ("awq-g32", "gptq_marlin", "--quantization gptq: the checkpoint is stored as awq"),
        ("fp8-block-128", "compressed-tensors", "is stored as fp8"),
        ("ct-fp8-tensor", "fp8", "is stored as compressed-tensors"),
    ],
)
def test_quantization_flag_naming_another_method_is_refused(written, case, flag, message):
    ckpt, _ = written(case)
    with pytest.raises(ValueError, match=message):
        LLM(str(ckpt.folder), kv_cache_memory=KV, dtype="float32", quantization=flag)


def test_quantization_flag_on_an_unquantized_checkpoint_is_refused(written) -> None:
    ckpt, _ = written("awq-g32")
    with pytest.raises(ValueError, match="--quantization gptq: the checkpoint is not stored"):
        load_model(str(ckpt.reference_folder()), dtype=torch.float32, device=CPU,
                   quantization="gptq")  # fmt: skip


# ---- refusals -----------------------------------------------------------------------------------


class WeightsRead(AssertionError):
    pass


@pytest.fixture
def no_weight_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a quantized checkpoint's tensors fails the test."""

    def opened(*args, **kwargs):
        raise WeightsRead("a weight was read")

    monkeypatch.setattr(quantized_loading, "OneFileAtATime", opened)


def _edited(ckpt: QuantizedCheckpoint, folder: Path, edit: Callable[[dict], None]) -> Path:
    """A copy of the checkpoint whose ``quantization_config`` ``edit`` changed in place."""
    shutil.copytree(ckpt.folder, folder)
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    edit(config)
    set_quantization_config(folder, config)
    return folder


def _first_group(key: str, value: object) -> Callable[[dict], None]:
    def edit(config: dict) -> None:
        group = next(iter(config["config_groups"].values()))
        group[key] = value

    return edit


REFUSALS = [
    ("gptq-w4-g32-asym", lambda c: c.update(bits=3), "gptq bits=3"),
    ("gptq-w4-g32-asym", lambda c: c.update(bits=2), "gptq bits=2"),
    ("gptq-w4-g32-asym", lambda c: c.update(checkpoint_format="marlin"), "format='marlin'"),
    ("gptq-w4-g32-asym", lambda c: c.update(dynamic={r"-:.*mlp.*": {}}), "gptq dynamic"),
    ("awq-g32", lambda c: c.update(version="gemv"), "awq version='gemv'"),
    ("awq-g32", lambda c: c.update(bits=8), "awq bits=8"),
    (
        "ct-w4a16-g32-asym",
        lambda c: c.update(sparsity_config={"format": "sparse-24-bitmask", "targets": ["Linear"]}),
        "sparsity_config format='sparse-24-bitmask'",
    ),
    (
        "ct-w4a16-g32-asym",
        lambda c: c.update(transform_config={"config_groups": {"u": {"type": "hadamard"}}}),
        "compressed-tensors transform_config",
    ),
    (
        "ct-fp8-tensor",
        lambda c: c.update(
            kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor",
                             "dynamic": False, "symmetric": True}  # fmt: skip
        ),
        "compressed-tensors kv_cache_scheme",
    ),
    (
        "ct-fp8-tensor",
        _first_group(
            "input_activations",
            {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
             "symmetric": True},
        ),  # fmt: skip
        "static activation scales",
    ),
    (
        "ct-w8a8-int8",
        _first_group(
            "input_activations",
            {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False,
             "symmetric": True},
        ),  # fmt: skip
        "static activation scales",
    ),
    ("ct-w4a16-g32-asym", _first_group("format", "nvfp4-pack-quantized"), "nvfp4-pack-quantized"),
    (
        "ct-w4a16-g32-asym",
        lambda c: c.update(quantization_status="frozen"),
        "quantization_status='frozen'",
    ),
    ("fp8-block-128", lambda c: c.update(activation_scheme="static"), "activation_scheme='static'"),
    ("fp8-block-128", lambda c: c.update(fmt="e5m2"), "fp8 fmt='e5m2'"),
    ("fp8-block-128", lambda c: c.update(quant_method="bitsandbytes"), "'bitsandbytes' is not"),
]  # fmt: skip


@pytest.mark.parametrize(
    "case, edit, option", REFUSALS, ids=[f"{r[0]}-{i}" for i, r in enumerate(REFUSALS)]
)
def test_options_not_served_are_refused_by_name_before_any_weight_is_read(
    written, tmp_path: Path, no_weight_read, case, edit, option
) -> None:
    ckpt, _ = written(case)
    folder = _edited(ckpt, tmp_path / "edited", edit)
    with pytest.raises(ValueError, match=f"quantization_config: .*{re.escape(option)}"):
        load_model(str(folder), dtype=torch.float32, device=CPU)


def test_the_refusal_check_would_see_a_weight_read(written, no_weight_read) -> None:
    """The control of the test above: a checkpoint served is read through what it patches."""
    ckpt, _ = written("gptq-w4-g32-asym")
    with pytest.raises(WeightsRead):
        load_model(str(ckpt.folder), dtype=torch.float32, device=CPU)


def test_a_quantized_tensor_of_no_projection_is_refused(written, tmp_path: Path) -> None:
    ckpt, _ = written("gptq-w4-g32-asym")
    folder = tmp_path / "extra"
    shutil.copytree(ckpt.folder, folder)
    tensors = load_file(folder / "model.safetensors")
    source = "model.layers.1.self_attn.o_proj"
    for suffix in ("qweight", "qzeros", "scales", "g_idx"):
        tensors[f"model.layers.1.self_attn.rope_proj.{suffix}"] = tensors[
            f"{source}.{suffix}"
        ].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"belong to no projection.*layers\.1\.self_attn\.rope_proj"
    ):
        load_model(str(folder), dtype=torch.float32, device=CPU)
