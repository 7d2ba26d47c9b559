"""The fixture writers (``checkpoints.py``) store what the formats' specs say: packed words of
known codes are the spec's bit patterns, and each checkpoint's stored tensors, decoded here by
the specs' formulas (not by ``engine/quant/``), are exactly the reference model's weights."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.engine.quant.checkpoints import (
    AWQ_ORDER,
    QuantizedCheckpoint,
    act_order_g_idx,
    pack_columns,
    pack_rows,
    tiny_model,
    write_awq,
    write_compressed_tensors,
    write_fp8_block,
    write_gptq,
)

EXPERT = re.compile(r"(.*)\.experts\.(\d+)\.(\w+)\.weight")


def test_packing_puts_codes_where_the_specs_say() -> None:
    codes = torch.arange(1, 9)[:, None]  # 1..8 down K
    # GPTQ qweight: along K, low bits first -> nibbles 1..8 from the bottom
    assert pack_rows(codes, 4).item() == 0x87654321 - (1 << 32)
    assert pack_rows(torch.tensor([[1], [2], [3], [0xFF]]), 8).item() == 0xFF030201 - (1 << 32)
    # AWQ: nibble i of a word holds column AWQ_ORDER[i]
    assert AWQ_ORDER == (0, 2, 4, 6, 1, 3, 5, 7)
    assert pack_columns(torch.arange(8)[None, :], 4, AWQ_ORDER).item() == 0x75316420
    assert pack_columns(torch.arange(8)[None, :], 4).item() == 0x76543210


def test_act_order_groups_hold_group_size_inputs_each_out_of_order() -> None:
    g_idx = act_order_g_idx(128, 32, seed=3)
    assert g_idx.dtype == torch.int32
    assert torch.bincount(g_idx).tolist() == [32] * 4
    assert not torch.equal(g_idx, torch.arange(128, dtype=torch.int32) // 32)


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] int32 -> [R * 32 / bits, C]: code r * pack + i at bits i * bits of row r."""
    shifts = torch.arange(32 // bits) * bits
    values = (packed.long()[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return values.reshape(-1, packed.shape[1])


def _unpack_columns(packed: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    values = _unpack_rows(packed.t().contiguous(), bits).t()  # in-word order along columns
    if order is None:
        return values
    pack = 32 // bits
    words = values.reshape(values.shape[0], -1, pack)
    out = torch.empty_like(words)
    out[:, :, list(order)] = words  # nibble i is column order[i]
    return out.reshape(values.shape[0], -1)


def _decode_gptq(t: dict, prefix: str, bits: int, v1: bool) -> torch.Tensor:
    codes = _unpack_rows(t[f"{prefix}.qweight"], bits)  # [K, N]
    zeros = _unpack_columns(t[f"{prefix}.qzeros"], bits)  # [G, N]
    if v1:
        zeros = (zeros + 1) & ((1 << bits) - 1)
    g = t[f"{prefix}.g_idx"].long()
    scales = t[f"{prefix}.scales"]
    assert scales.dtype == torch.float16 and t[f"{prefix}.g_idx"].dtype == torch.int32
    return ((codes - zeros[g]).float() * scales.float()[g]).t()


def _decode_awq(t: dict, prefix: str, group_size: int) -> torch.Tensor:
    codes = _unpack_columns(t[f"{prefix}.qweight"], 4, AWQ_ORDER)  # [K, N]
    zeros = _unpack_columns(t[f"{prefix}.qzeros"], 4, AWQ_ORDER)
    g = torch.arange(codes.shape[0]) // group_size
    return ((codes - zeros[g]).float() * t[f"{prefix}.scales"].float()[g]).t()


def _decode_fp8_block(t: dict, prefix: str, block: tuple[int, int]) -> torch.Tensor:
    weight, scale = t[f"{prefix}.weight"], t[f"{prefix}.weight_scale_inv"]
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    n, k = weight.shape
    assert scale.shape == (-(-n // block[0]), -(-k // block[1]))
    rows = torch.arange(n)[:, None] // block[0]
    cols = torch.arange(k)[None, :] // block[1]
    return weight.float() * scale[rows, cols]


def _decode_compressed(t: dict, prefix: str) -> torch.Tensor:
    """compressed-tensors: pack-quantized (codes + 2^(bits-1) along K, zeros + 2^(bits-1) along
    N), int-quantized or float-quantized (weight and scale per tensor, row or block)."""
    scale = t[f"{prefix}.weight_scale"].float()
    if f"{prefix}.weight_packed" in t:
        n, k = t[f"{prefix}.weight_shape"].tolist()
        packed = t[f"{prefix}.weight_packed"]
        bits = 32 * packed.shape[1] // k
        codes = _unpack_columns(packed, bits)[:, :k]
        zeros = torch.full_like(scale, 1 << (bits - 1), dtype=torch.int64)
        if f"{prefix}.weight_zero_point" in t:
            zeros = _unpack_columns(t[f"{prefix}.weight_zero_point"].t().contiguous(), bits).t()
        g = torch.arange(k) // (k // scale.shape[1])
        return (codes - zeros[:, g]).float() * scale[:, g]
    weight = t[f"{prefix}.weight"]
    assert weight.dtype in (torch.int8, torch.float8_e4m3fn)
    n, k = weight.shape
    if scale.numel() == 1 or scale.shape == (n, 1):
        return weight.float() * scale
    rows = torch.arange(n)[:, None] // -(-n // scale.shape[0])
    cols = torch.arange(k)[None, :] // -(-k // scale.shape[1])
    return weight.float() * scale[rows, cols]


def _check_decodes(ckpt: QuantizedCheckpoint, decode, *, layers: int = 2) -> None:
    """Every quantized weight decodes to the reference's; every decoder projection is quantized;
    no stored ``.weight`` is left in full precision for a quantized projection."""
    tensors = load_file(ckpt.folder / "model.safetensors")
    assert len(ckpt.dequantized) >= 7 * layers
    for name, want in ckpt.dequantized.items():
        got = decode(tensors, name.removesuffix(".weight"))
        assert torch.equal(got, want), name
        if name in tensors:  # FP8/int8 keep the name, with another dtype
            assert tensors[name].dtype in (torch.float8_e4m3fn, torch.int8), name
    reference = dict(ckpt.reference.named_parameters())
    for name, want in ckpt.dequantized.items():
        if name in reference:
            assert torch.equal(reference[name], want), name
        else:  # MoE: HF fuses the stored per-expert parts into [E, out, in], gate before up
            block, expert, part = EXPERT.fullmatch(name).groups()
            fused = "down_proj" if part == "down_proj" else "gate_up_proj"
            rows = {"gate_proj": slice(0, want.shape[0]), "up_proj": slice(want.shape[0], None)}
            got = reference[f"{block}.experts.{fused}"][int(expert)]
            assert torch.equal(got[rows.get(part, slice(None))], want), name
    # the weights left out of quantization are the original model's
    assert torch.equal(reference["lm_head.weight"], tensors["lm_head.weight"])


@pytest.mark.parametrize(
    "bits, group_size, sym, desc_act, fmt",
    [
        (4, 32, False, False, "gptq"),
        (4, 32, True, True, "gptq"),
        (8, -1, True, False, "gptq"),
        (4, 64, False, False, "gptq_v2"),
    ],
)
def test_gptq_decodes_to_the_reference(tmp_path: Path, bits, group_size, sym, desc_act, fmt):
    ckpt = write_gptq(tiny_model("qwen2"), tmp_path / "m", bits=bits, group_size=group_size,
                      sym=sym, desc_act=desc_act, checkpoint_format=fmt)  # fmt: skip
    _check_decodes(ckpt, lambda t, p: _decode_gptq(t, p, bits, v1=fmt == "gptq"))
    tensors = load_file(ckpt.folder / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.bias" in tensors  # qwen2's biases stay beside
    if sym:  # the symmetric zero 2^(bits-1), stored minus one in v1
        zeros = _unpack_columns(tensors["model.layers.0.mlp.up_proj.qzeros"], bits)
        assert (zeros == (1 << (bits - 1)) - 1).all()


def test_gptq_moe_experts_decode_to_the_reference(tmp_path: Path) -> None:
    ckpt = write_gptq(tiny_model("qwen3_moe"), tmp_path / "m", bits=4, group_size=32)
    assert "model.layers.1.mlp.experts.3.down_proj.qweight" in load_file(
        ckpt.folder / "model.safetensors"
    )
    _check_decodes(ckpt, lambda t, p: _decode_gptq(t, p, 4, v1=True))


def test_awq_decodes_to_the_reference(tmp_path: Path) -> None:
    ckpt = write_awq(tiny_model("llama"), tmp_path / "m", group_size=32)
    _check_decodes(ckpt, lambda t, p: _decode_awq(t, p, 32))


@pytest.mark.parametrize("block", [(128, 128), (48, 80)])
def test_fp8_block_decodes_to_the_reference(tmp_path: Path, block) -> None:
    ckpt = write_fp8_block(tiny_model("llama"), tmp_path / "m", block=block)
    _check_decodes(ckpt, lambda t, p: _decode_fp8_block(t, p, block))


def test_fp8_block_moe_decodes_to_the_reference(tmp_path: Path) -> None:
    ckpt = write_fp8_block(tiny_model("qwen3_moe"), tmp_path / "m", block=(32, 32))
    _check_decodes(ckpt, lambda t, p: _decode_fp8_block(t, p, (32, 32)))


@pytest.mark.parametrize(
    "scheme, stored",
    [
        ("W4A16_ASYM_G32", {"weight_packed", "weight_scale", "weight_zero_point", "weight_shape"}),
        ("W4A16_CHANNEL", {"weight_packed", "weight_scale", "weight_shape"}),
        ("W8A16", {"weight_packed", "weight_scale", "weight_shape"}),
        ("W8A8", {"weight", "weight_scale"}),
        ("FP8_TENSOR", {"weight", "weight_scale"}),
        ("FP8_DYNAMIC", {"weight", "weight_scale"}),
        ("FP8_BLOCK", {"weight", "weight_scale"}),
    ],
)
def test_compressed_tensors_decode_to_the_reference(tmp_path: Path, scheme, stored) -> None:
    ckpt = write_compressed_tensors(tiny_model("llama"), tmp_path / "m", scheme)
    tensors = load_file(ckpt.folder / "model.safetensors")
    prefix = "model.layers.0.mlp.down_proj"
    assert {n.removeprefix(prefix + ".") for n in tensors if n.startswith(prefix)} == stored
    _check_decodes(ckpt, _decode_compressed)
