"""Checkpoints stored quantized on the CPU: memory at load and the decode step, same model.

``python -m perf.cpu.bench_quantized [--hidden 1024] [--layers 12] [--streams 1 8]`` builds a
random-weight Llama (``--hidden`` wide, ``--intermediate`` MLP, ``--layers`` layers, fp32),
saves it, and writes the same weights stored quantized with the test suite's writers
(tests/engine/quant/checkpoints.py, the formats' own layouts): GPTQ 4-bit groups of 128
(asymmetric), GPTQ 8-bit per channel, compressed-tensors W8A8 int8 and fine-grained FP8 blocks of
128x128. Then, each in a fresh process (so one load's memory never hides another's):

* ``load``: ``load_model`` of each folder in ``--load-dtype`` (bf16: what ``--dtype auto``
  picks on a CPU with native bf16): ``peak_mb`` the process's peak resident memory during the
  load over its resident memory before it (``VmHWM`` - ``VmRSS``; the imports excluded),
  ``kept_mb`` the weights the loaded model holds and ``served_mb`` once the CPU platform has
  prepared it (``weight_memory``: every parameter, buffer and packed copy once; the CPU
  dequantizes FP8 and int8 W8A8 there), ``layers_*`` the same for the decoder layers alone (the
  projections: embeddings and LM head are stored unquantized), ``kept_over_bf16`` the whole
  model's kept bytes over its weights in bf16, ``layers_served_over_bf16`` the layers';

and, in this process, per decode step (median ms over ``--steps`` steps of ``--streams``
requests decoding together after a ``--context``-token prompt each; engine.step, sampling
included, speculation off):

* ``fp32``: the unquantized checkpoint (the CPU default on a CPU without native bf16);
* ``bf16``: the same in bf16;
* ``int4_ours``: ``--quantization int4`` (our weight-only Q4_1-style mode, made at load);
* ``gptq_w4a16``, ``gptq_w4a16_bf16``: the GPTQ 4-bit checkpoint loaded in fp32 and in bf16
  (engine/platform/cpu/quantized_linears.py gives its projections the C integer GEMM; the
  embeddings, norms and LM head in the load dtype);

and each step's weight-read floor: the bytes a decode step must read in that variant (every
projection in its stored form, the norms and the LM head; not the embedding table, of which a
step reads a few rows) over the read bandwidth of this machine (one ``torch.sum`` over a
buffer of 256 MB, median of 5). ``*_over_floor`` is the step time over its floor. Prints one
JSON object. Timing belongs here, never in tests.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from paged_serve.engine.config import EngineConfig
from paged_serve.engine.model.loader import load_model
from paged_serve.engine.model.prep import prepare_model
from paged_serve.engine.observe.weight_memory import weight_memory
from paged_serve.engine.platform.platform import platform_for
from perf.cpu.bench_moe import median_ms, paged_decoder
from tests.engine.quant.checkpoints import write_compressed_tensors, write_fp8_block, write_gptq

MB = 1e6


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def write_formats(model: LlamaForCausalLM, root: Path) -> dict[str, Path]:
    """The unquantized folder and one folder per stored format, by name."""
    folders = {"fp32": root / "fp32"}
    model.save_pretrained(folders["fp32"])
    writers = {
        "gptq_w4a16_g128": lambda f: write_gptq(model, f, bits=4, group_size=128, sym=False),
        "gptq_w8a16_channel": lambda f: write_gptq(model, f, bits=8, group_size=-1),
        "ct_w8a8_int8": lambda f: write_compressed_tensors(model, f, "W8A8"),
        "fp8_block_128": lambda f: write_fp8_block(model, f, block=(128, 128)),
    }
    for name, write in writers.items():
        folders[name] = root / name
        write(folders[name])
    return folders


def _status_mb(field: str) -> float:
    """A memory figure of this process from /proc/self/status (``VmRSS``, ``VmHWM``: the peak
    resident memory of this process image, reset at exec, unlike ``ru_maxrss``), MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / MB
    raise KeyError(field)


def _load_in_child(folder: str, dtype: str, queue: multiprocessing.Queue) -> None:
    before = _status_mb("VmRSS")
    start = time.perf_counter()
    loaded = load_model(folder, dtype=getattr(torch, dtype), device=torch.device("cpu"))
    seconds = time.perf_counter() - start
    peak = _status_mb("VmHWM")
    model = loaded.model
    kept = weight_memory(model, model.dtype).bytes
    layers_kept = weight_memory(model.model.layers, model.dtype).bytes
    platform = platform_for("cpu")
    prepare_model(model, EngineConfig(device="cpu", dtype=dtype), platform)
    served = weight_memory(model, model.dtype).bytes
    layers_served = weight_memory(model.model.layers, model.dtype).bytes
    queue.put(
        {
            "quantization": loaded.quantization,
            "load_s": round(seconds, 2),
            "peak_mb": round(peak - before, 1),
            "kept_mb": round(kept / MB, 1),
            "served_mb": round(served / MB, 1),
            "layers_kept_mb": round(layers_kept / MB, 1),
            "layers_served_mb": round(layers_served / MB, 1),
        }
    )


def load_figures(
    folders: dict[str, Path], dtype: str, bf16_mb: float, layers_bf16_mb: float
) -> dict[str, dict]:
    """Each folder's load in a fresh process (module docstring)."""
    context = multiprocessing.get_context("spawn")
    figures = {}
    for name, folder in folders.items():
        queue = context.Queue()
        child = context.Process(target=_load_in_child, args=(str(folder), dtype, queue))
        child.start()
        row = queue.get()
        child.join()
        row["kept_over_bf16"] = round(row["kept_mb"] / bf16_mb, 3)
        row["layers_served_over_bf16"] = round(row["layers_served_mb"] / layers_bf16_mb, 3)
        figures[name] = row
    return figures


def read_gb_s() -> float:
    """This machine's read bandwidth for one torch.sum over 256 MB, GB/s (median of 5)."""
    buffer = torch.ones(64 << 20)
    times = []
    for _ in range(6):
        start = time.perf_counter()
        torch.sum(buffer)
        times.append(time.perf_counter() - start)
    return buffer.numel() * 4 / statistics.median(times[1:]) / 1e9


def step_bytes(model: torch.nn.Module, *, bytes_per_weight: float | None = None) -> float:
    """Bytes one decode step reads: every parameter and buffer but the input embeddings, at
    ``bytes_per_weight`` per element of a projection's weight if given (a mode made at load),
    else as stored."""
    embed = model.get_input_embeddings().weight
    total = 0.0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t is embed:
            continue
        per = t.element_size()
        if bytes_per_weight is not None and name.endswith("_proj.weight"):
            per = bytes_per_weight
        total += t.numel() * per
    return total


def step_ms(model: torch.nn.Module, streams: int, args: argparse.Namespace, quantization) -> float:
    ns = argparse.Namespace(**{**vars(args), "quantization": quantization})
    step, shutdown = paged_decoder(model, streams, ns)
    try:
        return median_ms([step], args.steps)[0]
    finally:
        shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip-load", action="store_true", help="decode steps only")
    p.add_argument("--load-dtype", default="bfloat16", help="the dtype of the load figures")
    args = p.parse_args(argv)
    model = build_model(args)
    bf16_mb = sum(t.numel() * 2 for t in model.parameters()) / MB
    layers_bf16_mb = sum(t.numel() * 2 for t in model.model.layers.parameters()) / MB
    out: dict[str, object] = {"args": vars(args), "threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        folders = write_formats(model, Path(tmp))
        if not args.skip_load:
            out["load"] = load_figures(folders, args.load_dtype, bf16_mb, layers_bf16_mb)
        gptq = {
            dtype: load_model(
                str(folders["gptq_w4a16_g128"]), dtype=dtype, device=torch.device("cpu")
            ).model
            for dtype in (torch.float32, torch.bfloat16)
        }
    # (the model to serve, --quantization, bytes a step reads per projection weight if a mode
    # made at load rather than as stored); .to() converts in place, so each builds its own
    variants = {
        "fp32": (lambda: model.float(), None, None),
        "bf16": (lambda: model.to(torch.bfloat16), None, None),
        "int4_ours": (lambda: model.float(), "int4", 0.5 + 4 / 32),  # codes, bf16 scale+offset/32
        "gptq_w4a16": (lambda: gptq[torch.float32], None, None),
        "gptq_w4a16_bf16": (lambda: gptq[torch.bfloat16], None, None),
    }
    gb_s = read_gb_s()
    out["read_gb_s"] = round(gb_s, 2)
    rows = []
    for streams in args.streams:
        row: dict[str, object] = {"streams": streams}
        for name, (make, quantization, per_weight) in variants.items():
            variant = make()
            ms = step_ms(variant, streams, args, quantization)
            floor = step_bytes(variant, bytes_per_weight=per_weight) / (gb_s * 1e9) * 1e3
            row[f"{name}_ms"] = round(ms, 2)
            row[f"{name}_floor_ms"] = round(floor, 2)
            row[f"{name}_over_floor"] = round(ms / floor, 2)
        rows.append(row)
    out["rows"] = rows
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
