"""The kernels build for sm_90 without register spills: ``ci/aot_compile.py``, no GPU needed.

fp32 attention is only for exactness tests, but ``ci/gpu-check.sh`` runs those inside a time
budget, and with fp16's tiles (64 keys per step, 4 warps) the fp32 builds spilled up to 18 KB
per thread. The check compiles what the launchers would launch for sm_90 and reads ptxas'
register and spill counts; it runs in a child process because the kernels must be compiled,
not interpreted. The second test shows the check sees spills when there are some.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton import knobs

REPO = Path(__file__).resolve().parents[2]

try:
    _PTXAS = Path(knobs.nvidia.ptxas_blackwell.path)
except (AttributeError, RuntimeError):  # a Triton without its bundled CUDA tools
    _PTXAS = None
pytestmark = [
    pytest.mark.skipif(
        _PTXAS is None or not _PTXAS.exists(), reason="needs Triton's bundled ptxas"
    ),
    # CPU CI runs this check; a GPU machine's time (ci/gpu-check.sh) goes to what needs one.
    pytest.mark.skipif(torch.cuda.is_available(), reason="checked without a GPU, in CPU CI"),
]


def aot_compile(*args: str) -> tuple[int, list[dict]]:
    """Run the check; returns (exit code, one dict per build)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "ci" / "aot_compile.py"), "--json", "--jobs", "2", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, proc.stdout + proc.stderr
    return proc.returncode, rows


def test_fp32_attention_and_sampling_build_without_spills():
    """Paged attention, DeepSeek-V3's MLA (decode, split decode, prefill), Qwen3-Next's gated
    delta rule (fp32 takes the recurrent kernel on a GPU) and convolution, Mamba-2's scan (the
    recurrent kernel likewise), and sampling."""
    rc, rows = aot_compile(
        "--dtypes", "fp32", "--head-dims", "64,80,128,256", "--groups", "1,8", "--vocabs", "1000"
    )
    assert len(rows) == 4 * (2 * 2 + 2) + 3 + 3 + 1
    assert sum(r["config"].startswith("mla fp32 R=512+64 H=128") for r in rows) == 3
    assert {
        "delta rule fp32 D=128 recurrent",
        "causal conv fp32 K=4",
        "ssd scan fp32 P=64 N=128 recurrent",
    } <= {r["config"] for r in rows}
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad
    assert rc == 0
    assert all(r["registers"] <= 255 and r["spill_stores"] == 0 for r in rows)


def test_bf16_gated_deltanet_and_split_sampling_kernels_build_without_spills():
    """The chunked delta rule's tensor-core tiles (16 tokens x 32 value lanes, 8 warps) at
    Qwen3-Next's 128-lane heads, beside the recurrent kernel and the convolution; Mamba-2's
    scan kernels (32 tokens x 16 lanes of P = 64, N = 128, 8 warps); every phase of the
    split-row sampler at V = 151936."""
    rc, rows = aot_compile(
        "--dtypes", "bf16", "--head-dims", "128", "--groups", "1", "--vocabs", "151936"
    )  # fmt: skip
    split = [r["config"] for r in rows if r["config"].startswith("sampling split")]
    assert split == [
        f"sampling split V=151936 {phase}"
        for phase in ("max", "sums", "top-k", "top-p", "race", "final")
    ]
    linear = [r for r in rows if r["config"].startswith(("delta rule", "causal conv"))]
    assert [r["config"] for r in linear] == [
        "delta rule bf16 D=128 recurrent",
        "delta rule bf16 D=128 chunked",
        "causal conv bf16 K=4",
    ]
    ssd = [r["config"] for r in rows if r["config"].startswith("ssd scan")]
    assert ssd == ["ssd scan bf16 P=64 N=128 recurrent", "ssd scan bf16 P=64 N=128 chunked"]
    assert all(r["ok"] for r in rows), rows
    assert rc == 0


def test_the_check_sees_the_spills_of_fp16_sized_fp32_tiles():
    rc, rows = aot_compile(
        "--dtypes", "fp32", "--head-dims", "128", "--groups", "1", "--vocabs", "",
        "--tiles", "64,4,3,0",
    )  # fmt: skip
    prefill = next(r for r in rows if r["config"].startswith("attention fp32 D=128 G=1 prefill"))
    assert prefill["spill_stores"] > 1000 and not prefill["ok"]
    assert rc == 1


def test_attention_over_a_quantized_cache_builds_without_spills():
    """e4m3 codes dequantized in the tile load, at head dim 256 and group 8: fp32 (one stage)
    and bf16 (two), the stage counts ``attention_tiles`` takes for a quantized cache, where the
    unquantized ones spilled (fp32: 700-900 B; bf16 decode: 8 B). MLA over an e4m3 latent cache
    at DeepSeek-V3's shape: fp32 unpipelined with 168 registers (``mla_launch``; else 5 KB
    spilled), bf16 as it comes."""
    rc, rows = aot_compile(
        "--dtypes", "fp32,bf16", "--head-dims", "256", "--groups", "8", "--vocabs", "",
        "--kv-codes", "e4m3",
    )  # fmt: skip
    quantized = [r for r in rows if r["config"].endswith("kv=e4m3")]
    assert sum(r["config"].startswith("attention") for r in quantized) == 6
    assert sum(r["config"].startswith("mla") for r in quantized) == 6
    assert all(r["ok"] for r in quantized), quantized
    assert rc == 0
