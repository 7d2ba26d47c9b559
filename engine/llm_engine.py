"""The synchronous engine: add requests, call ``step()``, collect outputs.

One ``step()``::

    batch = scheduler.schedule()             which requests run, how many tokens each
    result = runner.execute(batch, tables)   the forward and the draw
    accepted = scheduler.update(batch, result)  KV kept or trimmed, blocks committed, forks
    outputs.process(result, accepted)        tokens appended, detokenized, stop checks, finishes
    speculator.observe(...)                  each drafted sequence's pace

Not thread-safe: the async engine drives it from a single thread.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Sequence

import torch

from paged_serve.engine.config import EngineConfig
from paged_serve.engine.errors import InvalidRequestError
from paged_serve.engine.executor.workers import TensorParallelWorkers
from paged_serve.engine.grammar.structured_output import GrammarCompiler, StructuredOutput
from paged_serve.engine.lora.registry import lora_adapter, lora_registry
from paged_serve.engine.model.architecture import check_servable, text_config
from paged_serve.engine.model.image_prompts import multimodal_prompt
from paged_serve.engine.model.loader import LoadedModel
from paged_serve.engine.multimodal_inputs import MultimodalPrompt, attach_images
from paged_serve.engine.observe.metrics import EngineStats
from paged_serve.engine.observe.weight_memory import weight_memory
from paged_serve.engine.outputs import RequestOutput
from paged_serve.engine.platform.platform import platform_for
from paged_serve.engine.pooling.pooling_model import check_task, pooling_model
from paged_serve.engine.pooling_params import PoolingParams
from paged_serve.engine.runner.build import build_runner, context_length, load_for
from paged_serve.engine.sampling_params import SamplingParams
from paged_serve.engine.sched.admission import (
    check_cache_salt,
    check_pooling_request,
    check_request,
    prompt_token_ids,
)
from paged_serve.engine.sched.block_manager import BlockManager
from paged_serve.engine.sched.forks import make_samples, sample_ids
from paged_serve.engine.sched.live_request import LiveRequest
from paged_serve.engine.sched.scheduler import Scheduler
from paged_serve.engine.sched.state_slots import StateSlots
from paged_serve.engine.sched.state_snapshots import state_snapshots
from paged_serve.engine.spec.build import build_speculator
from paged_serve.engine.step_outputs import StepOutputs

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int] | MultimodalPrompt


class LLMEngine:
    """Owns the model runner, the scheduler and every live request."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.config = config
        self.platform = platform_for(config.device)  # the one platform: handed to every part
        self.device = self.platform.device
        share_model = loaded is not None
        if loaded is None:
            loaded = load_for(config, self.platform)
        # what the model is served for, resolved: every rank prepares the same model
        config = self.config = dataclasses.replace(
            config, runner=loaded.task.runner, convert=loaded.task.convert or config.convert
        )
        self.loaded = loaded
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.max_model_len = context_length(config, loaded.max_model_len)
        self.tp: TensorParallelWorkers | None = None
        if config.tensor_parallel_size > 1:  # shards the model in place, the workers their copies
            check_servable(loaded.model, pooling=loaded.task.pooling)
            self.tp = TensorParallelWorkers.start(
                config,
                loaded.model,
                self.platform,
                max_model_len=self.max_model_len,
                share_model=share_model,
                sharded=loaded.shard is not None,
            )
        try:
            self._build(config, loaded)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, config: EngineConfig, loaded: LoadedModel) -> None:
        self.vocab_size = int(text_config(loaded.model).vocab_size)
        self.grammars = (
            GrammarCompiler(
                self.tokenizer,
                vocab_size=self.vocab_size,
                stop_token_ids=sorted(self.eos_token_ids),
            )
            if self.tokenizer is not None
            else None
        )
        task = loaded.task
        self.runner = build_runner(
            loaded.model,
            config,
            self.platform,
            max_model_len=self.max_model_len,
            eos_token_ids=sorted(self.eos_token_ids),
            group=lambda: None if self.tp is None else self.tp.group,
            pooling=(
                (lambda m: pooling_model(m, self.tokenizer, loaded.path, task.convert))
                if task.pooling
                else None
            ),
        )
        self.pooling = self.runner.pooling  # a pooling model's pipeline, None when generating
        budget = config.max_num_batched_tokens
        whole_prompts = self.pooling is not None and not self.pooling.causal
        if self.pooling is not None:
            self.max_model_len, budget = self.pooling.limits(self.max_model_len, budget)
            logger.info("%s", self.pooling.describe())
        self.weights = weight_memory(
            loaded.model, next(loaded.model.parameters()).dtype, loaded.quantization
        )
        logger.info("%s", self.weights.describe())
        state_cache = self.runner.state_cache
        snapshots = None if state_cache is None else state_snapshots(state_cache, config)
        # Without snapshots, a hit would skip tokens whose per-sequence state was never kept.
        prefix_caching = config.enable_prefix_caching and (state_cache is None or snapshots)
        if whole_prompts:  # an encoder's keys depend on the tokens after them too
            prefix_caching = False
        self.block_manager = BlockManager(
            self.runner.kv_cache.num_blocks,
            config.block_size,
            enable_prefix_caching=prefix_caching,
            state_slots=None if state_cache is None else StateSlots(state_cache.num_slots),
            state_snapshots=snapshots,
        )
        self.speculator = (
            None
            if self.pooling is not None  # nothing is generated, so nothing is drafted
            else build_speculator(
                config, loaded, self.platform, max_model_len=self.max_model_len, hybrid=state_cache
            )
        )
        self.loras = lora_registry(config, self.runner.adapters, reserved={self.model_name})
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=budget,
            speculator=self.speculator,
            whole_prompts=whole_prompts,
            adapter_slots=None if self.loras is None else self.loras.slots,
        )
        self.stats = EngineStats()
        # Seeds of unseeded requests: from the OS, so a restart does not replay the same
        # "random" outputs, unless the engine itself is given a seed (reproducible runs).
        self._rng = random.Random(config.seed) if config.seed is not None else random.SystemRandom()
        self.outputs = StepOutputs(
            self.scheduler,
            self.stats,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
        )
        self._next_id = 0
        self.num_steps = 0  # steps that ran a batch through the model

    @property
    def backend_name(self) -> str:
        """The attention backend the runner uses: ``torch`` or ``triton``."""
        return self.runner.backend.name

    @property
    def workers_alive(self) -> bool:
        """Every tensor-parallel worker runs (True without tensor parallelism)."""
        return self.tp is None or self.tp.alive()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; the engine cannot step after)."""
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.sampler.shutdown()
        if self.tp is not None:
            self.tp.close()

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a text prompt (with the tokenizer's special tokens), a checked id list,
        or a prompt with images (``multimodal_prompt``; ValueError for a model without images)."""
        if isinstance(prompt, MultimodalPrompt):
            if prompt.images and self.runner.encoder is None:
                raise InvalidRequestError(f"{self.model_name} takes no images", "images")
            prompt = prompt.token_ids
        return prompt_token_ids(prompt, self.tokenizer, self.vocab_size)

    def multimodal_prompt(self, text: str, images: Sequence[object]) -> MultimodalPrompt:
        """``text`` (one image marker per image, as the model's processor expects) and its
        PIL ``images`` through the model's processor (engine/model/image_prompts.py)."""
        if self.loaded.processor is None or self.runner.encoder is None:
            raise InvalidRequestError(f"{self.model_name} takes no images", "images")
        processor, config = self.loaded.processor, self.loaded.model.config
        return multimodal_prompt(processor, config, text, images, self.config.mm_processor_kwargs)

    def validate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        pooling: PoolingParams | None = None,
    ) -> None:
        """Raise ValueError if the request can never run (engine/sched/admission.py), or its
        output constraint does not compile; a pooling request (``pooling``) to a generating
        model, or a generating one to a pooling model, can never run either."""
        check_task(pooling, self.pooling)
        if pooling is not None:
            self.pooling.check(pooling)
            check_pooling_request(
                prompt_token_ids,
                pooling,
                max_model_len=self.max_model_len,
                block_manager=self.block_manager,
            )
            return
        check_request(
            prompt_token_ids,
            params,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            block_manager=self.block_manager,
        )
        if params.structured_output is not None:
            self.compile_grammar(params.structured_output)

    def compile_grammar(self, constraint: StructuredOutput) -> object:
        """The compiled grammar of a structured-output constraint (cached; thread-safe, so a
        server compiles in a worker thread first). Raises InvalidRequestError."""
        if self.grammars is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer")
        return self.grammars.compile(constraint)

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
        pooling: PoolingParams | None = None,
        lora: str | None = None,
    ) -> str:
        """Queue a request and return its id. Raises ValueError for a request that cannot run.

        A pooling model takes pooling requests only (``pooling``, engine/pooling_params.py):
        the prompt is run and pooled, and its one output carries the answer (``pooled``);
        ``params`` then only carries ``n == 1``.

        With ``params.n > 1`` the prompt is prefilled once and forked into ``n`` samples sharing its
        blocks (copy-on-write); their ids are ``sample_ids(request_id, params.n)``, and sample ``i``
        draws with seed ``params.seed + i`` when a seed is given, so it equals a single request
        with that seed.
        ``cache_salt`` (vLLM's): the prefix cache serves this request only blocks computed for
        requests with the same salt (None: the unsalted blocks); a non-empty string.
        ``lora``: the name of a served LoRA adapter the request runs with (``engine/lora/``).
        """
        check_cache_salt(cache_salt)
        adapter = None if lora is None else lora_adapter(self.loras, lora)
        ids = self.tokenize(prompt)
        self.validate(ids, params, pooling)
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if any(rid in self.outputs.live for rid in sample_ids(request_id, params.n)):
            raise ValueError(f"request id {request_id!r} is already in use")
        samples = make_samples(
            request_id, ids, params, lambda: self._rng.getrandbits(63), cache_salt
        )
        if params.structured_output is not None:
            compiled = self.compile_grammar(params.structured_output)
            deferred = params.structured_output_after is not None
            for sample in samples:
                if deferred:
                    sample.deferred_matcher = self.grammars.matcher(compiled)
                else:
                    sample.matcher = self.grammars.matcher(compiled)
        if pooling is not None:
            samples[0].pooling = pooling
            samples[0].whole_prompt = self.pooling.reads_every_token
        if isinstance(prompt, MultimodalPrompt):
            attach_images(samples, prompt)
        for sample in samples:
            sample.lora = adapter
            self.outputs.live[sample.request_id] = LiveRequest.start(sample, self.tokenizer)
        self.scheduler.add(samples[0])
        self.stats.prompt_tokens_total += len(ids)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request now (its blocks are freed at once); None if it is not live."""
        live = self.outputs.live.get(request_id)
        if live is None:
            return None
        return self.outputs.finish(live, "abort", now=time.monotonic())

    @property
    def has_unfinished(self) -> bool:
        return bool(self.outputs.live)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_graph_steps(self) -> int:
        """Steps that replayed a captured decode graph (0 when none were captured)."""
        graphs = self.runner.graphs
        return 0 if graphs is None else sum(graphs.replays.values())

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Run one batch; return an output for every request that produced a token or ended."""
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        tables = [self.block_manager.block_table(s.request.request_id) for s in batch.requests]
        if self.tp is not None:
            self.tp.check()  # a worker that died between steps: fail before broadcasting
        try:
            result = self.runner.execute(batch, tables)
        except (torch.OutOfMemoryError, MemoryError) as exc:
            if self.tp is not None:  # the ranks may be out of step now: the group cannot go on
                raise self.tp.failure(exc) from exc
            # The step's size is bounded by the configuration, but a device can still run short
            # (another process, fragmentation): fail this step's requests, keep the engine.
            logger.error("step of %d requests ran out of memory: %s", len(batch.requests), exc)
            return self.outputs.fail_step(
                batch, "the server ran out of memory running this request"
            )
        except RuntimeError as exc:
            if self.tp is None:
                raise
            # A rank died or raised: the group cannot go on. Name the rank and its cause.
            raise self.tp.failure(exc) from exc
        self.num_steps += 1
        accepted = self.scheduler.update(batch, result)
        outputs = self.outputs.process(result, accepted)
        drafts = batch.drafts
        for request_id, count in accepted.items():
            self.speculator.observe(request_id, len(drafts[request_id]), count)
        return outputs
