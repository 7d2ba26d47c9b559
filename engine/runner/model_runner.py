"""Run one scheduled step through the Hugging Face model as a single flat ragged batch.

Each scheduled request contributes ``num_new_tokens`` consecutive tokens; they are concatenated
into ``input_ids [1, T]`` with their true positions in ``position_ids [1, T]`` (no padding, no HF
cache object). The attention metadata goes in an ``AttentionContext``; the LM head runs only at
the last scheduled token of each request that samples this step. Decode-shaped steps replay a
CUDA graph instead when ``enable_decode_graphs`` captured one that holds them.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from paged_serve.engine.config import EngineConfig
from paged_serve.engine.kv.attention_context import AttentionContext, attention_context
from paged_serve.engine.kv.kv_cache import KVCache
from paged_serve.engine.kv.kv_dtype import kv_code_dtype
from paged_serve.engine.kv.lora_step import LoRAStep, lora_step
from paged_serve.engine.kv.state_cache import StateCache, linear_state_shape
from paged_serve.engine.lora.adapter_files import LoRAAdapter
from paged_serve.engine.lora.model_adapters import ModelAdapters
from paged_serve.engine.model.architecture import (
    decoder_model,
    is_multimodal,
    runs_fast_body,
    text_config,
)
from paged_serve.engine.model.body import ModelBody
from paged_serve.engine.model.logits_head import LogitsHead
from paged_serve.engine.model.mamba_mixer import mamba_state_shape
from paged_serve.engine.model.model_task import position_offset
from paged_serve.engine.model.short_conv import short_conv_state_shape
from paged_serve.engine.platform.host_tensors import to_device
from paged_serve.engine.platform.platform import Platform
from paged_serve.engine.pooling.pooler import pool_step
from paged_serve.engine.pooling.pooling_model import PoolingModel
from paged_serve.engine.runner.decode_graphs import DecodeGraphs, GraphCapture, capture_or_eager
from paged_serve.engine.runner.image_embeddings import EncoderCache, StepImages
from paged_serve.engine.runner.prompt_logprobs import (
    PromptScores,
    PromptScoring,
    plan_prompt_scoring,
    score_prompt,
)
from paged_serve.engine.runner.step_inputs import StepInputs, flatten_step
from paged_serve.engine.runner.step_message import STEP, StepMessage, pack_step
from paged_serve.engine.sample.sampler import Sampler
from paged_serve.engine.sample.sampling_rows import sampling_rows
from paged_serve.engine.sched.batch import ScheduledBatch, StepResult

if TYPE_CHECKING:
    from paged_serve.engine.parallel.group import TensorParallelGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LaunchedStep:
    """A step whose device work is queued: sampled ids ``[B]``, their logprobs ``[B]`` and the
    optional top-k ``(values, indices)``, still on the device."""

    request_ids: list[str]
    tokens: torch.Tensor | None
    logprobs: torch.Tensor | None
    top: tuple[torch.Tensor, torch.Tensor] | None
    prompt_scores: PromptScores | None = None
    failed: dict[str, tuple[int, str]] = field(default_factory=dict)
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)
    pool_states: dict[str, torch.Tensor] = field(default_factory=dict)

    def read(self) -> StepResult:
        """Wait for the device and return the step's results as Python values."""
        prompt = self.prompt_scores.read() if self.prompt_scores is not None else {}
        if self.tokens is None or self.logprobs is None:
            pooled = {request_id: row.tolist() for request_id, row in self.pooled.items()}
            return StepResult([], [], [], [], prompt, pooled=pooled, pool_states=self.pool_states)
        token_ids = self.tokens.tolist()  # the sync
        top: list[list[tuple[int, float]]] = [[] for _ in token_ids]
        if self.top is not None:
            values, indices = self.top
            top = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
        logprobs = self.logprobs.tolist()
        return StepResult(self.request_ids, token_ids, logprobs, top, prompt, self.failed)


class ModelRunner:
    """Owns the model, the KV cache, the attention backend and the sampler; executes
    ``ScheduledBatch``es.

    Construction sizes the KV cache from the platform's memory budget
    (``Platform.kv_budget_bytes``) and, where the platform captures them (CUDA with the triton
    backend, unless ``enforce_eager``), decode graphs for batch sizes up to ``max_num_seqs``.

    A pooling model's runner (``pooling``, the driver's; ``config.runner == "pooling"`` on
    every rank) pools each prompt (``engine/pooling/``) instead of sampling, and captures no
    decode graph.

    With LoRA (``adapters``: the model's projections wrapped with adapter slots) each token
    adds its request's adapter (``engine/lora/``); a step first fills the slots it names.

    With ``tp`` (tensor parallelism) the model is this rank's shard: the KV cache holds the
    local KV heads, its budget is the smallest of all ranks', the driver (rank 0) sends each
    step to the workers before running it, and a worker runs ``run_worker_step``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig,
        platform: Platform,
        *,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        tp: TensorParallelGroup | None = None,
        pooling: PoolingModel | None = None,
        adapters: ModelAdapters | None = None,
    ):
        self.model = model
        self.tp = tp
        self.pooling = pooling
        self.adapters = adapters
        # what the model's forward takes besides ids and positions (an encoder has no cache)
        forward_args = inspect.signature(decoder_model(model).forward).parameters
        self._use_cache = {"use_cache": False} if "use_cache" in forward_args else {}
        self._position_offset = position_offset(model)  # every rank: RoBERTa's positions
        self.eos_token_ids = eos_token_ids  # blocked while a row is short of its min_tokens
        self.platform = platform
        self.device = device = platform.device
        dtype = next(model.parameters()).dtype
        # Quantized weights are not HF's: in bf16, HF's slow layout for a row alone would buy
        # nothing (in fp32 both layouts take the same time, and HF's keeps the tests exact).
        group_alone = config.quantization is not None and dtype != torch.float32
        self.backend = self.platform.kernels(config, group_alone=group_alone)
        self.sampler = Sampler(
            self.backend.sample,
            device=device,
            eos_token_ids=eos_token_ids,
            fill_timeout_s=config.grammar_fill_timeout_s,
        )
        budget = self.platform.kv_budget_bytes(config)
        if tp is not None:  # equal blocks on every rank: the smallest budget decides
            budget = tp.min_over_ranks(budget)
        # A hybrid model's linear-attention state: one slot per seat, taken from the budget first.
        self.state_cache: StateCache | None = None
        hf_config = text_config(model)
        shape = linear_state_shape(hf_config, 1 if tp is None else tp.world_size)
        shape = shape or mamba_state_shape(model) or short_conv_state_shape(model)
        if shape is not None:
            self.state_cache = StateCache(
                shape,
                num_slots=config.max_num_seqs,
                dtype=dtype,
                device=device,
                num_snapshots=config.state_snapshot_rows,
            )
            if self.state_cache.num_bytes >= budget:
                raise ValueError(
                    f"the linear-attention state of {config.max_num_seqs} sequences takes "
                    f"{self.state_cache.num_bytes / 2**20:.1f} MiB of a {budget / 2**20:.1f} MiB "
                    "KV budget, leaving no KV block: lower max_num_seqs or raise the budget"
                )
            budget -= self.state_cache.num_bytes
            logger.info(
                "linear-attention state: %d slots x %d layers, %.1f MiB",
                config.max_num_seqs,
                len(shape.layer_ids),
                self.state_cache.num_bytes / 2**20,
            )
        self.kv_cache = KVCache.for_model(
            hf_config,
            budget_bytes=budget,
            block_size=config.block_size,
            dtype=dtype,
            device=device,
            tensor_parallel_size=1 if tp is None else tp.world_size,
            cache_dtype=kv_code_dtype(config.kv_cache_dtype),
            skip_layers=frozenset(config.kv_cache_dtype_skip_layers),
            stateless_blocks=config.max_num_seqs * -(-max_model_len // config.block_size),
        )
        self.block_size = config.block_size
        self.vocab_size = int(hf_config.vocab_size)
        # The decoder body without HF's per-layer Python (engine/model/body/) for the families
        # it reproduces bit for bit; None runs HF's own decoder forward (every other family).
        self.body: ModelBody | None = (
            ModelBody(model, fused_rms_norm=platform.fused_rms_norm)
            if runs_fast_body(model)
            else None
        )
        self.lm_head = LogitsHead.of(model)
        # a vision-language model's encoder outputs, by image (runner/image_embeddings.py)
        self.encoder: EncoderCache | None = EncoderCache(model) if is_multimodal(model) else None
        self.graphs: DecodeGraphs | None = None
        self.platform.prepare_host()
        pools = config.runner == "pooling"
        if not pools and self.platform.captures_decode_graphs(config, self.backend):
            self._capture_decode_graphs(config.max_num_seqs, max_model_len)

    def _capture_decode_graphs(self, max_batch_size: int, max_model_len: int) -> None:
        """Capture decode graphs; a capture that fails is logged and the runner stays eager:
        slower, never wrong."""
        graphs = DecodeGraphs(
            self.model,
            self.kv_cache,
            self.backend,
            max_batch_size=max_batch_size,
            max_model_len=max_model_len,
            with_logits=self.tp is None or self.tp.is_driver,
            state_cache=self.state_cache,
            max_loras=0 if self.adapters is None else self.adapters.config.max_loras,
        )
        self.graphs = capture_or_eager(graphs, self.device, self.tp)

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(data, dtype, self.device)

    def enable_decode_graphs(self, graphs: DecodeGraphs, capturer: GraphCapture) -> None:
        """Capture ``graphs`` now; from then on decode-shaped steps that fit replay them."""
        graphs.capture(capturer)
        self.graphs = graphs

    def build_context(self, inputs: StepInputs) -> tuple:
        """Device tensors of a flat step: (input_ids [T], position_ids [T], AttentionContext)."""
        width = max(len(t) for t in inputs.block_tables)
        padded = [t + [0] * (width - len(t)) for t in inputs.block_tables]
        positions = self._tensor(inputs.positions, torch.long)
        ctx = AttentionContext(
            cu_seqlens_q=self._tensor(inputs.cu_seqlens, torch.int32),
            seq_lens=self._tensor(inputs.seq_lens, torch.int32),
            block_tables=self._tensor(padded, torch.int32),
            slot_mapping=self._tensor(inputs.slots, torch.int64),
            max_seqlen_q=inputs.max_seqlen_q,
            max_seqlen_k=max(inputs.seq_lens),
            kv_cache=self.kv_cache,
            backend=self.backend,
            lora=self._lora_step(inputs),
            positions=positions,
            **self._state_context(inputs),
        )
        return self._tensor(inputs.input_ids, torch.long), positions, ctx

    def _lora_step(self, inputs: StepInputs) -> LoRAStep | None:
        """Each token's adapter slot, when a request of the step has an adapter."""
        if self.adapters is None or not inputs.lora_slots:
            return None
        return lora_step(inputs.lora_slots, self.adapters.dtype, self.device)

    def _fill_adapters(self, loads: list[tuple[int, LoRAAdapter]]) -> None:
        for slot, adapter in loads:
            self.adapters.fill(slot, adapter)

    def _state_context(self, inputs: StepInputs) -> dict:
        """The linear-attention fields of a hybrid model's context (none for other models)."""
        if self.state_cache is None:
            return {}
        return {
            "state_cache": self.state_cache,
            "state_slots": self._tensor(inputs.state_slots, torch.int32),
            "has_state": self._tensor(inputs.has_state, torch.int32),
        }

    def hidden_states(self, inputs: StepInputs, images: StepImages | None = None) -> torch.Tensor:
        """The eager forward of the model body: final-norm hidden states ``[T, hidden]``.
        ``images``: the step's image placeholders, embedded from their images' encoder outputs."""
        input_ids, position_ids, ctx = self.build_context(inputs)
        with attention_context(ctx):
            if self.body is not None:
                return self.body(input_ids, position_ids)
            extra = dict(self._use_cache)
            if images is not None:  # placeholders take their images' encoder rows
                rows, batch = images
                extra["inputs_embeds"] = self.encoder.embeddings(input_ids, rows, batch)[None]
            else:
                extra["input_ids"] = input_ids[None]
            if inputs.token_type_ids:
                extra["token_type_ids"] = self._tensor(inputs.token_type_ids, torch.long)[None]
            if self._position_offset:
                position_ids = position_ids + self._position_offset
            out = decoder_model(self.model)(position_ids=position_ids[None], **extra)
            return out.last_hidden_state[0]

    def forward(
        self,
        inputs: StepInputs,
        scoring: PromptScoring | None = None,
        images: StepImages | None = None,
    ) -> tuple[torch.Tensor | None, PromptScores | None]:
        """Logits ``[len(logit_rows), V]`` of the step (None when no request samples) and the
        prompt scores ``scoring`` asks for; ``images`` as ``hidden_states`` takes them.

        Decode-shaped steps replay a captured graph when one holds them (never a step with
        image placeholders); others run eagerly.
        """
        if scoring is not None:
            return self._forward_scoring(inputs, scoring, images)
        return self._forward_logits(inputs, images), None

    def _forward_scoring(
        self, inputs: StepInputs, scoring: PromptScoring, images: StepImages | None
    ) -> tuple[torch.Tensor | None, PromptScores]:
        """The eager forward to hidden states, then the LM head on the sampled rows and, chunk
        by chunk, on the prompt rows being scored."""
        hidden = self.hidden_states(inputs, images)  # [T, H]
        return self._sampled_logits(hidden, inputs), score_prompt(hidden, self.lm_head, scoring)

    def _forward_logits(
        self, inputs: StepInputs, images: StepImages | None = None
    ) -> torch.Tensor | None:
        if images is None and self.graphs is not None and self.graphs.holds(inputs):
            logits = self.graphs.run(inputs)
            if not inputs.logit_rows:
                return None
            return logits.index_select(0, self._tensor(inputs.logit_rows, torch.long))
        return self._sampled_logits(self.hidden_states(inputs, images), inputs)

    def _sampled_logits(self, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor | None:
        """The LM head on the step's sampling rows of ``hidden [T, H]`` only; None when no
        request samples."""
        if not inputs.logit_rows:
            return None
        rows = self._tensor(inputs.logit_rows, torch.long)
        return self.lm_head(hidden.index_select(0, rows))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, block_tables: list[list[int]]) -> LaunchedStep:
        """Queue the step's device work: copy-on-write, forward, sampling. Never syncs."""
        inputs = flatten_step(batch, block_tables, self.block_size)
        if self.tp is not None:  # the workers run the same copies and forward on their shards
            message = StepMessage(
                STEP, batch.block_copies, inputs, batch.state_copies, batch.lora_loads
            )
            self.tp.send_packed_step(pack_step(message))
        self._fill_adapters(batch.lora_loads)
        self._copy_blocks(batch.block_copies)
        self._copy_states(batch.state_copies)
        if self.pooling is not None:
            return self._pool(batch, inputs)
        rows = sampling_rows(batch)
        draw = self.sampler.begin(rows, self.vocab_size)  # grammar masks fill during the forward
        images = None if self.encoder is None else self.encoder.step(batch)
        logits, prompt_scores = self.forward(inputs, plan_prompt_scoring(batch), images)
        sampled = draw.finish(logits)
        if sampled is None:
            return LaunchedStep([], None, None, None, prompt_scores)
        ids = [r.request_id for r in rows]
        first = {request_id: i for i, request_id in reversed(list(enumerate(ids)))}
        failed = {ids[i]: (i - first[ids[i]], message) for i, message in sampled.failed.items()}
        return LaunchedStep(
            ids, sampled.tokens, sampled.logprobs, sampled.top, prompt_scores, failed
        )

    def _pool(self, batch: ScheduledBatch, inputs: StepInputs) -> LaunchedStep:
        """A pooling model's step: the forward to hidden states, each prompt chunk pooled, and
        the answers of the prompts the step completes (``engine/pooling/pooler.py``)."""
        answers, states = pool_step(self.hidden_states(inputs), batch, self.pooling)
        return LaunchedStep([], None, None, None, pooled=answers, pool_states=states)

    def _copy_blocks(self, block_copies: list[tuple[int, int]]) -> None:
        if block_copies:
            mapping = self._tensor([list(p) for p in block_copies], torch.int64)
            for tensor in self.kv_cache.block_tensors():  # codes, their scales, values
                self.backend.copy_blocks(tensor, block_mapping=mapping)

    def _copy_states(self, state_copies: list[tuple[int, int]]) -> None:
        if state_copies and self.state_cache is not None:
            self.state_cache.copy_slots(state_copies)

    @torch.inference_mode()
    def run_worker_step(self, message: StepMessage) -> None:
        """A tensor-parallel worker's step: the driver's block copies and the model body on
        this rank's shard (same graph bucket or eager path, so the collectives pair up); no
        LM head, since only the driver samples."""
        inputs = message.inputs
        self._fill_adapters(message.lora_loads)
        self._copy_blocks(message.block_copies)
        self._copy_states(message.state_copies)
        if self.graphs is not None and self.graphs.holds(inputs):
            self.graphs.run(inputs)
            return
        self.hidden_states(inputs)

    def execute(self, batch: ScheduledBatch, block_tables: list[list[int]]) -> StepResult:
        """Run the step and read its sampled tokens back (the step's one host sync)."""
        return self.launch(batch, block_tables).read()
