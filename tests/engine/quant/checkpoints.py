"""Tiny random-weight checkpoints stored quantized the way the real tools store them, written
from the formats' public descriptions, independently of ``engine/quant/`` (nothing here imports
it): AutoGPTQ/GPTQModel, AutoAWQ's GEMM layout, compressed-tensors (through the installed
``compressed_tensors`` library's own quantizer and ``ModelCompressor``) and fine-grained FP8.

Every writer returns a ``QuantizedCheckpoint``: the folder, and the reference the engine is
compared with, Hugging Face's model in fp32 whose quantized weights are exactly the values the
stored codes stand for (so the comparison isolates loading and serving from the quantization's
own approximation)::

    model ──save_pretrained──► the checkpoint's own tensor names (per-expert for MoE)
          ──each decoder-layer *_proj.weight──► quantized: stored tensors + dequantized [N, K]
          ──► folder/            config.json with quantization_config, the stored tensors
          ──► folder-reference/  the same tensors with each weight dequantized, read back by
                                 ``from_pretrained`` in fp32 (the reference)
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from tests.conftest import TINY_FAMILIES
from tests.conftest import tiny_model as tiny_dense_model
from tests.engine.model.test_model_coverage import ARCHITECTURES, tiny_architecture

# the projections real GPTQ/AWQ/FP8 releases quantize: every nn.Linear of the decoder layers,
# the experts' included (the MoE router ``mlp.gate`` and the LM head stay unquantized)
QUANTIZED = re.compile(r"model\.layers\.\d+\..*_proj\.weight")
WEIGHTS_FILE = "model.safetensors"
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


@dataclass(frozen=True)
class QuantizedCheckpoint:
    """A checkpoint folder stored quantized; ``reference``: HF in fp32 over the dequantized
    weights; ``dequantized``: those weights ``[N, K]`` fp32 by their stored ``.weight`` name."""

    folder: Path
    reference: PreTrainedModel
    dequantized: dict[str, torch.Tensor]

    def reference_folder(self) -> Path:
        """The reference's own checkpoint: unquantized, the dequantized weights in fp32."""
        return self.folder.with_name(self.folder.name + "-reference")


def tiny_model(family: str = "llama", seed: int = 0, **overrides: object) -> PreTrainedModel:
    """A tiny random-weight model: ``tests/conftest.py``'s dense families (hidden 128,
    intermediate 256, head_dim 64) or ``test_model_coverage``'s architectures (``qwen3_moe``:
    4 experts of 64), with config ``overrides``."""
    if family in TINY_FAMILIES:
        model = tiny_dense_model(family, seed=seed)
        if not overrides:
            return model
        config = copy.deepcopy(model.config)
        for key, value in overrides.items():
            setattr(config, key, value)
        torch.manual_seed(seed)
        return type(model)(config).eval()
    if not overrides:
        return tiny_architecture(family, seed=seed)
    config_cls, model_cls, extra = ARCHITECTURES[family]
    from tests.engine.model.test_model_coverage import COMMON

    config = config_cls(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    return model_cls(config).eval()


# ---- packing ---------------------------------------------------------------------------------


def _int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 bit patterns held in int64 as the int32 tensors the formats store."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes [R, C]`` (unsigned) packed along R, low bits first: ``[R * bits / 32, C]``."""
    pack = 32 // bits
    grouped = codes.to(torch.int64).reshape(-1, pack, codes.shape[1])
    shifts = (torch.arange(pack, dtype=torch.int64) * bits)[None, :, None]
    return _int32((grouped << shifts).sum(1))


def pack_columns(codes: torch.Tensor, bits: int, order: tuple[int, ...] | None = None):
    """``codes [R, C]`` packed along C: bits ``i * bits`` of word ``j`` hold column
    ``j * pack + order[i]`` (None: ``i``)."""
    pack = 32 // bits
    grouped = codes.to(torch.int64).reshape(codes.shape[0], -1, pack)  # [R, C / pack, pack]
    if order is not None:
        grouped = grouped[:, :, list(order)]
    shifts = torch.arange(pack, dtype=torch.int64) * bits
    return _int32((grouped << shifts).sum(-1))


# ---- the common writer ------------------------------------------------------------------------

# one projection's fp32 weight [N, K] -> (its stored tensors by suffix, its dequantized [N, K])
Quantize = Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def _write(
    model: PreTrainedModel, folder: Path, quantize: Quantize, quantization_config: dict
) -> QuantizedCheckpoint:
    """``model`` saved to ``folder`` with every ``QUANTIZED`` weight replaced by what
    ``quantize`` stores (its bias, if any, kept beside), and its reference."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    stored: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(folder / WEIGHTS_FILE).items():
        if QUANTIZED.fullmatch(name) and tensor.dim() == 2:
            prefix = name.removesuffix(".weight")
            parts, dequantized[name] = quantize(tensor.float())
            stored.update({f"{prefix}.{suffix}": t.contiguous() for suffix, t in parts.items()})
        else:
            stored[name] = tensor
    save_file(stored, folder / WEIGHTS_FILE, metadata={"format": "pt"})
    set_quantization_config(folder, quantization_config)
    return QuantizedCheckpoint(folder, _reference(model, folder, dequantized), dequantized)


def set_quantization_config(folder: Path, quantization_config: dict | None) -> None:
    """Write (None: remove) ``config.json``'s ``quantization_config``."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    path.write_text(json.dumps(config, indent=2))


def _reference(
    model: PreTrainedModel, folder: Path, dequantized: dict[str, torch.Tensor]
) -> PreTrainedModel:
    """HF's model in fp32 over ``model``'s weights with ``dequantized`` in place (by stored
    name, so MoE experts go through transformers' own fusing of per-expert tensors)."""
    ref_folder = folder.with_name(folder.name + "-reference")  # reference_folder()
    model.save_pretrained(ref_folder)
    tensors = load_file(ref_folder / WEIGHTS_FILE)
    assert set(dequantized) <= set(tensors)
    tensors.update(dequantized)
    save_file(tensors, ref_folder / WEIGHTS_FILE, metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(ref_folder, dtype=torch.float32).eval()


def _minmax_qparams(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``w [..., n]`` (reduced over the last dim): the fp16 scale and the integer
    zero point, AutoGPTQ's min-max rule (sym: zero ``2^(bits-1)``, scale ``2 * amax / maxq``)."""
    maxq = (1 << bits) - 1
    lo = w.amin(-1).clamp(max=0)
    hi = w.amax(-1).clamp(min=0)
    if sym:
        hi = torch.maximum(lo.abs(), hi)
        lo = -hi
    scale = ((hi - lo) / maxq).clamp(min=1e-5).half()
    if sym:
        zero = torch.full_like(scale, 1 << (bits - 1), dtype=torch.int64)
    else:
        zero = torch.round(-lo / scale.float()).clamp(0, maxq).to(torch.int64)
    return scale, zero


# ---- GPTQ ---------------------------------------------------------------------------------------


def act_order_g_idx(k: int, group_size: int, seed: int) -> torch.Tensor:
    """An act-order group assignment ``[k]``: inputs taken in a random order (GPTQ's by
    decreasing Hessian diagonal), each consecutive ``group_size`` of them one group."""
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group_size).to(torch.int32)
    return g_idx


def write_gptq(
    model: PreTrainedModel,
    folder: Path,
    *,
    bits: int = 4,
    group_size: int = 128,
    sym: bool = True,
    desc_act: bool = False,
    checkpoint_format: str = "gptq",
) -> QuantizedCheckpoint:
    """AutoGPTQ/GPTQModel's layout per projection of K inputs and N outputs (pack = 32/bits)::

    qweight [K/pack, N] int32  packed along K, low bits first
    qzeros  [G, N/pack] int32  packed along N; "gptq" (v1) stores zero - 1, "gptq_v2" zero
    scales  [G, N] fp16        w[n, k] = (q[k, n] - zero[g, n]) * scale[g, n], g = g_idx[k]
    g_idx   [K] int32
    """
    counter = iter(range(1 << 30))

    def quantize(w: torch.Tensor):
        n, k = w.shape
        size = k if group_size == -1 else group_size
        if desc_act:
            g_idx = act_order_g_idx(k, size, seed=next(counter))
        else:
            g_idx = (torch.arange(k) // size).to(torch.int32)
        groups = k // size
        # each group's inputs (in input order): [G, size]
        members = torch.stack([(g_idx == g).nonzero().flatten() for g in range(groups)])
        scale, zero = _minmax_qparams(w[:, members], bits, sym)  # [N, G]
        s = scale.float()[:, g_idx.long()]  # [N, K]
        z = zero[:, g_idx.long()]
        q = torch.clamp(torch.round(w / s) + z, 0, (1 << bits) - 1).to(torch.int64)
        stored_zero = (zero - 1) & ((1 << bits) - 1) if checkpoint_format == "gptq" else zero
        parts = {
            "qweight": pack_rows(q.t(), bits),
            "qzeros": pack_columns(stored_zero.t(), bits),
            "scales": scale.t(),
            "g_idx": g_idx,
        }
        return parts, (q - z).float() * s

    config = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "checkpoint_format": checkpoint_format,
        "damp_percent": 0.01,
        "true_sequential": True,
    }
    return _write(model, folder, quantize, config)


# ---- AWQ ----------------------------------------------------------------------------------------

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # bits 4i of a word hold column 8j + AWQ_ORDER[i]


def write_awq(model: PreTrainedModel, folder: Path, *, group_size: int = 128):
    """AutoAWQ's GEMM layout, 4 bits with zero points::

    qweight [K, N/8] int32  packed along N, interleaved (AWQ_ORDER)
    qzeros  [G, N/8] int32  the same packing
    scales  [G, N] fp16     w[n, k] = (q[k, n] - zero[k // group_size, n]) * scale[...]
    """

    def quantize(w: torch.Tensor):
        n, k = w.shape
        scale, zero = _minmax_qparams(w.reshape(n, k // group_size, group_size), 4, sym=False)
        s = scale.float().repeat_interleave(group_size, 1)
        z = zero.repeat_interleave(group_size, 1)
        q = torch.clamp(torch.round(w / s) + z, 0, 15).to(torch.int64)
        parts = {
            "qweight": pack_columns(q.t(), 4, AWQ_ORDER),
            "qzeros": pack_columns(zero.t(), 4, AWQ_ORDER),
            "scales": scale.t(),
        }
        return parts, (q - z).float() * s

    config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    return _write(model, folder, quantize, config)


# ---- fine-grained FP8 ---------------------------------------------------------------------------


def fp8_quantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``w / scale`` (scale per element) rounded to e4m3."""
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def block_scale(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``[ceil(N / bn), ceil(K / bk)]`` fp32: each block's amax over 448."""
    bn, bk = block
    n, k = w.shape
    padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
    padded[:n, :k] = w.abs()
    amax = padded.unflatten(0, (-1, bn)).unflatten(-1, (-1, bk)).amax((1, 3))
    return (amax / FP8_MAX).clamp(min=1e-8)


def expand_blocks(scale: torch.Tensor, block: tuple[int, int], shape) -> torch.Tensor:
    bn, bk = block
    return scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: shape[0], : shape[1]]


def write_fp8_block(
    model: PreTrainedModel, folder: Path, *, block: tuple[int, int] = (128, 128)
) -> QuantizedCheckpoint:
    """``quant_method: "fp8"`` (DeepSeek-V3, Qwen3-FP8)::

    weight           [N, K] float8_e4m3fn
    weight_scale_inv [ceil(N / bn), ceil(K / bk)] fp32   w = weight * scale[n // bn, k // bk]
    """

    def quantize(w: torch.Tensor):
        scale = block_scale(w, block)
        q = fp8_quantize(w, expand_blocks(scale, block, w.shape))
        return {"weight": q, "weight_scale_inv": scale}, q.float() * expand_blocks(
            scale, block, w.shape
        )

    config = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    return _write(model, folder, quantize, config)


# ---- compressed-tensors -------------------------------------------------------------------------


def compressed_tensors_scheme(name: str, targets: list[str]):
    """A ``QuantizationScheme`` of the library's, by preset-like name: ``W4A16`` (group 128),
    ``W4A16_G32``, ``W4A16_ASYM_G32``, ``W4A16_CHANNEL``, ``W8A16`` (group 128), ``W8A8``
    (int8 channel weights, dynamic per-token activations), ``FP8_TENSOR`` / ``FP8_DYNAMIC``
    (channel) / ``FP8_BLOCK`` (128x128) / ``FP8_BLOCK_64`` / ``FP8_W8A16`` (channel weights
    only)."""
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationScheme,
        preset_name_to_scheme,
    )

    def ints(bits: int, strategy: str, group_size: int | None = None, symmetric: bool = True):
        return QuantizationArgs(
            num_bits=bits, type="int", strategy=strategy, group_size=group_size,
            symmetric=symmetric, dynamic=False,
        )  # fmt: skip

    def fp8(strategy: str, block: list[int] | None = None):
        return QuantizationArgs(
            num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False,
            block_structure=block,
        )  # fmt: skip

    def fp8_tokens(group_size: int | None = None):
        strategy = "token" if group_size is None else "group"
        return QuantizationArgs(
            num_bits=8, type="float", strategy=strategy, group_size=group_size, symmetric=True,
            dynamic=True,
        )  # fmt: skip

    schemes = {
        "W4A16_G32": dict(weights=ints(4, "group", 32)),
        "W4A16_ASYM_G32": dict(weights=ints(4, "group", 32, symmetric=False)),
        "W4A16_CHANNEL": dict(weights=ints(4, "channel")),
        "FP8_TENSOR": dict(weights=fp8("tensor"), input_activations=fp8_tokens()),
        "FP8_BLOCK_64": dict(weights=fp8("block", [64, 64]), input_activations=fp8_tokens(64)),
        "FP8_W8A16": dict(weights=fp8("channel")),
    }
    if name in schemes:
        return QuantizationScheme(targets=targets, **schemes[name])
    return preset_name_to_scheme(name, targets)


def _observed_qparams(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight's min-max scale and zero point in ``args``' strategy (what llm-compressor's
    default observer computes), by the library's ``calculate_qparams``."""
    from compressed_tensors.quantization.utils import calculate_qparams

    strategy = str(getattr(args.strategy, "value", args.strategy))
    if strategy == "tensor":
        lo, hi = weight.amin(), weight.amax()
    elif strategy == "channel":
        lo, hi = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
    elif strategy == "group":
        grouped = weight.unflatten(-1, (-1, args.group_size))
        lo, hi = grouped.amin(-1), grouped.amax(-1)
    elif strategy == "block":
        bn, bk = args.block_structure
        blocks = weight.unflatten(0, (-1, bn)).unflatten(-1, (-1, bk))
        lo, hi = blocks.amin((1, 3)), blocks.amax((1, 3))
    else:
        raise ValueError(f"no observer here for {strategy} weights")
    return calculate_qparams(lo, hi, args)


def write_compressed_tensors(
    model: PreTrainedModel,
    folder: Path,
    scheme: str | dict[str, tuple[str, list[str]]],
    *,
    ignore: tuple[str, ...] = ("lm_head",),
) -> QuantizedCheckpoint:
    """llm-compressor's output for ``scheme`` (a name of ``compressed_tensors_scheme``, every
    Linear; or ``{group: (scheme, targets)}``), written by the ``compressed_tensors`` library:
    its ``apply_quantization_config``, min-max weight scales by its ``calculate_qparams``, its
    ``ModelCompressor`` to compress and to write ``quantization_config``. The reference's
    weights are the library's ``fake_quantize`` of each weight (what it dequantizes to)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    groups = {"group_0": (scheme, ["Linear"])} if isinstance(scheme, str) else scheme
    config = QuantizationConfig(
        config_groups={
            name: compressed_tensors_scheme(preset, targets)
            for name, (preset, targets) in groups.items()
        },
        ignore=list(ignore),
    )
    quantized = copy.deepcopy(model)
    apply_quantization_config(quantized, config, show_progress=False)
    dequantized: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, module in quantized.named_modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            scale, zero = _observed_qparams(module.weight.float(), args)
            module.weight_scale.copy_(scale.to(module.weight_scale.dtype))
            zero_point = getattr(module, "weight_zero_point", None)
            if zero_point is not None:
                zero_point.copy_(zero.to(zero_point.dtype))
            dequantized[f"{name}.weight"] = fake_quantize(
                module.weight, module.weight_scale, zero_point, args
            ).float()
    compressor = ModelCompressor.from_pretrained_model(quantized)
    compressor.compress_model(quantized)
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    tensors = {k: v.contiguous() for k, v in quantized.state_dict().items()}
    save_file(tensors, folder / WEIGHTS_FILE, metadata={"format": "pt"})
    compressor.update_config(str(folder))
    return QuantizedCheckpoint(folder, _reference(model, folder, dequantized), dequantized)
