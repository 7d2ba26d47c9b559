"""A mixture-of-experts checkpoint whose experts are stored quantized (compressed-tensors:
4- and 8-bit packed integers, FP8 with block and channel scales) loads with its experts kept in
their stored layout (``StoredExperts``, engine/quant/experts.py), and serves the greedy tokens
of Hugging Face's fp32 model over the dequantized weights: on the CPU's torch backend (each
chosen expert dequantized for the call) and on the triton backend under the interpreter (the
fused MoE kernel dequantizing inside its tiles). Experts the kernel cannot read (act-order)
are dequantized at load instead, with the same tokens.

The checkpoint is the tiny Qwen3-MoE's, its experts' projections quantized here by rounding
(``gate_proj``/``up_proj`` 64 x 128 and ``down_proj`` 128 x 64, four experts, top-2)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from paged_serve.engine import LLM, SamplingParams
from paged_serve.engine.model.experts_swap import experts_modules
from paged_serve.engine.model.loader import load_model
from paged_serve.engine.model.sharding import shard_model
from paged_serve.engine.quant.experts import ExpertsNotStacked, StoredExperts, stack_experts
from paged_serve.engine.quant.weights import PackedInt, ScaledFp8, ScaledInt8
from paged_serve.kernels.interface import Fp8Experts, IntExperts
from paged_serve.kernels.reference import dequantize_experts_ref, pack_int_ref
from tests.conftest import assert_pool_clean, hf_greedy, random_prompts
from tests.engine.model.test_model_coverage import tiny_architecture

FP8_MAX = 448.0
PROMPTS = random_prompts([5, 19], seed=7)
MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

# id: compressed-tensors weights scheme (format pack-quantized for int, float-quantized for float)
SCHEMES = {
    "int4-sym-g32": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32},
    "int4-asym-g64": {
        "type": "int",
        "num_bits": 4,
        "strategy": "group",
        "group_size": 64,
        "symmetric": False,
    },
    "int8-sym-channel": {"type": "int", "num_bits": 8, "strategy": "channel"},
    # blocks of 128 rows: gate and up (64 rows each) are joined with a scale per row
    "fp8-block-128x128": {
        "type": "float",
        "num_bits": 8,
        "strategy": "block",
        "block_structure": [128, 128],
    },
    "fp8-channel": {"type": "float", "num_bits": 8, "strategy": "channel"},
}


def _pack_columns(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``[R, C]`` codes packed along the columns, low bits first: ``[R, C / pack]`` int32."""
    return pack_int_ref(values.t().contiguous(), bits).t().contiguous()


def _quantize_int(w: torch.Tensor, scheme: dict, act_order: bool, gen: torch.Generator):
    """``w [N, K]`` as compressed-tensors pack-quantized tensors, and their dequantized values."""
    bits, symmetric = scheme["num_bits"], scheme.get("symmetric", True)
    n, k = w.shape
    g = scheme.get("group_size", k) if scheme["strategy"] == "group" else k
    order = torch.randperm(k, generator=gen) if act_order else torch.arange(k)
    groups = w[:, order].reshape(n, k // g, g)  # act-order: group j holds inputs order[j*g:...]
    top = (1 << bits) - 1
    if symmetric:
        zero = torch.full(groups.shape[:-1], float(1 << (bits - 1)))
        scale = groups.abs().amax(-1) / ((1 << (bits - 1)) - 1)
    else:
        low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scale = (high - low) / top
        zero = torch.round(-low / scale).clamp(0, top)
    codes = (torch.round(groups / scale[..., None]) + zero[..., None]).clamp(0, top)
    deq_sorted = ((codes - zero[..., None]) * scale[..., None]).reshape(n, k)
    stored_codes = torch.empty(n, k, dtype=torch.int32)
    stored_codes[:, order] = codes.reshape(n, k).to(torch.int32)
    deq = torch.empty(n, k)
    deq[:, order] = deq_sorted
    tensors = {
        "weight_packed": _pack_columns(stored_codes, bits),
        "weight_scale": scale.contiguous(),  # [N, G]
        "weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }
    if not symmetric:
        tensors["weight_zero_point"] = pack_int_ref(zero.to(torch.int32), bits)  # [N/pack, G]
    if act_order:
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = (torch.arange(k) // g).to(torch.int32)
        tensors["weight_g_idx"] = g_idx
    return tensors, deq


def _quantize_fp8(w: torch.Tensor, scheme: dict):
    """``w [N, K]`` as compressed-tensors float-quantized tensors, and their dequantized values."""
    n, k = w.shape
    if scheme["strategy"] == "channel":
        scale = w.abs().amax(-1, keepdim=True) / FP8_MAX  # [N, 1]
        per_element = scale.expand(n, k)
    else:
        bn, bk = scheme["block_structure"]
        padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
        padded[:n, :k] = w.abs()
        scale = padded.view(padded.shape[0] // bn, bn, -1, bk).amax((1, 3)) / FP8_MAX
        per_element = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    weight = (w / per_element).to(torch.float8_e4m3fn)
    return {"weight": weight, "weight_scale": scale.contiguous()}, weight.float() * per_element


def quantized_checkpoint(folder: Path, scheme_id: str, *, act_order: bool = False):
    """Save the tiny Qwen3-MoE with its experts quantized by ``SCHEMES[scheme_id]``; returns HF's
    model over the dequantized expert weights."""
    scheme = SCHEMES[scheme_id]
    model = tiny_architecture("qwen3_moe")
    model.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(5)
    dequantized = {}
    for name in sorted(n for n in tensors if ".experts." in n and n.endswith(".weight")):
        prefix = name.removesuffix(".weight")
        w = tensors.pop(name).float()
        if scheme["type"] == "int":
            stored, dequantized[prefix] = _quantize_int(w, scheme, act_order, gen)
        else:
            stored, dequantized[prefix] = _quantize_fp8(w, scheme)
        tensors.update({f"{prefix}.{k}": v for k, v in stored.items()})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    storage = "pack-quantized" if scheme["type"] == "int" else "float-quantized"
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": storage,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["re:.*experts.*"],
                "weights": {**scheme, "actorder": "group" if act_order else None},
                "format": storage,
            }
        },
        "ignore": [],
    }
    (folder / "config.json").write_text(json.dumps(config))
    reference = copy.deepcopy(model)
    experts = {id(m) for m in experts_modules(reference)}
    for block, module in reference.named_modules():
        if id(module) not in experts:
            continue
        for e in range(module.gate_up_proj.shape[0]):
            gate, up = (dequantized[f"{block}.{e}.{p}"] for p in ("gate_proj", "up_proj"))
            module.gate_up_proj.data[e] = torch.cat([gate, up])
            module.down_proj.data[e] = dequantized[f"{block}.{e}.down_proj"]
    return reference


def _experts_of(llm: LLM) -> list:
    return experts_modules(llm.engine.runner.model)


def _assert_hf_tokens(llm: LLM, reference) -> None:
    got = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    assert got == [hf_greedy(reference, p, MAX_TOKENS) for p in PROMPTS]
    assert_pool_clean(llm.engine.block_manager)


@pytest.mark.parametrize("scheme_id", sorted(SCHEMES))
def test_cpu_serves_hf_tokens_over_the_dequantized_experts(tmp_path, scheme_id: str) -> None:
    reference = quantized_checkpoint(tmp_path, scheme_id)
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory=2 << 20)
    layout = IntExperts if scheme_id.startswith("int") else Fp8Experts
    for experts in _experts_of(llm):
        for proj in (experts.gate_up_proj, experts.down_proj):
            assert isinstance(proj, StoredExperts) and isinstance(proj.stored, layout)
        assert tuple(experts.gate_up_proj.shape) == (4, 128, 128)
        assert tuple(experts.down_proj.shape) == (4, 128, 64)
    if scheme_id == "fp8-block-128x128":  # 64-row parts in 128-row blocks: a scale per row
        assert _experts_of(llm)[0].gate_up_proj.stored.block == (1, 128)
        assert _experts_of(llm)[0].down_proj.stored.block == (128, 128)
    _assert_hf_tokens(llm, reference)


@pytest.mark.parametrize("scheme_id", ["int4-asym-g64", "fp8-block-128x128"])
def test_triton_kernel_serves_hf_tokens_over_the_dequantized_experts(tmp_path, scheme_id):
    reference = quantized_checkpoint(tmp_path, scheme_id)
    llm = LLM(
        model=str(tmp_path),
        dtype="float32",
        kv_cache_memory=2 << 20,
        attention_backend="triton",
        max_num_batched_tokens=24,
    )
    assert llm.engine.backend_name == "triton"
    assert all(isinstance(e.gate_up_proj, StoredExperts) for e in _experts_of(llm))
    _assert_hf_tokens(llm, reference)


def test_act_order_experts_are_dequantized_at_load(tmp_path, caplog) -> None:
    reference = quantized_checkpoint(tmp_path, "int4-sym-g32", act_order=True)
    with caplog.at_level("INFO", logger="paged_serve.engine.model.quantized_loading"):
        llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory=2 << 20)
    assert "act-order" in caplog.text
    for experts in _experts_of(llm):
        assert not isinstance(experts.gate_up_proj, StoredExperts)
    _assert_hf_tokens(llm, reference)


def test_stacking_refuses_what_the_kernel_cannot_read() -> None:
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (64, 32), generator=gen)
    scales = torch.rand(2, 32, generator=gen)

    def int4(group_size: int, perm=None) -> PackedInt:
        return PackedInt(pack_int_ref(codes, 4), scales, None, perm, 4, group_size)

    fp8 = ScaledFp8(torch.zeros(32, 64, dtype=torch.float8_e4m3fn), torch.ones(()), None)
    with pytest.raises(ExpertsNotStacked, match="act-order"):
        stack_experts([[int4(32, perm=torch.arange(64))]])
    with pytest.raises(ExpertsNotStacked, match="mix layouts"):
        stack_experts([[int4(32)], [fp8]])
    with pytest.raises(ExpertsNotStacked, match="group sizes differ"):
        stack_experts(
            [[int4(32)], [PackedInt(pack_int_ref(codes, 4), scales[:1], None, None, 4, -1)]]
        )
    stacked = stack_experts([[int4(32), int4(32)], [int4(32), int4(32)]])  # gate/up joined
    assert tuple(stacked.shape) == (2, 64, 64) and stacked.zeros is None
    per_tensor = stack_experts([[fp8, fp8]])
    assert per_tensor.block is None and tuple(per_tensor.scale.shape) == (1, 64)


def test_stacked_experts_stand_for_their_parts_joined() -> None:
    """Per expert, the stacked layout's dequantization is the parts' joined, exactly: int4 with
    and without zeros (written out), int8 W8A8 repacked as 8-bit codes, FP8 per tensor (a row
    scale) and in blocks taller than a part (a scale per row)."""
    gen = torch.Generator().manual_seed(1)

    def int4(zeros: bool) -> PackedInt:
        codes = torch.randint(0, 16, (64, 32), generator=gen)
        z = torch.randint(0, 16, (2, 32), generator=gen).to(torch.uint8) if zeros else None
        return PackedInt(pack_int_ref(codes, 4), torch.rand(2, 32, generator=gen), z, None, 4, 32)

    def fp8(block: tuple[int, int] | None) -> ScaledFp8:
        weight = torch.randn(48, 64, generator=gen).to(torch.float8_e4m3fn)
        if block is None:
            return ScaledFp8(weight, torch.rand((), generator=gen), None)
        shape = (-(-48 // block[0]), -(-64 // block[1]))
        return ScaledFp8(weight, torch.rand(shape, generator=gen), block)

    def int8() -> ScaledInt8:
        weight = torch.randint(-128, 128, (40, 64), generator=gen).to(torch.int8)
        return ScaledInt8(weight, torch.rand(40, generator=gen))

    cases = [
        [[int4(True), int4(False)], [int4(False), int4(True)]],
        [[int8(), int8()], [int8(), int8()]],
        [[fp8(None), fp8(None)], [fp8(None), fp8(None)]],
        [[fp8((128, 32)), fp8((128, 32))], [fp8((128, 32)), fp8((128, 32))]],
        [[fp8((32, 64))], [fp8((32, 64))]],
    ]
    for experts in cases:
        stacked = stack_experts(experts)
        want = torch.stack([torch.cat([p.dequantize() for p in parts]) for parts in experts])
        assert torch.equal(dequantize_experts_ref(stacked), want)
        got = StoredExperts(stacked)
        x = torch.randn(3, want.shape[2], generator=gen)
        for e in range(len(experts)):
            assert torch.equal(got.linear(x, e), torch.nn.functional.linear(x, want[e]))
    assert stack_experts(cases[3]).block == (1, 32)  # 48-row parts in 128-row blocks: per row
    assert stack_experts(cases[4]).block == (32, 64)  # a part alone keeps its blocks


@pytest.mark.parametrize("scheme", ["int4-sym-g32", "int8-sym-channel", "fp8-channel"])
def test_tensor_parallelism_slices_the_stored_experts(tmp_path, scheme: str) -> None:
    """Sharding cuts stored experts in their stored layout: each rank's gate/up rows and down
    columns dequantize to the same slices of the reference's (HF's dequantized) experts."""
    reference = quantized_checkpoint(tmp_path, scheme)
    model = load_model(str(tmp_path), dtype=torch.float32, device=torch.device("cpu")).model
    for rank in (0, 1):
        shard = copy.deepcopy(model)
        shard_model(shard, rank=rank, world_size=2)
        for got, want in zip(experts_modules(shard), experts_modules(reference), strict=True):
            assert isinstance(got.gate_up_proj, StoredExperts)
            part = want.down_proj.shape[2] // 2  # [E, H, I]
            lo, hi = rank * part, (rank + 1) * part
            gate_up = want.gate_up_proj  # [E, 2I, H]: gate rows, then up rows
            rows = torch.cat([gate_up[:, lo:hi], gate_up[:, 2 * part + lo : 2 * part + hi]], 1)
            assert torch.equal(dequantize_experts_ref(got.gate_up_proj.stored), rows)
            down = dequantize_experts_ref(got.down_proj.stored)
            assert torch.equal(down, want.down_proj[:, :, lo:hi])


def test_a_slice_that_would_cut_an_experts_group_is_refused(tmp_path) -> None:
    """Groups of 64 inputs over a 64-wide expert: half of it per rank would cut a group."""
    quantized_checkpoint(tmp_path, "int4-asym-g64")
    model = load_model(str(tmp_path), dtype=torch.float32, device=torch.device("cpu")).model
    with pytest.raises(ValueError, match="group of 64 inputs: input edge 32"):
        shard_model(model, rank=0, world_size=2)
