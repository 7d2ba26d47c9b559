"""A checkpoint's quantized projections under tensor parallelism: each rank slices the stored
codes and scales (engine/quant/slicing.py), and a TP=2 engine's greedy tokens equal Hugging
Face's over the dequantized weights, for 4-bit packed integers (asymmetric, groups of 32) and
block-scaled FP8, built in memory and read from GPTQ and FP8 checkpoint folders (where TP=2 also
equals TP=1). Slices whose edges would cut a group or a scale block, and row-parallel
slices of act-order weights, are refused by name. (Its own module: a TP engine holds the
process group until its module ends.)"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from paged_serve.engine import LLM, SamplingParams
from paged_serve.engine.model.experts_swap import experts_modules
from paged_serve.engine.model.loader import load_model, load_model_shard
from paged_serve.engine.model.sharding import RowParallelLinear, shard_model
from paged_serve.engine.quant.experts import StoredExperts
from paged_serve.engine.quant.linear import QuantizedLinear
from paged_serve.engine.quant.slicing import input_columns, output_rows
from paged_serve.engine.quant.weights import PackedInt, ScaledFp8, ScaledInt8
from paged_serve.kernels.reference import pack_int_ref
from tests.conftest import assert_pool_clean, hf_greedy, loaded, random_prompts, tiny_model
from tests.engine.quant.checkpoints import tiny_model as quant_tiny_model
from tests.engine.quant.checkpoints import write_fp8_block, write_gptq

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def packed_4bit(weight: torch.Tensor, group: int) -> tuple[PackedInt, torch.Tensor]:
    """``weight [N, K]`` as asymmetric 4-bit codes per ``group`` inputs, and the values they
    stand for (computed here, not by the layout's own dequantize)."""
    n, k = weight.shape
    w = weight.reshape(n, k // group, group)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    zero = (-lo / scale).round().clamp(0, 15)
    codes = (w / scale[..., None] + zero[..., None]).round().clamp(0, 15)
    values = ((codes - zero[..., None]) * scale[..., None]).reshape(n, k)
    layout = PackedInt(
        qweight=pack_int_ref(codes.reshape(n, k).t().to(torch.int32), 4),
        scales=scale.t().contiguous(),
        zeros=zero.t().to(torch.uint8).contiguous(),
        perm=None,
        bits=4,
        group_size=group,
    )
    return layout, values


def fp8_blocks(weight: torch.Tensor, block: int) -> tuple[ScaledFp8, torch.Tensor]:
    """``weight [N, K]`` as e4m3 with one scale per ``block x block`` tile, and its values."""
    n, k = weight.shape
    tiles = weight.reshape(n // block, block, k // block, block)
    scale = tiles.abs().amax((1, 3)) / 448.0
    per_element = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
    codes = (weight / per_element).to(torch.float8_e4m3fn)
    return ScaledFp8(codes, scale, (block, block)), codes.float() * per_element


def quantized_pair(kind: str) -> tuple[nn.Module, nn.Module]:
    """(a tiny llama whose decoder projections are ``QuantizedLinear``s of ``kind``, the HF
    reference holding the values they stand for)."""
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    for layer, ref_layer in zip(model.model.layers, reference.model.layers):
        for owner, ref_owner in (
            (layer.self_attn, ref_layer.self_attn),
            (layer.mlp, ref_layer.mlp),
        ):
            for name in PROJECTIONS:
                linear = getattr(owner, name, None)
                if linear is None:
                    continue
                make = packed_4bit if kind == "w4a16" else fp8_blocks
                layout, values = make(linear.weight.detach(), 32)
                setattr(owner, name, QuantizedLinear(layout, linear.bias))
                getattr(ref_owner, name).weight.data = values
    return model, reference


@pytest.mark.parametrize("kind", ["w4a16", "fp8-block"])
def test_tp2_slices_the_stored_weights_and_equals_hf_on_their_values(kind: str) -> None:
    model, reference = quantized_pair(kind)
    prompts = random_prompts([5, 17, 40], seed=4)
    tp2 = LLM(loaded=loaded(model), tensor_parallel_size=2, kv_cache_memory=2 << 20,
              cpu_decode_kernel=False)  # fmt: skip
    try:
        layer = tp2.engine.runner.model.model.layers[0]
        down = layer.mlp.down_proj
        assert isinstance(down, RowParallelLinear) and down.in_features == 128
        got = tp2.generate(prompts, GREEDY)
        assert [o.token_ids for o in got] == [hf_greedy(reference, p, MAX_TOKENS) for p in prompts]
        assert_pool_clean(tp2.engine.block_manager)
    finally:
        tp2.shutdown()


def test_slices_hold_the_values_of_the_whole_weight() -> None:
    torch.manual_seed(0)
    weight = torch.randn(96, 128)
    packed, _ = packed_4bit(weight, 32)
    fp8, _ = fp8_blocks(weight, 32)
    int8 = ScaledInt8(torch.randint(-127, 128, (96, 128), dtype=torch.int8), torch.rand(96))
    for layout in (packed, fp8, int8):
        whole = layout.dequantize()
        assert torch.equal(output_rows(layout, 32, 96).dequantize(), whole[32:96])
        assert torch.equal(input_columns(layout, 64, 128).dequantize(), whole[:, 64:128])
    channel = ScaledFp8(fp8.weight, torch.rand(96), None)
    assert torch.equal(output_rows(channel, 0, 48).dequantize(), channel.dequantize()[:48])
    assert torch.equal(input_columns(channel, 0, 64).dequantize(), channel.dequantize()[:, :64])


def test_slices_that_cut_a_group_a_block_or_an_act_order_weight_are_refused() -> None:
    torch.manual_seed(0)
    packed, _ = packed_4bit(torch.randn(64, 128), 32)
    with pytest.raises(ValueError, match="group of 32 inputs: input edge 48"):
        input_columns(packed, 48, 128)
    fp8, _ = fp8_blocks(torch.randn(64, 128), 32)
    with pytest.raises(ValueError, match="FP8 32-row scale block: output edge 16"):
        output_rows(fp8, 16, 64)
    sorted_rows = PackedInt(packed.qweight, packed.scales, packed.zeros, torch.randperm(128), 4, 32)
    with pytest.raises(ValueError, match="act-order"):
        input_columns(sorted_rows, 0, 64)
    # output rows of an act-order weight are whole columns: served
    assert output_rows(sorted_rows, 0, 32).perm is sorted_rows.perm


@pytest.mark.parametrize("kind", ["gptq-w4-g32-asym", "fp8-block-32", "gptq-moe-w4-g32"])
def test_tp2_on_a_checkpoint_folder_equals_tp1(kind: str, tmp_path) -> None:
    """The checkpoint as stored on disk: TP=2 (each rank reading its slices of the stored codes
    and scales; the MoE one whole, its stored experts then cut) gives TP=1's tokens and HF's
    over the dequantized weights."""
    if kind.startswith("gptq"):
        model = quant_tiny_model("qwen3_moe" if "moe" in kind else "llama")
        ckpt = write_gptq(model, tmp_path / kind, bits=4, group_size=32, sym="moe" in kind)
    else:
        model = tiny_model("llama")
        ckpt = write_fp8_block(model, tmp_path / kind, block=(32, 32))
    prompts = random_prompts([5, 40], seed=5)
    want = [hf_greedy(ckpt.reference, p, MAX_TOKENS) for p in prompts]
    runs = []
    for size in (1, 2):
        llm = LLM(str(ckpt.folder), tensor_parallel_size=size, kv_cache_memory=2 << 20,
                  dtype="float32", cpu_decode_kernel=False)  # fmt: skip
        try:
            assert llm.engine.loaded.quantization is not None
            # TP=2: each rank read its own slices of the stored tensors (MoE: loaded whole)
            per_rank = size == 2 and "moe" not in kind
            assert llm.engine.loaded.shard == ((0, 2) if per_rank else None)
            for experts in experts_modules(llm.engine.runner.model):  # cut in their stored layout
                assert isinstance(experts.down_proj, StoredExperts)
                assert experts.down_proj.shape[2] == model.config.moe_intermediate_size // size
            runs.append([o.token_ids for o in llm.generate(prompts, GREEDY)])
            assert_pool_clean(llm.engine.block_manager)
        finally:
            llm.shutdown()
    assert runs[0] == runs[1] == want


def test_a_ranks_shard_holds_the_slices_of_the_whole_checkpoint(tmp_path) -> None:
    """Read rank by rank (each projection sliced in its stored layout), the shards hold exactly
    the slices the whole model's projections are cut into (``shard_model``)."""
    ckpt = write_gptq(tiny_model("llama"), tmp_path / "gptq", bits=4, group_size=32, sym=False)
    whole = load_model(str(ckpt.folder), dtype=torch.float32, device=torch.device("cpu")).model
    for rank in (0, 1):
        cut = copy.deepcopy(whole)
        shard_model(cut, rank=rank, world_size=2)
        read = load_model_shard(
            str(ckpt.folder), dtype=torch.float32, rank=rank, world_size=2
        ).model
        attn, want = read.model.layers[1].self_attn, cut.model.layers[1].self_attn
        assert attn.q_proj.out_features == 128 and attn.o_proj.in_features == 128
        mlp, want_mlp = read.model.layers[0].mlp, cut.model.layers[0].mlp
        pairs = [(getattr(attn, n), getattr(want, n)) for n in ("q_proj", "k_proj", "v_proj")]
        pairs += [
            (attn.o_proj.proj, want.o_proj.proj),
            (mlp.down_proj.proj, want_mlp.down_proj.proj),
        ]
        for got, cut_from_whole in pairs:
            assert torch.equal(got.stored.dequantize(), cut_from_whole.stored.dequantize())
        for p, q in zip(read.parameters(), cut.parameters()):
            assert torch.equal(p, q)
