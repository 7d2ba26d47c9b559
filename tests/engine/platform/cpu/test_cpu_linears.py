"""The projections' CPU kernels. fp32 through each few-row kernel (the column split over the
cores, the packed copy) and the packed copy from 4 rows: ``F.linear``'s numbers up to
the last-bit rounding of another summation order (no further from fp64 than ``F.linear``); the
kernels chosen at load are ones every module runs. bf16 packed for oneDNN: bit for bit to 32
rows, to rounding past them. The engine's greedy tokens still equal Hugging Face for every
family."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paged_serve.engine.llm import LLM
from paged_serve.engine.model.packed_weights import packable
from paged_serve.engine.platform.cpu.linears import (
    CALIBRATION_MARGIN,
    FEW_ROW_KERNELS,
    FEW_ROWS,
    Fp32Linear,
    PackedLinear,
    choose_few_row_kernels,
    pick,
    restore_plain_linears,
    speed_up_cpu_linears,
)
from paged_serve.engine.sampling_params import SamplingParams
from tests.conftest import SWAPPED_DTYPES, TINY_FAMILIES, hf_greedy, loaded, tiny_model


def _linear(out_features: int, in_features: int, bias: bool) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(in_features, out_features, bias=bias).requires_grad_(False)


@pytest.mark.parametrize("kernel", FEW_ROW_KERNELS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("blocks", [2, 4])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (64, 128)])
def test_fp32_equals_f_linear_to_rounding(
    shape: tuple, blocks: int, bias: bool, kernel: str
) -> None:
    """Rows up to FEW_ROWS take the few-row kernel, more the packed copy. Each is an fp32 sum of
    the same products in some order: within the textbook bound for that against the fp64
    product, ``K * 2**-24 * sum_k |x_k w_k|`` (bf16-rounded products would be ~500x past it),
    as F.linear is."""
    linear = _linear(*shape, bias=bias)
    fp32 = Fp32Linear(linear, blocks)
    fp32.few_row_kernels = (kernel,) * FEW_ROWS
    weight = linear.weight.double()
    bias64 = None if linear.bias is None else linear.bias.double()
    for rows in (1, 2, FEW_ROWS, FEW_ROWS + 1, 8, 24, 300):
        for leading in ((rows,), (1, rows)):
            x = torch.randn(*leading, shape[1])
            got, want = fp32(x), linear(x)
            assert got.shape == want.shape == (*leading, shape[0])
            assert got.is_contiguous()
            truth = F.linear(x.double(), weight, bias64)
            # +1 term and ulp slack for the bias add and the final rounding
            magnitude = F.linear(
                x.double().abs(), weight.abs(), None if bias64 is None else bias64.abs()
            )
            bound = (shape[1] + 1) * 2.0**-24 * (magnitude + truth.abs())
            assert ((want.double() - truth).abs() <= bound).all()  # the bound holds for F.linear
            assert ((got.double() - truth).abs() <= bound).all()


def test_columns_only_where_the_outputs_divide_into_blocks() -> None:
    assert Fp32Linear(nn.Linear(8, 10), 2).kernels == FEW_ROW_KERNELS == ("columns", "packed")
    assert Fp32Linear(nn.Linear(8, 10), 4).kernels == ("packed",)
    assert Fp32Linear(nn.Linear(8, 10), 1).kernels == ("packed",)
    strided = nn.Linear(8, 10)
    strided.weight = nn.Parameter(torch.randn(8, 10).t())
    with pytest.raises(ValueError, match="contiguous"):
        Fp32Linear(strided, 2)


def test_the_choice_is_a_kernel_every_module_runs_per_row_count() -> None:
    """Every module gets the same choice per row count, the one its timings pick; where one
    module cannot split its outputs in 4 only ``packed`` is possible, and nothing is timed."""
    modules = [Fp32Linear(_linear(64, 32, bias=False), 4), Fp32Linear(_linear(16, 32, False), 4)]
    timings = choose_few_row_kernels(modules)
    assert sorted(timings) == list(range(1, FEW_ROWS + 1))
    for rows, per_kernel in timings.items():
        assert sorted(per_kernel) == ["columns", "packed"]
        assert all(0 < ms < float("inf") for ms in per_kernel.values())
        assert all(m.few_row_kernels[rows - 1] == pick(per_kernel) for m in modules)
    modules.append(Fp32Linear(_linear(10, 32, bias=False), 4))
    assert choose_few_row_kernels(modules) == {}
    assert all(m.few_row_kernels == ("packed",) * FEW_ROWS for m in modules)


def test_packed_stays_unless_another_kernel_is_clearly_faster() -> None:
    """Noise must not flip the choice between kernels about as fast: another kernel replaces
    ``packed`` only when it is more than CALIBRATION_MARGIN faster."""
    assert pick({"columns": 10.0 * (1 - CALIBRATION_MARGIN / 2), "packed": 10.0}) == "packed"
    assert pick({"columns": 10.0 * (1 - 2 * CALIBRATION_MARGIN), "packed": 10.0}) == "columns"
    assert pick({"columns": 11.0, "packed": 10.0}) == "packed"


def test_split_swaps_fp32_projections_and_keeps_the_head_tied(two_threads: None) -> None:
    model = tiny_model("llama")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    split = copy.deepcopy(model)
    linears = sum(type(m) is nn.Linear for m in split.modules())
    assert speed_up_cpu_linears(split) == linears
    assert speed_up_cpu_linears(split) == 0  # nothing plain is left
    assert all(type(m) is not nn.Linear for m in split.modules())
    head = split.get_output_embeddings()
    assert isinstance(head, Fp32Linear)
    assert head.weight.data_ptr() == split.get_input_embeddings().weight.data_ptr()
    ids = torch.tensor([[3, 17, 92, 5, 44, 8]])
    with torch.inference_mode():
        for rows in (ids, ids[:, :1]):
            torch.testing.assert_close(split(rows).logits, model(rows).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", SWAPPED_DTYPES)
def test_a_prepared_model_deep_copies_and_pickles(dtype: torch.dtype, two_threads: None) -> None:
    """Packed weights are opaque to copy and pickle: the copies carry them dense (or rebuild
    them from the Parameters) and compute the same logits; a copied split views its own
    weight."""
    model = tiny_model("llama").to(dtype)
    assert speed_up_cpu_linears(model) > 0
    ids = torch.tensor([[3, 17, 92, 5, 44, 8]])
    with torch.inference_mode():
        want = [model(rows).logits for rows in (ids, ids[:, :2])]
        for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            for rows, expected in zip((ids, ids[:, :2]), want):
                assert torch.equal(twin(rows).logits, expected)
            if dtype == torch.float32:
                fp32 = twin.model.layers[0].mlp.down_proj
                assert fp32._blocks.data_ptr() == fp32.weight.data_ptr()
                assert fp32.few_row_kernels == model.model.layers[0].mlp.down_proj.few_row_kernels


def test_other_dtypes_are_left_alone_and_one_thread_has_no_columns(two_threads: None) -> None:
    assert speed_up_cpu_linears(tiny_model("llama").to(torch.float16)) == 0
    torch.set_num_threads(1)
    model = tiny_model("llama")
    assert speed_up_cpu_linears(model) > 0
    fp32 = [m for m in model.modules() if isinstance(m, Fp32Linear)]
    assert fp32 and all(m.kernels == ("packed",) for m in fp32)
    assert all(m.few_row_kernels == ("packed",) * FEW_ROWS for m in fp32)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_f_linear_bit_for_bit_to_32_rows_and_to_rounding_past_them(
    bias: bool,
) -> None:
    """To 32 rows (decode steps, small batches) the packed product is ``F.linear``'s bit for
    bit. Past them oneDNN may multiply the unpacked weight with another kernel (AMX tiles on an
    Intel box) whose fp32 partial sums come in another order, so the two can round to
    neighbouring bf16 values: each stays within half a bf16 step of the exact product plus
    fp32's bound for summing ``K`` terms."""
    linear = _linear(960, 576, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(linear)
    weight = linear.weight.double()
    bias64 = None if linear.bias is None else linear.bias.double()
    for rows in (1, 2, 3, 8, 24, 32, 33, 100, 300):
        x = torch.randn(1, rows, 576, dtype=torch.bfloat16)
        got, want = packed(x), linear(x)
        if rows <= 32:
            assert torch.equal(got, want)
        truth = F.linear(x.double(), weight, bias64)
        sums = x.double().abs() @ weight.abs().T
        bound = 2.0**-8 * truth.abs() + 576 * 2.0**-24 * sums + 1e-30
        for y in (got, want):
            assert ((y.double() - truth).abs() <= bound).all()
    assert torch.equal(packed(x[0, :8]), linear(x[0, :8]))  # 2-D input


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_packing_a_bf16_model_keeps_its_logits_bit_for_bit(family: str) -> None:
    """Where oneDNN has no bf16 path (an AVX2-only CPU) nothing is swapped, and the logits are
    still the model's."""
    model = tiny_model(family).to(torch.bfloat16)
    packed = copy.deepcopy(model)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    if packable(torch.bfloat16):
        assert speed_up_cpu_linears(packed) == linears
        assert isinstance(packed.get_output_embeddings(), PackedLinear)
        assert not any(type(m) is nn.Linear for m in packed.modules())
    else:
        assert speed_up_cpu_linears(packed) == 0
        assert sum(type(m) is nn.Linear for m in packed.modules()) == linears
    ids = torch.tensor([[3, 17, 92, 5, 44, 8]])
    with torch.inference_mode():
        assert torch.equal(packed(ids).logits, model(ids).logits)


@pytest.mark.parametrize("dtype", SWAPPED_DTYPES)
def test_restore_gives_back_plain_linears_with_the_same_weights(
    dtype: torch.dtype, two_threads: None
) -> None:
    model = tiny_model("qwen2").to(dtype)  # q/k/v with biases
    swapped = copy.deepcopy(model)
    count = speed_up_cpu_linears(swapped)
    assert restore_plain_linears(swapped) == count > 0
    assert all(not isinstance(m, (Fp32Linear, PackedLinear)) for m in swapped.modules())
    want = dict(model.named_parameters())
    got = dict(swapped.named_parameters())
    assert got.keys() == want.keys()
    assert all(torch.equal(got[name], want[name]) for name in want)


@pytest.mark.parametrize("kernel", FEW_ROW_KERNELS)
@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_engine_with_fp32_kernels_equals_hf_greedy(
    family: str, kernel: str, two_threads: None
) -> None:
    model = tiny_model(family)
    prompts = [[5, 9, 33, 70, 2], list(range(10, 41)), [7] * 3]
    llm = LLM(loaded=loaded(model), kv_cache_memory=2 << 20, max_num_batched_tokens=16)
    runner_model = llm.engine.runner.model
    assert isinstance(runner_model.model.layers[0].self_attn.qkv_proj.proj, Fp32Linear)
    assert isinstance(runner_model.get_output_embeddings(), Fp32Linear)
    for m in runner_model.modules():
        if isinstance(m, Fp32Linear):
            m.few_row_kernels = (kernel,) * FEW_ROWS
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, prompt, 12)
