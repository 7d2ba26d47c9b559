"""The engine's command-line flags, shared by ``paged-generate``, ``paged-serve`` and a
tensor-parallel rank started by hand (``python -m paged_serve.engine.executor.rank``).

``add_engine_args`` adds them to a parser in vLLM's help groups; ``engine_kwargs`` turns the
parsed flags into ``EngineConfig`` keyword arguments. It imports only the configuration, so
every entry point can import it without loading the engine.
"""

from __future__ import annotations

import argparse
import json

from paged_serve.engine.config import (
    ATTENTION_BACKENDS,
    CONVERTS,
    DTYPES,
    QUANTIZATIONS,
    RUNNERS,
    EngineConfig,
)
from paged_serve.engine.kv.kv_dtype import KV_CACHE_DTYPES
from paged_serve.engine.lora.lora_args import add_lora_args, lora_config
from paged_serve.engine.spec.config import SpeculativeConfig


def add_engine_args(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """The engine flags shared by paged-generate and paged-serve, in vLLM's help groups; returns
    the groups by title so a caller can add its own flags to them."""
    groups = {
        title: parser.add_argument_group(title)
        for title in ("ModelConfig", "CacheConfig", "ParallelConfig", "SchedulerConfig")
    }
    model = groups["ModelConfig"]
    model.add_argument(
        "--model",
        default=None,
        help="HF model id or folder, or a .gguf file (default: embedded SmolLM2)",
    )
    model.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="auto: bfloat16 on CUDA and on CPUs with native bf16 (AVX512-BF16, AMX), float32 "
        "elsewhere; float32 gives tokens equal to Hugging Face fp32",
    )
    model.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=QUANTIZATIONS,
        help="a checkpoint stored quantized is read as its config.json says (gptq, awq, "
        "compressed-tensors, fp8; naming one checks it, as vLLM's flag; gptq_marlin, awq_marlin "
        "are accepted for the same files); int8 or int4 make weight-only projections on the CPU "
        "from a full-precision checkpoint (faster decoding at low concurrency, tokens that "
        "differ from the unquantized model's: int8 one scale per row, int4 4-bit codes with a "
        "scale and offset per 32 inputs, as llama.cpp's Q4_1)",
    )
    model.add_argument(
        "--runner",
        default="auto",
        choices=RUNNERS,
        help="generate: text generation; pooling: embeddings, classification, scores and "
        "rerank (auto: pooling for encoders, *ForSequenceClassification and sentence-"
        "transformers folders, generate for other causal LMs)",
    )
    model.add_argument(
        "--convert",
        default="auto",
        choices=CONVERTS,
        help="what a pooling model answers: embed (embeddings) or classify (label scores, "
        "cross-encoder scores); auto: classify for a classifier, else embed",
    )
    model.add_argument(
        "--hf-overrides",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="config fields set over config.json, e.g. '{\"is_matryoshka\": true}' or "
        '\'{"classifier_from_token": ["no", "yes"]}\' (a Qwen3-Reranker scored from its yes/no '
        "logits)",
    )
    model.add_argument(
        "--mm-processor-kwargs",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="keyword arguments for a vision-language model's processor call, e.g. "
        "'{\"do_normalize\": false}' or Qwen's '{\"max_pixels\": 1003520}'",
    )
    model.add_argument("--device", default="auto")
    model.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    model.add_argument("--max-model-len", type=int, default=None)
    model.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step eagerly: no CUDA graphs for decode steps (they need CUDA + triton)",
    )
    model.add_argument(
        "--no-cpu-decode-kernel",
        action="store_true",
        help="on the CPU, attend decode steps with torch's gather and SDPA (the bits of Hugging "
        "Face's sdpa attention) instead of the C kernel that reads the paged cache in place",
    )
    cache = groups["CacheConfig"]
    cache.add_argument("--block-size", type=int, default=16)
    cache.add_argument(
        "--kv-cache-memory",
        type=int,
        default=None,
        help="KV cache bytes (default: 1 GiB on CPU; on CUDA, --gpu-memory-utilization decides)",
    )
    cache.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    cache.add_argument(
        "--kv-cache-dtype",
        choices=sorted(KV_CACHE_DTYPES),
        default="auto",
        help="auto: the model's dtype; int8 or fp8 (fp8_e4m3, fp8_e5m2): one-byte codes with an "
        "fp32 scale per token and KV head, about 3.8x the tokens of fp32 (1.9x of bf16)",
    )
    cache.add_argument(
        "--kv-cache-dtype-skip-layers",
        type=int,
        nargs="+",
        default=[],
        metavar="LAYER",
        help="decoder layers whose KV cache stays in the model's dtype under --kv-cache-dtype "
        "int8/fp8 (default: none)",
    )
    cache.add_argument(
        "--state-snapshot-interval",
        type=int,
        default=256,
        metavar="TOKENS",
        help="a model with per-sequence state (gated DeltaNet, Mamba-2, LFM2) keeps its state "
        "every TOKENS tokens (a multiple of --block-size) so prefix hits can resume there; 0: "
        "no prefix caching for such models (default: 256)",
    )
    cache.add_argument(
        "--num-state-snapshots",
        type=int,
        default=None,
        metavar="N",
        help="state snapshots kept (least recently used dropped first), from the KV cache's "
        "memory (default: --max-num-seqs)",
    )
    cache.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of prompt prefixes seen before (default: on)",
    )
    cache.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="the same as --no-enable-prefix-caching",
    )
    parallel = groups["ParallelConfig"]
    parallel.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="shard the model over this many processes (one GPU each on CUDA; gloo on CPU)",
    )
    scheduler = groups["SchedulerConfig"]
    scheduler.add_argument("--max-num-seqs", type=int, default=64)
    scheduler.add_argument("--max-num-batched-tokens", type=int, default=2048)
    spec = parser.add_argument_group("SpeculativeConfig")
    spec.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default="auto",
        help='speculative decoding as vLLM\'s JSON, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or '
        '\'{"method": "draft_model", "model": PATH}\'; \'off\' for none (default: auto, '
        "prompt lookup on the CPU, none on CUDA); outputs are the same either way",
    )
    spec.add_argument(
        "--no-speculation",
        dest="speculative_config",
        action="store_const",
        const=None,
        help="never speculate (the same as --speculative-config off)",
    )
    add_lora_args(parser)
    _add_grammar_args(parser)
    return groups


def _add_grammar_args(parser: argparse.ArgumentParser) -> None:
    """The structured-output budgets (EngineConfig's grammar_* fields)."""
    default = EngineConfig()
    group = parser.add_argument_group("structured outputs")
    group.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=default.grammar_compile_timeout_s,
        help="CPU seconds a response_format, tools or structured_outputs constraint may take to "
        "compile before it is refused with a 400 (default %(default)s)",
    )
    group.add_argument(
        "--grammar-compile-memory",
        type=int,
        default=default.grammar_compile_memory >> 20,
        help="MiB of memory that compile may grow by before it is refused (default %(default)s)",
    )
    group.add_argument(
        "--max-pending-grammar-compiles",
        type=int,
        default=default.max_pending_grammar_compiles,
        help="distinct constraints compiling or queued to compile; more are refused with a 503 "
        "(default %(default)s)",
    )
    group.add_argument(
        "--grammar-fill-timeout",
        type=float,
        default=default.grammar_fill_timeout_s,
        help="seconds one request's grammar mask may take to compute per token; a request "
        "past it fails alone (default %(default)s)",
    )


def _speculative_config(text: str) -> SpeculativeConfig | str | None:
    """``--speculative-config``'s value, checked (argparse reports a ValueError's message)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _json_object(text: str) -> dict[str, object]:
    """``--hf-overrides``, ``--mm-processor-kwargs``: a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments from the parsed shared flags (ValueError naming a flag
    that needs another: ``--lora-modules`` without ``--enable-lora``)."""
    return dict(
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager,
        quantization=args.quantization,
        tensor_parallel_size=args.tensor_parallel_size,
        cpu_decode_kernel=not args.no_cpu_decode_kernel,
        grammar_compile_timeout_s=args.grammar_compile_timeout,
        grammar_compile_memory=args.grammar_compile_memory << 20,
        max_pending_grammar_compiles=args.max_pending_grammar_compiles,
        grammar_fill_timeout_s=args.grammar_fill_timeout,
        speculative_config=args.speculative_config,
        runner=args.runner,
        convert=args.convert,
        hf_overrides=args.hf_overrides,
        mm_processor_kwargs=args.mm_processor_kwargs,
        lora=lora_config(args),
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_dtype_skip_layers=tuple(args.kv_cache_dtype_skip_layers),
        state_snapshot_interval=args.state_snapshot_interval,
        num_state_snapshots=args.num_state_snapshots,
    )
