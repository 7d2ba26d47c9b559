"""The synchronous engine: add requests, call ``step()``, collect outputs.

One ``step()`` = schedule a batch, run it through the model runner, append the sampled tokens,
detokenize, check stop conditions, and free the blocks of every request that finished. Not
thread-safe: the async engine drives it from a single thread.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence

import torch

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.grammar.structured_output import GrammarCompiler, StructuredOutput
from engine.model.attention_swap import check_supported
from engine.model.loader import LoadedModel, load_model
from engine.model.prep import prepare_model
from engine.observe.metrics import EngineStats
from engine.outputs import RequestOutput, TokenLogprob
from engine.parallel.workers import TensorParallelWorkers
from engine.platform.platform import platform_for
from engine.runner.model_runner import ModelRunner, StepResult
from engine.sample.sampler import INVALID_TOKEN
from engine.sampling_params import SamplingParams
from engine.sched.block_manager import BlockManager
from engine.sched.forks import detach, join_forks, make_samples, sample_ids, with_pending_forks
from engine.sched.live_request import LiveRequest, request_metrics
from engine.sched.scheduler import ScheduledBatch, Scheduler

logger = logging.getLogger(__name__)


class LLMEngine:
    """Owns the model runner, the scheduler and every live request."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.config = config
        self.platform = platform_for(config.device)
        self.device = self.platform.device
        tensor_parallel = config.tensor_parallel_size > 1
        share_model = loaded is not None
        if loaded is None:
            choice = self.platform.dtype(config.dtype)
            logger.info("weights in %s", choice)
            # Under tensor parallelism the whole model never goes to one device: only shards.
            load_device = torch.device("cpu") if tensor_parallel else self.device
            loaded = load_model(config.model, dtype=choice.dtype, device=load_device)
        self.loaded = loaded
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.max_model_len = min(config.max_model_len or loaded.max_model_len, loaded.max_model_len)
        self.tp: TensorParallelWorkers | None = None
        if tensor_parallel:  # shards the model in place; the workers shard their copies
            check_supported(loaded.model)
            self.tp = TensorParallelWorkers.start(
                config,
                loaded.model,
                self.device,
                max_model_len=self.max_model_len,
                share_model=share_model,
            )
        try:
            self._build(config, loaded)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, config: EngineConfig, loaded: LoadedModel) -> None:
        prepare_model(loaded.model, config, self.device)
        self.vocab_size = int(loaded.model.config.vocab_size)
        self.grammars = (
            GrammarCompiler(
                self.tokenizer,
                vocab_size=self.vocab_size,
                stop_token_ids=sorted(self.eos_token_ids),
            )
            if self.tokenizer is not None
            else None
        )
        self.runner = ModelRunner(
            loaded.model,
            config,
            self.device,
            max_model_len=self.max_model_len,
            eos_token_ids=tuple(sorted(self.eos_token_ids)),
            tp=None if self.tp is None else self.tp.group,
        )
        self.block_manager = BlockManager(
            self.runner.kv_cache.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.stats = EngineStats()
        # Seeds of unseeded requests: from the OS, so a restart does not replay the same
        # "random" outputs, unless the engine itself is given a seed (reproducible runs).
        self._rng = random.Random(config.seed) if config.seed is not None else random.SystemRandom()
        self._tracked: dict[str, LiveRequest] = {}
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
    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a text prompt (with the tokenizer's special tokens) or a checked id list."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids")
            return list(self.tokenizer(prompt).input_ids)
        ids = list(prompt)
        if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise ValueError("a token-id prompt must be a list of integers")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request can never run (empty, too long, larger than the pool)."""
        n = len(prompt_token_ids)
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(
                f"n ({params.n}) is more than this engine runs at once (max_num_seqs "
                f"{self.config.max_num_seqs}): a request's samples run together",
                "n",
            )
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens; this model's context is {self.max_model_len} tokens"
            )
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds the context "
                f"length of {self.max_model_len} tokens"
            )
        bad = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"logit_bias token {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        if params.structured_output is not None:
            self.compile_grammar(params.structured_output)
        need = self.block_manager.blocks_for(n + params.max_tokens)
        if need > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) needs {need} KV blocks;"
                f" the cache has {self.block_manager.num_blocks}"
            )

    def compile_grammar(self, constraint: StructuredOutput) -> object:
        """The compiled grammar of a structured-output constraint (cached; thread-safe, so a
        server compiles in a worker thread first). Raises InvalidRequestError."""
        if self.grammars is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer")
        return self.grammars.compile(constraint)

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> str:
        """Queue a request and return its id. Raises ValueError for a request that cannot run.

        With ``params.n > 1`` the prompt is prefilled once and forked into ``n`` samples sharing its
        blocks (copy-on-write); their ids are ``sample_ids(request_id, params.n)``, and sample ``i``
        draws with seed ``params.seed + i`` when a seed is given, so it equals a single request
        with that seed.
        """
        ids = self.tokenize(prompt)
        self.validate(ids, params)
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if any(rid in self._tracked for rid in sample_ids(request_id, params.n)):
            raise ValueError(f"request id {request_id!r} is already in use")
        samples = make_samples(request_id, ids, params, lambda: self._rng.getrandbits(63))
        if params.structured_output is not None:
            compiled = self.compile_grammar(params.structured_output)
            deferred = params.structured_output_after is not None
            for sample in samples:
                if deferred:
                    sample.deferred_matcher = self.grammars.matcher(compiled)
                else:
                    sample.matcher = self.grammars.matcher(compiled)
        for sample in samples:
            self._tracked[sample.request_id] = LiveRequest.start(sample, self.tokenizer)
        self.scheduler.add(samples[0])
        self.stats.prompt_tokens_total += len(ids)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request now (its blocks are freed at once); None if it is not live."""
        live = self._tracked.get(request_id)
        if live is None:
            return None
        return self._finish(live, "abort", now=time.monotonic())

    @property
    def has_unfinished(self) -> bool:
        return bool(self._tracked)

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
        bm = self.block_manager
        tables = [bm.block_table(s.request.request_id) for s in batch.requests]
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
            return self._fail_step(batch, "the server ran out of memory running this request")
        except RuntimeError as exc:
            if self.tp is None:
                raise
            # A rank died or raised: the group cannot go on. Name the rank and its cause.
            raise self.tp.failure(exc) from exc
        self.num_steps += 1
        for sched in batch.requests:
            req = sched.request
            req.num_computed_tokens = sched.end
            bm.commit(req.request_id, req.all_token_ids, req.num_computed_tokens)
            if req.request_id in result.prompt_logprobs:
                req.prompt_logprobs += result.prompt_logprobs[req.request_id]
        join_forks(batch, bm, self.scheduler)
        return self._process(result)

    def _fail_step(self, batch: ScheduledBatch, message: str) -> list[RequestOutput]:
        """Finish every request of a step that could not run (and the forks waiting on them)
        with ``finish_reason="error"``; their blocks return to the pool."""
        now = time.monotonic()
        doomed = with_pending_forks(s.request for s in batch.requests)
        return [
            self._finish(self._tracked[r.request_id], "error", now=now, error=message)
            for r in doomed
            if r.request_id in self._tracked
        ]

    def _process(self, result: StepResult) -> list[RequestOutput]:
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        for i, request_id in enumerate(result.request_ids):
            live = self._tracked[request_id]
            try:
                outputs.append(self._process_token(live, result, i, now))
            except Exception as exc:  # one request's fault must not stop the others
                logger.exception("request %s failed while processing its output", request_id)
                live.forget_text()  # never touch a detokenizer that raised again
                error = f"internal error: {type(exc).__name__}"
                outputs.append(self._finish(live, "error", now=now, error=error))
        return outputs

    def _process_token(
        self, live: LiveRequest, result: StepResult, i: int, now: float
    ) -> RequestOutput:
        """Append the sampled token, detokenize, and decide whether the request is done."""
        req = live.request
        token = result.token_ids[i]
        if req.params.max_tokens == 0:  # scoring only: the prompt is done, nothing to generate
            return self._finish(live, "length", now=now)
        failure = result.failed.get(req.request_id)
        if failure is not None:  # its grammar mask outran the budget (engine/sample/token_mask.py)
            logger.warning("request %s: %s", req.request_id, failure)
            return self._finish(live, "error", now=now, error=failure)
        if token == INVALID_TOKEN:
            # The sampler found no usable logit in the row (NaN, +inf, or nothing finite):
            # fail the request rather than emit an arbitrary token.
            logger.error("request %s: non-finite logits, failing it", req.request_id)
            error = "the model produced non-finite logits"
            return self._finish(live, "error", now=now, error=error)
        if req.matcher is not None and not req.matcher.accept_token(token):
            # The mask allowed only tokens the grammar accepts: this is a matcher fault.
            logger.error("request %s: the grammar refused sampled token %d", req.request_id, token)
            error = "the output grammar refused the sampled token"
            return self._finish(live, "error", now=now, error=error)
        if req.deferred_matcher is not None and token == req.params.structured_output_after:
            req.matcher, req.deferred_matcher = req.deferred_matcher, None  # from the next token
        req.output_token_ids.append(token)
        self.stats.generation_tokens_total += 1
        if req.first_token_time is None:
            req.first_token_time = now
        logprob = None
        if req.params.logprobs is not None:
            top = result.top_logprobs[i][: req.params.logprobs]
            logprob = [TokenLogprob(token, result.logprobs[i], top)]
        reason, stop_reason = live.stop_reason(
            token, eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len
        )
        if reason is None:
            return live.output([token], logprob)
        return self._finish(
            live, reason, now=now, tokens=[token], logprobs=logprob, stop_reason=stop_reason
        )

    def _finish(
        self,
        live: LiveRequest,
        reason: str,
        *,
        now: float,
        tokens: Sequence[int] = (),
        logprobs: list[TokenLogprob] | None = None,
        stop_reason: str | int | None = None,
        error: str | None = None,
    ) -> RequestOutput:
        """End the request for ``reason`` (its blocks are freed now); ``tokens`` and
        ``logprobs`` are this step's last ones; ``now`` is ``time.monotonic()`` seconds."""
        req = live.request
        detach(req, self.scheduler)
        self.scheduler.finish(req, reason)
        self._tracked.pop(req.request_id, None)
        metrics = request_metrics(req, now)
        self.stats.observe_finished(metrics, reason, first_token=req.first_token_time is not None)
        return live.output(
            list(tokens),
            logprobs,
            finish_reason=reason,
            stop_reason=stop_reason,
            metrics=metrics,
            error=error,
        )
