"""FP8 and int8 W8A8 checkpoints on the Triton backend (interpreted on the CPU): the projections
run the W8A8 GEMM (kernels/triton/scaled_gemm.py), whose activations are quantized per token
(and per block of inputs for block-scaled FP8), so the reference is Hugging Face over the
dequantized weights with each quantized projection's input quantized the same way first
(``kernels.reference``'s quantizers): greedy tokens equal, the pool intact."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from paged_serve.engine import LLM, SamplingParams
from paged_serve.engine.quant.linear import QuantizedLinear
from paged_serve.kernels.reference import quantize_fp8_rows_ref, quantize_int8_rows_ref
from tests.conftest import assert_pool_clean, hf_greedy, random_prompts
from tests.engine.quant.checkpoints import tiny_model, write_compressed_tensors, write_fp8_block

STEPS = 4
LOGPROB_ATOL = 1e-4  # fp32 sums in another order
PROMPTS = random_prompts([5, 19], seed=12)
PROJECTION = "_proj"  # every decoder-layer projection is stored quantized by the writers


def fake_quantized(x: torch.Tensor, kind: str, group: int | None) -> torch.Tensor:
    """``x [..., K]`` quantized per row (and ``group`` inputs) and dequantized, in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    if kind == "int8":
        codes, scales = quantize_int8_rows_ref(rows)
        values = codes.float() * scales
    else:
        codes, scales = quantize_fp8_rows_ref(rows, group_size=group)
        width = rows.shape[1] if group is None else group
        values = codes.float() * scales.repeat_interleave(width, 1)[:, : rows.shape[1]]
    return values.to(x.dtype).view_as(x)


def with_quantized_inputs(model: nn.Module, kind: str, group: int | None) -> nn.Module:
    """``model`` with each decoder-layer projection's input fake-quantized (in place)."""
    for name, module in model.model.layers.named_modules():
        if isinstance(module, nn.Linear) and name.endswith(PROJECTION):
            module.register_forward_pre_hook(
                lambda _m, args: (fake_quantized(args[0], kind, group),)
            )
    return model


def token_logprobs(model: nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """``model``'s log-probability of each of ``tokens`` following ``prompt`` and each other."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("case", ["fp8-block-32", "ct-w8a8-int8"])
def test_w8a8_on_the_triton_backend_equals_hf_over_quantized_inputs(case: str, tmp_path) -> None:
    model = tiny_model("llama")
    if case == "fp8-block-32":
        ckpt, kind, group = write_fp8_block(model, tmp_path / case, block=(32, 32)), "fp8", 32
    else:
        ckpt, kind, group = write_compressed_tensors(model, tmp_path / case, "W8A8"), "int8", None
    unquantized_inputs = copy.deepcopy(ckpt.reference)
    reference = with_quantized_inputs(ckpt.reference, kind, group)
    want = [hf_greedy(reference, p, STEPS) for p in PROMPTS]
    llm = LLM(str(ckpt.folder), kv_cache_memory=2 << 20, dtype="float32",
              attention_backend="triton", max_num_batched_tokens=24)  # fmt: skip
    try:
        projections = [
            m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)
        ]
        assert projections and all(m.kernel == "triton" for m in projections)
        params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, logprobs=0)
        results = llm.generate(PROMPTS, params)
        assert [r.token_ids for r in results] == want
        # the tokens' logprobs are those of the quantized inputs: the unquantized inputs' differ
        # by more than the tolerance, so the reference's quantization is what is checked
        for prompt, result in zip(PROMPTS, results):
            got = torch.tensor([t.logprob for t in result.logprobs])
            tokens = result.token_ids
            assert torch.allclose(got, token_logprobs(reference, prompt, tokens), atol=LOGPROB_ATOL)
            plain = token_logprobs(unquantized_inputs, prompt, tokens)
            assert (got - plain).abs().max() > 10 * LOGPROB_ATOL
        assert_pool_clean(llm.engine.block_manager)
    finally:
        llm.shutdown()
