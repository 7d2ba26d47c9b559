"""A checkpoint that does not match its config is refused at load with one line naming what is
wrong (engine/model/checkpoint_check.py), never served with random weights: missing tensors
(one file, a sharded index that lists a few, a tensor-parallel rank's shard), tensors the model
has no place for, wrong shapes, and configs whose sizes are absurd, refused before anything is
allocated (checked under an address-space limit). A GGUF file that cannot be read is refused
naming the file. What must keep loading: tied heads, old per-layer rotary frequencies, every
architecture the engine serves."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from paged_serve.engine.model.checkpoint_check import check_checkpoint
from paged_serve.engine.model.loader import default_gguf_path, load_model, load_model_shard
from tests.conftest import tiny_model
from tests.engine.model.test_model_coverage import ARCHITECTURES, tiny_architecture

CPU = torch.device("cpu")
DROPPED = (
    "lm_head.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.mlp.up_proj.weight",
)


def _saved_llama(folder: Path, **save: object) -> dict[str, torch.Tensor]:
    tiny_model("llama").save_pretrained(folder, **save)
    return load_file(folder / "model.safetensors") if not save else {}


def _rewrite(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _set_config(folder: Path, **fields: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | fields))


def test_missing_tensors_are_refused_naming_them(tmp_path: Path):
    tensors = _saved_llama(tmp_path)
    for name in DROPPED:
        del tensors[name]
    _rewrite(tmp_path, tensors)
    with pytest.raises(ValueError, match="3 tensors missing") as refused:
        load_model(str(tmp_path), dtype=torch.float32, device=CPU)
    message = str(refused.value)
    assert str(tmp_path) in message and "\n" not in message
    assert all(name in message for name in DROPPED)


def test_a_checkpoint_without_its_layers_is_refused(tmp_path: Path):
    tensors = _saved_llama(tmp_path)
    _rewrite(tmp_path, {k: v for k, v in tensors.items() if ".layers." not in k})
    with pytest.raises(ValueError, match=r"18 tensors missing \(model\.layers\.0\."):
        load_model(str(tmp_path), dtype=torch.float32, device=CPU)


def test_a_sharded_index_listing_a_few_tensors_is_refused(tmp_path: Path):
    _saved_llama(tmp_path, max_shard_size="100KB")
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    kept = dict(sorted(index["weight_map"].items())[:2])
    index_file.write_text(json.dumps(index | {"weight_map": kept}))
    with pytest.raises(ValueError, match="19 tensors missing"):
        load_model(str(tmp_path), dtype=torch.float32, device=CPU)


def test_a_tensor_parallel_rank_refuses_a_checkpoint_missing_tensors(tmp_path: Path):
    """The rank's own loader would otherwise fall back to loading the whole model, which
    transformers fills at random where tensors are missing."""
    tensors = _saved_llama(tmp_path)
    del tensors["lm_head.weight"]
    _rewrite(tmp_path, tensors)
    with pytest.raises(ValueError, match=r"1 tensor missing \(lm_head\.weight\)"):
        load_model_shard(str(tmp_path), dtype=torch.float32, rank=1, world_size=2)


def test_extra_tensors_are_refused(tmp_path: Path):
    tensors = _saved_llama(tmp_path)
    tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(4, 4)
    _rewrite(tmp_path, tensors)
    with pytest.raises(ValueError, match=r"1 tensor not in the model \(model\.layers\.2\."):
        check_checkpoint(tmp_path)


def test_missing_beside_unknown_tensors_are_refused_by_the_load_report(tmp_path: Path):
    """Tensors missing while others are left over could be a renaming transformers applies at
    load; its own load report then names both."""
    tensors = _saved_llama(tmp_path)
    tensors["model.norm.scale"] = tensors.pop("model.norm.weight")
    _rewrite(tmp_path, tensors)
    check_checkpoint(tmp_path)  # undecided before the load
    with pytest.raises(ValueError, match=r"missing \(model\.norm\.weight\).*model\.norm\.scale"):
        load_model(str(tmp_path), dtype=torch.float32, device=CPU)


@pytest.mark.parametrize(
    "field,value,shape",
    [
        ("vocab_size", 1000, r"model\.embed_tokens\.weight \[512, 128\] \(needs \[1000, 128\]\)"),
        ("intermediate_size", 100, r"gate_proj\.weight \[256, 128\] \(needs \[100, 128\]\)"),
    ],
)
def test_wrong_shapes_are_refused_before_loading(tmp_path: Path, field, value, shape):
    _saved_llama(tmp_path)
    _set_config(tmp_path, **{field: value})
    with pytest.raises(ValueError, match=f"of the wrong shape .*{shape}"):
        check_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=shape):
        load_model(str(tmp_path), dtype=torch.float32, device=CPU)


# Loads each folder under an address-space limit of what the interpreter has mapped after its
# imports plus 1 GiB: a refusal that came after allocating the config's sizes would be a
# MemoryError (or a RuntimeError from torch's allocator) here, not the ValueError.
_UNDER_A_MEMORY_LIMIT = """
import json, resource, sys, time
import torch
from paged_serve.engine.model.loader import load_model

status = open("/proc/self/status").read()
mapped = int(status.split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), mapped + (1 << 30)))
results = {}
for folder in sys.argv[1:]:
    start = time.monotonic()
    try:
        load_model(folder, dtype=torch.float32, device=torch.device("cpu"))
        outcome = "loaded"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    results[folder] = [outcome, time.monotonic() - start]
print(json.dumps(results))
"""

ABSURD = {
    "vocab 10^9": ({"vocab_size": 10**9}, r"model\.embed_tokens\.weight \[512, 128\]"),
    "layers 10^6": ({"num_hidden_layers": 10**6}, "num_hidden_layers is 1000000, but the "
                    "checkpoint holds 2 layers"),
    "heads 0": ({"num_attention_heads": 0}, "num_attention_heads is 0; it must be a positive"),
    "KV heads -2": ({"num_key_value_heads": -2}, "num_key_value_heads is -2"),
    "heads 4, KV heads 3": ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a "
                            "multiple of num_key_value_heads 3"),
}  # fmt: skip


def test_absurd_configs_are_refused_quickly_without_allocating(tmp_path: Path):
    folders = {}
    for case, (fields, _) in ABSURD.items():
        folder = tmp_path / case.replace(" ", "_").replace(",", "")
        _saved_llama(folder)
        _set_config(folder, **fields)
        folders[case] = str(folder)
    run = subprocess.run(
        [sys.executable, "-c", _UNDER_A_MEMORY_LIMIT, *folders.values()],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(run.stdout.splitlines()[-1])
    for case, (_, message) in ABSURD.items():
        outcome, seconds = results[folders[case]]
        assert outcome.startswith("ValueError: "), (case, outcome)
        assert folders[case] in outcome and "\n" not in outcome
        assert seconds < 5, (case, seconds)
        assert re.search(message, outcome), (case, outcome)


def test_what_the_model_computes_or_ties_is_not_missing(tmp_path: Path):
    """A tied head stores no ``lm_head.weight``; an old checkpoint's per-layer rotary
    frequencies are dropped by transformers, not an unexpected tensor."""
    model = tiny_model("llama")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(32)
    _rewrite(tmp_path, tensors)
    loaded = load_model(str(tmp_path), dtype=torch.float32, device=CPU).model
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_every_served_architecture_passes_the_check(name: str, tmp_path: Path):
    tiny_architecture(name).save_pretrained(tmp_path, max_shard_size="40KB")
    check_checkpoint(tmp_path)


def _tiny_gguf(path: Path, name: bytes = b"tiny") -> bytes:
    """A small GGUF file (llama metadata, one tensor) as bytes, also written to ``path``."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name.decode())
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.ones(8, 16).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def _junk(path: Path) -> None:
    path.write_bytes(b"not a model at all\n" * 40)


def _truncated_header(path: Path) -> None:
    path.write_bytes(default_gguf_path().read_bytes()[:5000])


def _truncated_data(path: Path) -> None:
    data = _tiny_gguf(path)
    path.write_bytes(data[:-200])


def _not_utf8(path: Path) -> None:
    data = _tiny_gguf(path, b"NAMEMARK")
    path.write_bytes(data.replace(b"NAMEMARK", b"\xff\xfe\xfd\xfc\xfb\xfa\xf9\xf8", 1))


@pytest.mark.parametrize("corrupt", [_junk, _truncated_header, _truncated_data, _not_utf8])
def test_an_unreadable_gguf_file_is_refused_naming_it(corrupt, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PAGED_SERVE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    corrupt(path)
    start = time.monotonic()
    with pytest.raises(ValueError) as refused:
        load_model(str(path), dtype=torch.float32, device=CPU)
    message = str(refused.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    assert time.monotonic() - start < 30
    assert not list((tmp_path / "cache").glob("*/config.json"))  # nothing converted


def test_the_cli_prints_one_start_error_line(tmp_path: Path, caplog, monkeypatch):
    from paged_serve.server import cli

    async def served(*args: object) -> bool:  # an engine that started would serve: return
        return True

    monkeypatch.setattr(cli, "serve", served)
    tensors = _saved_llama(tmp_path)
    del tensors["lm_head.weight"]
    _rewrite(tmp_path, tensors)
    assert cli.main(["--model", str(tmp_path), "--port", "0"]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [
        f"cannot start the engine: {tmp_path}: the checkpoint does not match its config.json: "
        "1 tensor missing (lm_head.weight)"
    ]
