"""Engine configuration: one frozen object, validated once, passed everywhere."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from paged_serve.engine.kv.kv_dtype import kv_code_dtype
from paged_serve.engine.lora.config import LoRAConfig
from paged_serve.engine.spec.config import SpeculativeConfig

ATTENTION_BACKENDS = ("auto", "torch", "triton")
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "embed", "classify")
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
DTYPES = ("auto", "float32", "float16", "bfloat16")
# made at load from full-precision weights, on the CPU (engine/model/int8_weights.py, int4_weights)
WEIGHT_ONLY_QUANTIZATIONS = ("int8", "int4")
# the method of a checkpoint stored quantized, as vLLM's --quantization names it
# (engine/quant/checkpoint.py reads them; the _marlin names are vLLM's kernels for the same files)
CHECKPOINT_QUANTIZATIONS = (
    "gptq",
    "awq",
    "compressed-tensors",
    "fp8",
    "gptq_marlin",
    "awq_marlin",
    "compressed_tensors",
)
QUANTIZATIONS = WEIGHT_ONLY_QUANTIZATIONS + CHECKPOINT_QUANTIZATIONS


def cache_root() -> Path:
    """The folder paged-serve keeps its caches in (converted models, the C kernel's builds):
    ``$PAGED_SERVE_CACHE``, else ``~/.cache/paged-serve``."""
    return Path(os.environ.get("PAGED_SERVE_CACHE") or Path.home() / ".cache" / "paged-serve")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How to load the model and size the scheduler and KV cache.

    model: a Hugging Face model id or folder, a ``.gguf`` file, or None for the embedded default.
    kv_cache_memory: bytes of KV cache; None = 1 GiB on CPU and, on CUDA, what
    ``gpu_memory_utilization`` leaves free (a value given applies on both devices).
    max_num_batched_tokens: the per-step token budget (prefill chunks plus decodes).
    max_model_len: the longest sequence (prompt plus output), in tokens; None takes the model's.
    enforce_eager: never capture CUDA graphs (on CUDA with the triton backend, decode steps
    otherwise replay graphs captured at start for batch sizes up to ``max_num_seqs``).
    quantization: None, ``int8`` for weight-only int8 projections on the CPU, or ``int4`` for
    4-bit ones in groups of 32 (each an approximation of the model: faster decoding at low
    concurrency, different tokens); or the method of a checkpoint stored quantized
    (``CHECKPOINT_QUANTIZATIONS``), which must then be the checkpoint's (it is read from
    ``quantization_config`` without the flag).
    seed: where the seeds of requests that give none come from; None (the default) draws them
    from the OS, so a restart does not repeat the same "random" outputs; an integer makes them
    reproducible from run to run.
    tensor_parallel_size: processes the model is sharded over (``engine/model/sharding.py``):
    this engine process is rank 0 and starts the others (``engine/executor/workers.py``).
    cpu_decode_kernel: on the CPU (the torch attention backend), decode-only steps attend with
    the C kernel that reads the paged cache in place (``kernels/cpu/decode_attention.py``, built
    at first use); False keeps torch's gather and SDPA, whose bits equal Hugging Face's sdpa
    attention (the kernel's differ by fp32 rounding; fp32 greedy tokens still equal HF's).
    grammar_compile_timeout_s: CPU seconds one structured-output constraint may take to compile
    (and to walk a few tokens) before the server refuses it with a 400
    (``engine/grammar/compiles.py``).
    grammar_compile_memory: bytes of memory that compile may grow by before it is refused.
    max_pending_grammar_compiles: distinct constraints compiling or waiting to compile; a new one
    beyond is refused with a 503 (identical constraints share one compile).
    grammar_fill_timeout_s: seconds one row's grammar mask may take to fill at a step; a request
    whose mask takes longer fails alone (``engine/sample/token_mask.py``).
    speculative_config: speculative decoding (``engine/spec/``): a ``SpeculativeConfig``, None
    for none, or ``"auto"``: prompt lookup with its defaults on the CPU, none on CUDA.
    runner, convert: vLLM's ``--runner auto|generate|pooling`` and ``--convert
    auto|embed|classify``: what the model is served for (``engine/model/model_task.py``; the
    engine replaces ``auto`` by what it resolved once the model is loaded).
    mm_processor_kwargs: keyword arguments for a vision-language model's processor call (vLLM's
    ``--mm-processor-kwargs``: ``{"do_normalize": false}``, Qwen's ``max_pixels``), as they are.
    hf_overrides: config fields set over the checkpoint's ``config.json`` before the model is
    built (vLLM's ``--hf-overrides``: ``is_matryoshka``, ``classifier_from_token``, ...).
    lora: LoRA adapters served on the model (``engine/lora/``), None without ``--enable-lora``.
    kv_cache_dtype: ``auto`` (the model's dtype) or a quantized cache's codes, ``int8``,
    ``fp8``/``fp8_e4m3``, ``fp8_e5m2`` (``engine/kv/kv_dtype.py``); kv_cache_dtype_skip_layers:
    decoder layer indices whose cache stays in the model's dtype.
    state_snapshot_interval: tokens between the state snapshots a model with state slots
    (gated DeltaNet, Mamba-2, short convolutions) keeps for prefix caching, a multiple of
    ``block_size`` (0: no snapshots, so such a model gets no prefix hits);
    num_state_snapshots: how many are kept, least recently used dropped first (None:
    ``max_num_seqs``), their memory taken from the KV budget (``engine/sched/state_snapshots.py``).
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    block_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    quantization: str | None = None
    seed: int | None = None
    tensor_parallel_size: int = 1
    cpu_decode_kernel: bool = True
    grammar_compile_timeout_s: float = 10.0
    grammar_compile_memory: int = 1 << 30
    max_pending_grammar_compiles: int = 16
    grammar_fill_timeout_s: float = 0.1
    speculative_config: SpeculativeConfig | Literal["auto"] | None = "auto"
    runner: str = "auto"
    convert: str = "auto"
    hf_overrides: dict[str, object] | None = None
    mm_processor_kwargs: dict[str, object] | None = None
    lora: LoRAConfig | None = None
    kv_cache_dtype: str = "auto"
    kv_cache_dtype_skip_layers: tuple[int, ...] = ()
    state_snapshot_interval: int = 256
    num_state_snapshots: int | None = None

    @property
    def state_snapshot_rows(self) -> int:
        """State-cache rows a model with state slots keeps for snapshots (0 without prefix
        caching or an interval)."""
        if not (self.enable_prefix_caching and self.state_snapshot_interval):
            return 0
        return self.num_state_snapshots or self.max_num_seqs

    def __post_init__(self) -> None:
        kv_code_dtype(self.kv_cache_dtype)  # ValueError naming the choices
        interval = self.state_snapshot_interval
        if interval < 0 or interval % self.block_size:
            raise ValueError(
                f"state_snapshot_interval must be a multiple of block_size {self.block_size} "
                f"(tokens; 0 for none), got {interval}"
            )
        if self.num_state_snapshots is not None and self.num_state_snapshots < 1:
            raise ValueError(f"num_state_snapshots must be >= 1, got {self.num_state_snapshots}")
        for name in ("grammar_compile_timeout_s", "grammar_fill_timeout_s"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ValueError(f"{name} must be finite seconds > 0, got {value}")
        for name in ("grammar_compile_memory", "max_pending_grammar_compiles"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be >= 1 (processes to shard the model over), "
                f"got {self.tensor_parallel_size}"
            )
        if not (
            self.speculative_config in ("auto", None)
            or isinstance(self.speculative_config, SpeculativeConfig)
        ):
            raise ValueError(
                "speculative_config must be a SpeculativeConfig, None or 'auto', got "
                f"{self.speculative_config!r}"
            )
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        if self.convert not in CONVERTS:
            raise ValueError(f"convert must be one of {CONVERTS}, got {self.convert!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
