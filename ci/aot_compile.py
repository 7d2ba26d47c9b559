"""Compile the kernels for sm_90 without a GPU; report registers, spills and shared memory.

    python ci/aot_compile.py [--dtypes fp32,fp16,bf16] [--head-dims 64,80,96,128,256]
                             [--groups 1,4,8,16] [--vocabs 1000,32000,151936] [--jobs N] [--json]
                             [--tiles TILE_N,NUM_WARPS,NUM_STAGES,MAXNREG] [--token-mask]
                             [--kv-codes int8,e4m3,e5m2]

A configuration is compiled as the launcher would launch it: the attention kernel's
compile-time arguments and options come from
``paged_serve.kernels.triton.paged_attention.attention_launch`` (the record the launcher uses), the
MLA kernel's (DeepSeek-V3's 128 heads and 512 + 64 latent, per dtype: decode, split decode, prefill)
from ``paged_serve.kernels.triton.mla_attention.mla_launch``, the gated DeltaNet kernels'
(Qwen3-Next's 128-lane key and value heads: recurrent and chunked delta rule, the 4-wide causal
convolution) from ``delta_rule_constants`` and ``conv_constants``, Mamba-2's scan kernels (P = 64,
N = 128: recurrent and chunked) from ``ssd_constants``, and
the sampling tile from ``paged_serve.kernels.triton.sampling`` (and, for vocabularies above its
slice, every phase of the split-row sampler, ``paged_serve.kernels.triton.sampling_split``),
pointers and the strides a contiguous cache makes multiples of 16 carry the JIT's launch-time
``tt.divisibility=16`` specialisation, and the target is ``GPUTarget("cuda", 90, 32)``. ptxas
(the one Triton itself runs for sm_90) is run again with ``-v`` on the PTX for the registers,
spill stores/loads and stack of each kernel. Prints one row per configuration; exits 1 if any
configuration spills, fails to compile or needs more shared memory than sm_90 has. ``--tiles``
replaces the launcher's attention ``tile_n``, warps, stages and ``maxnreg`` (0: ptxas' own
choice), to compare candidates. The sampling kernel is built without a grammar token mask (the
build every unconstrained batch runs); ``--token-mask`` adds the ``HAS_MASK`` build of each vocab.
``--kv-codes`` adds, per code type, dtype and head dim, the attention builds over a quantized
KV cache (``QUANT``: int8 / fp8 codes dequantized as each tile loads) for the largest group:
decode, split decode, and windowed split prefill; and per code type and dtype the MLA builds
over a quantized latent cache (its ``QUANT``: per-token scales on scores and weights).

The interpreter never compiles, so this is the only check of resource use that needs no GPU.
It proves nothing numerical: agreement on a GPU is what the ``cuda`` tests check.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, never interpret (before triton loads)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SM90_SHARED_BYTES = 227 * 1024  # opt-in shared memory per block on sm_90
DTYPES = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16"}
KV_CODES = {"int8": "*i8", "e4m3": "*fp8e4nv", "e5m2": "*fp8e5"}  # a quantized cache's codes
SSD_STATE = 128  # Mamba-2's state size N (2.7B, Codestral Mamba, Nemotron-H)


@dataclass(frozen=True)
class Config:
    """One kernel build: ``kind`` is ``attention``, ``mla`` (``group`` is its query heads),
    ``delta`` or ``ssd`` (``decode_only``: the recurrent kernel, else the chunked one; ``head_dim``
    is ssd's P), ``conv`` or ``sampling``."""

    kind: str
    dtype: str = "fp32"
    head_dim: int = 128
    group: int = 1
    decode_only: bool = True
    split: bool = False
    window: bool = False
    vocab: int = 0
    token_mask: bool = False  # sampling: the HAS_MASK build (grammar-constrained rows)
    tiles: tuple[int, ...] | None = None  # (tile_n, num_warps, num_stages, maxnreg) override
    latent: int = 0  # mla: kv_lora_rank + rope lanes of a latent cache entry
    rope: int = 0
    phase: int = 0  # sampling split: the phase (MAX .. FINAL), level 7 for the radix walks
    kv_codes: str = ""  # attention over a quantized cache: its codes (KV_CODES), "" for none

    @property
    def name(self) -> str:
        if self.kind == "sampling":
            return f"sampling V={self.vocab}" + " mask" * self.token_mask
        if self.kind == "sampling_split":
            phases = ("max", "sums", "top-k", "top-p", "race", "final")
            return f"sampling split V={self.vocab} {phases[self.phase]}"
        mode = "decode" if self.decode_only else "prefill"
        extra = "".join((" split" if self.split else "", " window" if self.window else ""))
        if self.kind == "mla":
            extra += f" kv={self.kv_codes}" if self.kv_codes else ""
            return f"mla {self.dtype} R={self.latent}+{self.rope} H={self.group} {mode}{extra}"
        if self.kind == "delta":
            kernel = "recurrent" if self.decode_only else "chunked"
            return f"delta rule {self.dtype} D={self.head_dim} {kernel}"
        if self.kind == "conv":
            return f"causal conv {self.dtype} K=4"
        if self.kind == "ssd":
            kernel = "recurrent" if self.decode_only else "chunked"
            return f"ssd scan {self.dtype} P={self.head_dim} N={SSD_STATE} {kernel}"
        tiles = f" tiles={','.join(map(str, self.tiles))}" if self.tiles else ""
        extra += f" kv={self.kv_codes}" if self.kv_codes else ""
        return f"attention {self.dtype} D={self.head_dim} G={self.group} {mode}{extra}{tiles}"


@dataclass(frozen=True)
class Resources:
    """What ptxas reports for one build (bytes, except ``registers``)."""

    config: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    shared: int
    error: str = ""

    @property
    def ok(self) -> bool:
        return (
            not self.error
            and self.spill_stores == 0
            and self.spill_loads == 0
            and self.shared <= SM90_SHARED_BYTES
        )


def _attention_source(cfg: Config):
    import torch
    from triton.compiler import ASTSource

    from paged_serve.kernels.triton.attention_checks import AttentionShapes
    from paged_serve.kernels.triton.paged_attention import _paged_attention_kernel, attention_launch

    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    # One sequence of one KV head: only the launch settings matter, not the grid.
    shapes = AttentionShapes(
        num_tokens=1,
        num_q_heads=cfg.group,
        num_kv_heads=1,
        head_dim=cfg.head_dim,
        block_size=16,
        num_seqs=1,
    )
    launch = attention_launch(
        shapes,
        dtype=torch_dtype[cfg.dtype],
        max_seqlen_q=1 if cfg.decode_only else 2,
        max_seqlen_k=1,
        sliding_window=1 if cfg.window else None,
        num_kv_splits=2 if cfg.split else 1,
        quantized=bool(cfg.kv_codes),
    )
    if cfg.tiles is not None:
        tile_n, num_warps, num_stages, maxnreg = cfg.tiles
        tiles = replace(
            launch.tiles,
            tile_n=tile_n,
            num_warps=num_warps,
            num_stages=num_stages,
            maxnreg=maxnreg or None,
        )
        launch = replace(launch, tiles=tiles)
    constants = launch.constexprs()
    # Strides of contiguous [.., H, D] tensors are multiples of D; block_tables' row stride and
    # the scalar sizes are left unspecialised.
    aligned = {"stride_qt", "stride_qh", "stride_ot", "stride_oh"}
    aligned |= {"stride_cache_block", "stride_cache_slot", "stride_cache_head"}
    int_ptrs = {"block_tables_ptr", "seq_lens_ptr", "cu_seqlens_q_ptr", "tickets_ptr"}
    signature, attrs = {}, {}
    for i, arg in enumerate(_paged_attention_kernel.arg_names):
        if arg in constants:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            fp32_scratch = arg.startswith("part_") or arg == "sinks_ptr" or "_scale_" in arg
            dtype = "*i32" if arg in int_ptrs else "*fp32" if fp32_scratch else DTYPES[cfg.dtype]
            if cfg.kv_codes and arg in ("k_cache_ptr", "v_cache_ptr"):
                dtype = KV_CODES[cfg.kv_codes]
            signature[arg] = dtype
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            fp32_args = {"scale_log2", "softcap_in", "softcap_out"}
            signature[arg] = "fp32" if arg in fp32_args else "i32"
            if arg in aligned and cfg.head_dim % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(_paged_attention_kernel, signature, constants, attrs), launch.options()


def _mla_source(cfg: Config):
    import torch
    from triton.compiler import ASTSource

    from paged_serve.kernels.triton.mla_attention import (
        MlaShapes,
        _mla_attention_kernel,
        mla_launch,
    )

    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    shapes = MlaShapes(1, cfg.group, cfg.latent, cfg.rope, 64, 1)
    launch = mla_launch(
        shapes,
        dtype=torch_dtype[cfg.dtype],
        max_seqlen_q=1 if cfg.decode_only else 2,
        max_seqlen_k=1,
        num_kv_splits=2 if cfg.split else 1,
        num_sms=132,
        quantized=bool(cfg.kv_codes),
    )
    constants = launch.constexprs()
    aligned = {"stride_qt", "stride_qh", "stride_ot", "stride_oh"}
    aligned |= {"stride_cache_block", "stride_cache_slot"}
    int_ptrs = {"block_tables_ptr", "seq_lens_ptr", "cu_seqlens_q_ptr", "tickets_ptr"}
    signature, attrs = {}, {}
    for i, arg in enumerate(_mla_attention_kernel.arg_names):
        if arg in constants:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            fp32_ptr = arg.startswith("part_") or arg == "latent_scale_ptr"
            dtype = "*i32" if arg in int_ptrs else "*fp32" if fp32_ptr else None
            if cfg.kv_codes and arg == "cache_ptr":
                dtype = KV_CODES[cfg.kv_codes]
            signature[arg] = dtype or DTYPES[cfg.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[arg] = "fp32" if arg == "scale_log2" else "i32"
            if arg in aligned and (cfg.latent + cfg.rope) % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(_mla_attention_kernel, signature, constants, attrs)
    return source, launch.options()


def _linear_attention_source(cfg: Config):
    """The gated delta rule (q, k, v, out in ``cfg.dtype``; g, beta, states fp32) or the causal
    convolution (x, weight, window, out in ``cfg.dtype``) at Qwen3-Next's shapes."""
    from triton.compiler import ASTSource

    from paged_serve.kernels.triton.causal_conv import _causal_conv_kernel, conv_constants
    from paged_serve.kernels.triton.delta_rule import (
        _CHUNKED_WARPS,
        _delta_rule_chunked_kernel,
        _delta_rule_recurrent_kernel,
        delta_rule_constants,
    )

    if cfg.kind == "conv":
        kernel, constants = _causal_conv_kernel, conv_constants(4, has_bias=False, silu=True)
        fp32_ptrs: set[str] = set()
    else:
        kernel = _delta_rule_recurrent_kernel if cfg.decode_only else _delta_rule_chunked_kernel
        constants = delta_rule_constants(cfg.head_dim, cfg.head_dim, chunked=not cfg.decode_only)
        fp32_ptrs = {"g_ptr", "beta_ptr", "state_ptr"}
    int_ptrs = {"cu_seqlens_ptr", "state_slots_ptr", "has_state_ptr"}
    signature, attrs = {}, {}
    for i, arg in enumerate(kernel.arg_names):
        if arg in constants:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            kind = "*i32" if arg in int_ptrs else "*fp32" if arg in fp32_ptrs else None
            signature[arg] = kind or DTYPES[cfg.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[arg] = "fp32" if arg == "scale" else "i32"
    warps = _CHUNKED_WARPS if cfg.kind == "delta" and not cfg.decode_only else 4
    return ASTSource(kernel, signature, constants, attrs), {"num_warps": warps}


def _ssd_source(cfg: Config):
    """Mamba-2's scan (x, B, C, y in ``cfg.dtype``; dt, A, D, states fp32), P = ``head_dim``,
    N = ``SSD_STATE``, with the skip D, as ``ssd_scan`` launches it."""
    from triton.compiler import ASTSource

    from paged_serve.kernels.triton.ssd_scan import (
        _CHUNKED_WARPS,
        _ssd_chunked_kernel,
        _ssd_recurrent_kernel,
        ssd_constants,
    )

    chunked = not cfg.decode_only
    kernel = _ssd_chunked_kernel if chunked else _ssd_recurrent_kernel
    constants = ssd_constants(cfg.head_dim, SSD_STATE, has_d=True, chunked=chunked)
    fp32_ptrs = {"dt_ptr", "A_ptr", "D_ptr", "state_ptr"}
    int_ptrs = {"cu_seqlens_ptr", "state_slots_ptr", "has_state_ptr"}
    signature, attrs = {}, {}
    for i, arg in enumerate(kernel.arg_names):
        if arg in constants:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            kind = "*i32" if arg in int_ptrs else "*fp32" if arg in fp32_ptrs else None
            signature[arg] = kind or DTYPES[cfg.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[arg] = "i32"
    return ASTSource(kernel, signature, constants, attrs), {
        "num_warps": _CHUNKED_WARPS if chunked else 4
    }


def _sampling_source(cfg: Config):
    from triton.compiler import ASTSource

    from paged_serve.kernels.triton.sampling import _sample_kernel, _tile_shape
    from paged_serve.kernels.triton.sampling_passes import _NUM_WARPS

    block_b, block_v = _tile_shape(cfg.vocab)
    constants = dict(BLOCK_B=block_b, BLOCK_V=block_v, HAS_MASK=cfg.token_mask)
    signature, attrs = {}, {}
    for i, arg in enumerate(_sample_kernel.arg_names):
        if arg in constants:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            kinds = {"top_k_ptr": "*i32", "seeds_ptr": "*i64", "steps_ptr": "*i64"}
            kinds |= {"token_mask_ptr": "*i32", "tokens_ptr": "*i64"}
            signature[arg] = kinds.get(arg, "*fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[arg] = "i32"
    return ASTSource(_sample_kernel, signature, constants, attrs), {"num_warps": _NUM_WARPS}


def _sampling_split_source(cfg: Config):
    """One phase of the split-row sampler (radix walks at level 7, the deepest) as
    ``sampling_split.sample_split`` launches it for ``cfg.vocab``."""
    import triton
    from triton.compiler import ASTSource

    from paged_serve.kernels.triton.sampling_passes import _NUM_WARPS
    from paged_serve.kernels.triton.sampling_split import (
        _MAX_BLOCK_V,
        SLICE,
        _sample_split_kernel,
        split_slices,
    )

    level = 7 if cfg.phase in (2, 3) else 0
    constants = dict(
        PHASE=cfg.phase,
        LEVEL=level,
        P_POW2=triton.next_power_of_2(split_slices(cfg.vocab)),
        BLOCK_V=min(SLICE, _MAX_BLOCK_V),
        HAS_MASK=cfg.token_mask,
    )
    ints = {"top_k_ptr", "token_mask_ptr", "part_arg_ptr", "part_bad_ptr", "race_idx_ptr"}
    ints |= {"k_count_ptr", "p_count_ptr", "k_state_ptr", "p_state_ptr"}
    kinds = {"seeds_ptr": "*i64", "steps_ptr": "*i64", "tokens_ptr": "*i64"}
    signature, attrs = {}, {}
    for i, arg in enumerate(_sample_split_kernel.arg_names):
        if arg in constants:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = kinds.get(arg, "*i32" if arg in ints else "*fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[arg] = "i32"
    source = ASTSource(_sample_split_kernel, signature, constants, attrs)
    return source, {"num_warps": _NUM_WARPS}


def _ptxas_report(ptx: str) -> tuple[int, int, int, int]:
    from triton import knobs

    ptxas = knobs.nvidia.ptxas_blackwell.path  # what Triton runs for sm_90 and newer
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        log = subprocess.run(
            [
                ptxas,
                "-v",
                "--regAllocOptLevel=2",
                "--gpu-name=sm_90a",
                str(src),
                "-o",
                str(Path(tmp) / "kernel.cubin"),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = int(re.search(r"(\d+) bytes stack frame", log).group(1))
    return registers, int(spill.group(1)), int(spill.group(2)), stack


def measure(cfg: Config) -> Resources:
    """Compile ``cfg`` for sm_90 and read its resource use (errors are reported, not raised)."""
    import triton
    from triton.backends.compiler import GPUTarget

    try:
        make = {
            "attention": _attention_source,
            "mla": _mla_source,
            "delta": _linear_attention_source,
            "conv": _linear_attention_source,
            "ssd": _ssd_source,
            "sampling_split": _sampling_split_source,
        }.get(cfg.kind, _sampling_source)
        source, options = make(cfg)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        registers, stores, loads, stack = _ptxas_report(kernel.asm["ptx"])
        return Resources(cfg.name, registers, stores, loads, stack, kernel.metadata.shared)
    except Exception as exc:  # noqa: BLE001 -- a failed build is a result to report
        return Resources(cfg.name, 0, 0, 0, 0, 0, f"{type(exc).__name__}: {exc}"[:300])


def configs(args: argparse.Namespace) -> list[Config]:
    out = []
    for dtype in args.dtypes:
        for head_dim in args.head_dims:
            for group in args.groups:
                for decode_only in (True, False):
                    out.append(Config("attention", dtype, head_dim, group, decode_only))
            # The epilogue and mask variants, once per head dim, on the largest group.
            group = max(args.groups)
            out.append(Config("attention", dtype, head_dim, group, True, split=True))
            out.append(Config("attention", dtype, head_dim, group, False, True, True))
    for codes in args.kv_codes:  # quantized caches: decode, split decode, windowed split prefill
        for dtype in args.dtypes:
            for head_dim in args.head_dims:
                group = max(args.groups)
                out.append(Config("attention", dtype, head_dim, group, True, kv_codes=codes))
                out.append(Config("attention", dtype, head_dim, group, True, True, kv_codes=codes))
                out.append(
                    Config("attention", dtype, head_dim, group, False, True, True, kv_codes=codes)
                )
    if args.tiles is not None:
        out = [replace(c, tiles=tuple(args.tiles)) for c in out]
    for codes in ("", *args.kv_codes):  # DeepSeek-V3's latent attention: 128 heads, 512 + 64
        for dtype in args.dtypes:
            for decode_only, split in ((True, False), (True, True), (False, False)):
                mla = Config("mla", dtype, 0, 128, decode_only, split, latent=512, rope=64)
                out.append(replace(mla, kv_codes=codes))
    for dtype in args.dtypes:  # Qwen3-Next's gated DeltaNet: 128-lane heads, a 4-wide window
        chunked = (False,) if dtype == "fp32" else (False, True)  # uses_chunked_kernel
        out += [Config("delta", dtype, 128, decode_only=not c) for c in chunked]
        out.append(Config("conv", dtype))
        out += [Config("ssd", dtype, 64, decode_only=not c) for c in chunked]  # Mamba-2's P
    masks = (False, True) if args.token_mask else (False,)
    out += [Config("sampling", vocab=v, token_mask=m) for v in args.vocabs for m in masks]
    from paged_serve.kernels.triton.sampling_split import (
        SLICE,  # vocabularies the split-row sampler takes
    )

    split = [v for v in args.vocabs if v > SLICE]
    out += [Config("sampling_split", vocab=v, phase=ph) for v in split for ph in range(6)]
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["fp32", "fp16", "bf16"])
    p.add_argument("--head-dims", type=_ints, default=[64, 80, 96, 128, 256])
    p.add_argument("--groups", type=_ints, default=[1, 4, 8, 16])
    p.add_argument("--vocabs", type=_ints, default=[64, 1000, 32000, 151936])
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--tiles", type=_ints, help="TILE_N,NUM_WARPS,NUM_STAGES,MAXNREG override")
    p.add_argument("--token-mask", action="store_true", help="also the masked sampling builds")
    p.add_argument("--kv-codes", type=lambda s: [c for c in s.split(",") if c], default=[])
    args = p.parse_args(argv)
    if args.tiles is not None and len(args.tiles) != 4:
        p.error(f"--tiles takes TILE_N,NUM_WARPS,NUM_STAGES,MAXNREG, got {args.tiles}")
    unknown = set(args.dtypes) - set(DTYPES)
    if unknown:
        p.error(f"unknown dtypes {sorted(unknown)}; choose from {sorted(DTYPES)}")
    if set(args.kv_codes) - set(KV_CODES):
        p.error(f"unknown --kv-codes {args.kv_codes}; choose from {sorted(KV_CODES)}")

    todo = configs(args)
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(measure, todo))
    for r in results:
        if args.json:
            print(json.dumps({**asdict(r), "ok": r.ok}))
        else:
            status = "ok" if r.ok else "FAIL"
            print(
                f"{r.config:<44} regs {r.registers:>3}  spill {r.spill_stores:>6}/"
                f"{r.spill_loads:<6} stack {r.stack:>6}  smem {r.shared:>7}  {status} {r.error}"
            )
    bad = [r for r in results if not r.ok]
    print(
        f"{len(results) - len(bad)} of {len(results)} builds for sm_90 without spills",
        file=sys.stderr,
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
