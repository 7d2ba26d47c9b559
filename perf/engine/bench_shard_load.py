"""Host memory while loading: one rank's shard read alone against the whole model, on the CPU.

A random Llama of a few GB is written once as a sharded safetensors folder (``--shard-mb`` per
file). Each measurement runs in a fresh process, which reports the resident set before loading
(Python, torch, transformers imported), its peak during the load (``VmHWM``), and the bytes of
the parameters it ends up holding:

* ``whole``: ``load_model`` (``from_pretrained``), what TP=1 does and what every rank did
  before shard loading;
* ``whole + shard_model``: that, then sharded for rank 0 of 2 (the old per-rank path);
* ``shard r/2``: ``load_model_shard`` for rank r of 2 (engine/model/shard_loading.py).

Every parameter is read once after the load, so those still backed by a file mapping
(``from_pretrained`` may leave a same-dtype tensor on the mapped file) are resident too. The
load overhead is the peak minus the resident set before minus the parameters kept: what loading
cost beyond the result. (``VmHWM`` counts mapped file pages: safetensors maps the files it
reads.)

    python -m perf.engine.bench_shard_load                 # 1.7 GiB in bf16, 500 MB files
    python -m perf.engine.bench_shard_load --layers 4      # smaller and quicker
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

MODES = ("whole", "whole + shard_model", "shard 0/2", "shard 1/2")


def write_model(folder: Path, layers: int, shard_mb: int) -> int:
    """A random bf16 Llama (hidden 2048, MLP 8192, 16/8 heads, vocabulary 32,000) in ``folder``;
    returns its bytes."""
    config = LlamaConfig(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=32000,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.02)
    model.save_pretrained(folder, max_shard_size=f"{shard_mb}MB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measure(folder: str, mode: str) -> dict:
    """One load in this process (run through ``--child``)."""
    from paged_serve.engine.model.loader import load_model, load_model_shard
    from paged_serve.engine.model.sharding import shard_model

    before = _status_kb("VmRSS")
    if mode.startswith("shard"):
        rank = int(mode.split()[1].split("/")[0])
        loaded = load_model_shard(folder, dtype=torch.bfloat16, rank=rank, world_size=2)
        assert loaded is not None and loaded.shard == (rank, 2)
    else:
        loaded = load_model(folder, dtype=torch.bfloat16, device=torch.device("cpu"))
        if mode == "whole + shard_model":
            shard_model(loaded.model, rank=0, world_size=2)
    params = list(loaded.model.parameters())
    kept = sum(p.numel() * p.element_size() for p in params)
    for p in params:  # resident: a tensor still backed by an unread file mapping is paged in
        p.sum()
    return {
        "mode": mode,
        "rss_before_mb": before / 1024,
        "peak_mb": _status_kb("VmHWM") / 1024,
        "kept_mb": kept / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--shard-mb", type=int, default=500)
    parser.add_argument("--child", nargs=2, metavar=("FOLDER", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        total = write_model(folder, args.layers, args.shard_mb)
        files = sorted(folder.glob("*.safetensors"))
        largest = max(f.stat().st_size for f in files) / 2**20
        print(
            f"random Llama, {args.layers} layers: {total / 2**20:.0f} MiB of bf16 parameters "
            f"in {len(files)} files (largest {largest:.0f} MiB)"
        )
        print("| load | RSS before (MiB) | peak (MiB) | kept (MiB) | overhead (MiB) |")
        print("|---|---|---|---|---|")
        child = [sys.executable, "-m", "perf.engine.bench_shard_load", "--child"]
        for mode in MODES:
            out = subprocess.run(
                [*child, str(folder), mode],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            r = json.loads(out.strip().splitlines()[-1])
            overhead = r["peak_mb"] - r["rss_before_mb"] - r["kept_mb"]
            print(
                f"| {mode} | {r['rss_before_mb']:.0f} | {r['peak_mb']:.0f} | {r['kept_mb']:.0f} "
                f"| {overhead:.0f} |"
            )


if __name__ == "__main__":
    main()
