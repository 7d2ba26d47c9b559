"""What ``--kv-cache-dtype`` stores: the model's dtype (``auto``) or one-byte codes with an fp32
scale per token and KV head (vLLM's ``int8_per_token_head``/``fp8_per_token_head``).

A token's key (or value) of one KV head, ``x [head_dim]``, is stored as::

    scale = max|x| / QMAX          (1 where x is all zeros)
    code  = round(x / scale)       int8: to nearest, in [-127, 127]; fp8: the cast's rounding
    x'    = code * scale           what attention reads back

``QMAX`` is the code's largest magnitude: 127 (int8), 448 (fp8 e4m3), 57344 (fp8 e5m2). Each
row uses its code's whole range, so int8 keeps about 2 decimal digits of every row and e4m3
three significant bits; the KV cache's bytes per token fall to a quarter of fp32's (a half of
bf16's), plus 4 bytes a scale. A multi-head latent attention cache's entry (``kv_lora_rank +
qk_rope_head_dim`` lanes, one per token) is quantized as one head: one scale per token.
"""

from __future__ import annotations

import torch

from paged_serve.kernels.reference import KV_QMAX

# --kv-cache-dtype's names (vLLM's) and the code each stores; auto: the model's dtype
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "int8": torch.int8,
    "int8_per_token_head": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_per_token_head": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

QMAX = KV_QMAX  # a code's largest magnitude, by code dtype (the kernels' table)


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` holds codes with scales."""
    return dtype in QMAX


def kv_code_dtype(name: str) -> torch.dtype | None:
    """The code dtype ``--kv-cache-dtype name`` stores (None: the model's dtype); ValueError
    naming the choices for another name."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name]
