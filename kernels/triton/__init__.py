"""The Triton kernels, one family per file, each with its typed, keyword-only launcher.

* attention: ``paged_attention.py`` (decode tokens and ragged prefill chunks over a block-table
  KV cache, split-KV for long contexts) with its input checks in ``attention_checks.py``;
  ``mla_attention.py`` (multi-head latent attention over a paged latent cache).
* the KV cache: ``kv_write.py`` (the step's keys and values into their slots) and
  ``block_copy.py`` (copy-on-write block copies).
* linear attention (gated DeltaNet): ``causal_conv.py`` (the depthwise causal convolution over
  each sequence's window) and ``delta_rule.py`` (the gated delta rule over each sequence's
  recurrent state).
* ``fused_moe.py``: mixture of experts as two grouped GEMMs over the routed pairs.
* ``quantized_gemm.py``: the weight-only quantized GEMM (W4A16 / W8A16), the weight
  dequantized inside the tile.
* ``lora.py``: batched multi-LoRA, each token through its own adapter slot (shrink through A,
  expand through B into the output).
* sampling: ``sampling.py`` (temperature, top-k, top-p, min-p, grammar masks and the draw, one
  program per row), ``sampling_split.py`` (the same draw with a large vocabulary's rows split
  over many programs) and ``sampling_passes.py`` (the ``@triton.jit`` passes both run).
* ``runtime.py``: where the kernels can run (CUDA, or the CPU under ``TRITON_INTERPRET=1``).
"""
