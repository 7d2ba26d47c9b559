"""A random-weight mixture-of-experts model written as a Hugging Face folder, for serving it
through paged-serve and through llama.cpp (``perf.serving.bench_moe_serving``).

The folder is what a hub checkout holds: ``config.json``, ``model.safetensors`` written by
``save_pretrained`` (per-expert tensors, as the real checkpoints store them) and the embedded
default model's tokenizer (SmolLM2-135M-Instruct's BPE vocabulary, 49152 tokens: llama.cpp's
converter knows its pre-tokenizer), so the vocabulary is that tokenizer's size. Two families:

* ``qwen3_moe``: Qwen3-MoE's shape (``Qwen3MoeForCausalLM``): many narrow experts, top-8 of
  32, q/k norms, routing weights renormalized over the chosen experts (``norm_topk_prob``, as
  Qwen3-30B-A3B's config and as llama.cpp's qwen3moe graph always does);
* ``mixtral``: Mixtral's shape (``MixtralForCausalLM``): few wide experts, top-2 of 8.

Weights are HF's own initialization (normal, std ``initializer_range`` 0.02; norms 1) from a
fixed seed: small enough that a hidden state stays of unit scale through the layers, so greedy
tokens depend on the prompt rather than falling into one repeated token. Folders are cached by
family, shape and seed under ``~/.cache/paged-serve/random-moe/`` and written atomically.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FAMILIES = ("qwen3_moe", "mixtral")
HEAD_DIM = 64
MAX_POSITIONS = 4096


@dataclass(frozen=True, slots=True)
class MoeShape:
    """The sizes of a random MoE model; ``expert_intermediate`` is each expert's width."""

    hidden: int
    layers: int
    experts: int
    top_k: int
    expert_intermediate: int

    def __post_init__(self) -> None:
        if self.hidden % (4 * HEAD_DIM):
            raise ValueError(f"hidden must be a multiple of {4 * HEAD_DIM}, got {self.hidden}")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k must be in [1, experts={self.experts}], got {self.top_k}")
        if min(self.layers, self.expert_intermediate) < 1:
            raise ValueError(f"layers and expert_intermediate must be >= 1: {self}")

    def tag(self) -> str:
        return (
            f"h{self.hidden}-l{self.layers}-e{self.experts}-k{self.top_k}"
            f"-i{self.expert_intermediate}"
        )


# Each family's shape at the scale of a small real model of it (per token about 140M weights
# read in fp32, a third of them the LM head: a few to tens of tokens/s on a 2-core CPU).
DEFAULT_SHAPES = {
    "qwen3_moe": MoeShape(hidden=1024, layers=6, experts=32, top_k=8, expert_intermediate=512),
    "mixtral": MoeShape(hidden=1024, layers=6, experts=8, top_k=2, expert_intermediate=2048),
}


def default_tokenizer() -> Any:
    """The embedded default model's tokenizer (no model hub)."""
    from transformers import AutoTokenizer

    from paged_serve.engine.model.loader import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(None)[0])


def moe_config(family: str, shape: MoeShape, tokenizer: Any) -> Any:
    """The transformers config of ``family`` at ``shape``, over ``tokenizer``'s vocabulary."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": shape.hidden,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.hidden // HEAD_DIM,
        "num_key_value_heads": shape.hidden // (4 * HEAD_DIM),
        "head_dim": HEAD_DIM,
        "num_experts_per_tok": shape.top_k,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            **common,
            num_experts=shape.experts,
            moe_intermediate_size=shape.expert_intermediate,
            intermediate_size=2 * shape.expert_intermediate,  # unused: every layer is sparse
            norm_topk_prob=True,
        )
    if family == "mixtral":
        return MixtralConfig(
            **common, num_local_experts=shape.experts, intermediate_size=shape.expert_intermediate
        )
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def write_random_moe(family: str, shape: MoeShape, folder: Path, *, seed: int = 0) -> Path:
    """Write the random ``family`` model of ``shape`` (fp32 weights from ``seed``) and the
    default tokenizer to ``folder``; returns ``folder``."""
    from transformers import AutoModelForCausalLM

    tokenizer = default_tokenizer()
    config = moe_config(family, shape, tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def random_moe_folder(
    family: str, shape: MoeShape | None = None, *, root: Path | None = None, seed: int = 0
) -> Path:
    """The cached folder of the random ``family`` model (``DEFAULT_SHAPES`` unless given),
    written on first use."""
    shape = shape or DEFAULT_SHAPES[family]
    root = root or Path.home() / ".cache" / "paged-serve" / "random-moe"
    folder = root / f"{family}-{shape.tag()}-s{seed}"
    if (folder / "config.json").is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        partial = write_random_moe(family, shape, Path(tmp) / folder.name, seed=seed)
        shutil.rmtree(folder, ignore_errors=True)  # a partial folder of an interrupted write
        partial.replace(folder)
    return folder


def with_sizes(family: str, **sizes: int | None) -> MoeShape:
    """``family``'s default shape with the given sizes replaced (``None`` keeps the default)."""
    given = {k: v for k, v in sizes.items() if v is not None}
    return dataclasses.replace(DEFAULT_SHAPES[family], **given)
