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
from dataclasses import dataclass

import torch

from engine.attention_backend import make_backend, resolve_backend_name
from engine.attention_swap import install_paged_attention
from engine.block_manager import BlockManager
from engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from engine.decode_graphs import CudaGraphCapture, DecodeGraphs
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError
from engine.kv_cache import KVCache
from engine.metrics import EngineStats
from engine.model_loader import LoadedModel, load_model, resolve_dtype
from engine.model_runner import ModelRunner, StepResult
from engine.outputs import RequestMetrics, RequestOutput, TokenLogprob
from engine.request import Request
from engine.sampler import INVALID_TOKEN, Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer


def sample_ids(request_id: str, n: int) -> list[str]:
    """The ids of the ``n`` samples of a request: its own id, then ``id.1`` ... ``id.(n-1)``."""
    return [request_id] + [f"{request_id}.{i}" for i in range(1, n)]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class LLMEngine:
    """Owns the model runner, the scheduler and every live request."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.config = config
        self.device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, self.device)
        if loaded is None:
            loaded = load_model(config.model, dtype=dtype, device=self.device)
        self.loaded = loaded
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        model = loaded.model
        install_paged_attention(model)
        hf = model.config
        self.vocab_size = int(hf.vocab_size)
        self.max_model_len = min(config.max_model_len or loaded.max_model_len, loaded.max_model_len)

        num_kv_heads = hf.num_key_value_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        kv_dtype = next(model.parameters()).dtype
        per_block = KVCache.bytes_per_block(
            num_layers=hf.num_hidden_layers,
            block_size=config.block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=kv_dtype,
        )
        num_blocks = self._kv_budget_bytes() // per_block
        if num_blocks < 1:
            raise ValueError(f"KV cache budget holds no block ({per_block} bytes per block)")
        self.kv_cache = KVCache(
            num_layers=hf.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=config.block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=kv_dtype,
            device=self.device,
        )
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s)",
            num_blocks,
            config.block_size,
            num_blocks * config.block_size,
            self.kv_cache.num_bytes / 2**20,
            kv_dtype,
        )
        self.backend_name = resolve_backend_name(config.attention_backend, self.device)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.runner = ModelRunner(
            model,
            self.kv_cache,
            make_backend(self.backend_name),
            Sampler(self.backend_name),
            self.device,
        )
        self._capture_decode_graphs(model)
        self.stats = EngineStats()
        # Seeds of unseeded requests: from the OS, so a restart does not replay the same
        # "random" outputs, unless the engine itself is given a seed (reproducible runs).
        self._rng = random.Random(config.seed) if config.seed is not None else random.SystemRandom()
        self._tracked: dict[str, _Tracked] = {}
        self._next_id = 0
        self.num_steps = 0  # steps that ran a batch through the model

    def _capture_decode_graphs(self, model: torch.nn.Module) -> None:
        """On CUDA with the triton backend, capture decode graphs unless ``enforce_eager``.

        A capture that fails is logged and the engine runs eagerly: slower, never wrong.
        """
        if self.config.enforce_eager or self.device.type != "cuda":
            return
        if self.backend_name != "triton":
            logger.info("decode graphs need the triton backend: running eagerly")
            return
        graphs = DecodeGraphs(
            model,
            self.kv_cache,
            self.runner.backend,
            max_batch_size=self.config.max_num_seqs,
            max_model_len=self.max_model_len,
        )
        start = time.monotonic()
        try:
            self.runner.enable_decode_graphs(graphs, CudaGraphCapture(self.device))
        except Exception:
            logger.exception("decode graph capture failed: running eagerly (--enforce-eager)")
            return
        logger.info(
            "captured %d decode graphs (batch sizes up to %d) in %.1f s",
            len(graphs.sizes),
            graphs.max_batch_size,
            time.monotonic() - start,
        )

    def _kv_budget_bytes(self) -> int:
        """``kv_cache_memory`` when given; else 1 GiB on CPU, or on CUDA the memory left free
        under ``gpu_memory_utilization`` of the device."""
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Memory torch's caching allocator holds but no tensor uses (a previous engine's
            # cache, say) is free for us too, though the driver counts it as used.
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(
                self.device
            )
            return int(free - total * (1.0 - self.config.gpu_memory_utilization))
        return DEFAULT_CPU_KV_CACHE_BYTES

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
        need = self.block_manager.blocks_for(n + params.max_tokens)
        if need > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) needs {need} KV blocks;"
                f" the cache has {self.block_manager.num_blocks}"
            )

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
        all_ids = sample_ids(request_id, params.n)
        if any(rid in self._tracked for rid in all_ids):
            raise ValueError(f"request id {request_id!r} is already in use")
        samples = []
        for index, rid in enumerate(all_ids):
            seed = params.seed + index if params.seed is not None else self._rng.getrandbits(63)
            request = Request(rid, ids, params, seed=seed, index=index)
            detok = IncrementalDetokenizer(
                self.tokenizer,
                ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
            )
            self._tracked[rid] = _Tracked(request, detok)
            samples.append(request)
        parent = samples[0]
        parent.pending_forks = samples[1:]
        for child in parent.pending_forks:
            child.fork_parent = parent
        self.scheduler.add(parent)
        self.stats.prompt_tokens_total += len(ids)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request now (its blocks are freed at once); None if it is not live."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return None
        return self._finish(tracked, "abort", now=time.monotonic())

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
        try:
            result = self.runner.execute(batch, tables)
        except (torch.OutOfMemoryError, MemoryError) as exc:
            # The step's size is bounded by the configuration, but a device can still run short
            # (another process, fragmentation): fail this step's requests, keep the engine.
            logger.error("step of %d requests ran out of memory: %s", len(batch.requests), exc)
            return self._fail_step(batch, "the server ran out of memory running this request")
        self.num_steps += 1
        for sched in batch.requests:
            req = sched.request
            req.num_computed_tokens = sched.end
            bm.commit(req.request_id, req.all_token_ids, req.num_computed_tokens)
        self._fork_pending(batch)
        return self._process(result)

    def _fail_step(self, batch: ScheduledBatch, message: str) -> list[RequestOutput]:
        """Finish every request of a step that could not run (and the forks waiting on them)
        with ``finish_reason="error"``; their blocks return to the pool."""
        now = time.monotonic()
        doomed = [s.request for s in batch.requests]
        doomed += [fork for r in doomed for fork in r.pending_forks]
        return [
            self._finish(self._tracked[r.request_id], "error", now=now, error=message)
            for r in doomed
            if r.request_id in self._tracked
        ]

    def _fork_pending(self, batch: ScheduledBatch) -> None:
        """Samples 1..n-1 of a request join it once its prompt is computed, sharing its blocks."""
        for sched in batch.requests:
            parent = sched.request
            if not (sched.samples and parent.pending_forks):
                continue
            for child in parent.pending_forks:
                self.block_manager.fork(parent.request_id, child.request_id)
                child.num_computed_tokens = parent.num_computed_tokens
                child.num_cached_tokens = parent.num_cached_tokens
                self.scheduler.add_running(child)
            parent.pending_forks = []

    def _process(self, result: StepResult) -> list[RequestOutput]:
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        for i, request_id in enumerate(result.request_ids):
            tracked = self._tracked[request_id]
            try:
                outputs.append(self._process_token(tracked, result, i, now))
            except Exception as exc:  # one request's fault must not stop the others
                logger.exception("request %s failed while processing its output", request_id)
                outputs.append(self._fail(tracked, exc, now))
        return outputs

    def _process_token(
        self, tracked: _Tracked, result: StepResult, i: int, now: float
    ) -> RequestOutput:
        """Append the sampled token, detokenize, and decide whether the request is done."""
        req = tracked.request
        token = result.token_ids[i]
        if token == INVALID_TOKEN:
            # The sampler found no usable logit in the row (NaN, +inf, or nothing finite):
            # fail the request rather than emit an arbitrary token.
            logger.error("request %s: non-finite logits, failing it", req.request_id)
            return self._finish(
                tracked, "error", now=now, error="the model produced non-finite logits"
            )
        req.output_token_ids.append(token)
        self.stats.generation_tokens_total += 1
        if req.first_token_time is None:
            req.first_token_time = now
        logprob = None
        if req.params.logprobs is not None:
            top = result.top_logprobs[i][: req.params.logprobs]
            logprob = [TokenLogprob(token, result.logprobs[i], top)]
        reason, stop_reason = self._stop_reason(tracked, token)
        if reason is None:
            return self._delta(tracked, [token], logprob)
        return self._finish(
            tracked, reason, now=now, tokens=[token], logprobs=logprob, stop_reason=stop_reason
        )

    def _detach_forks(self, req: Request) -> None:
        """A sample that ends before its fork: leave its parent, or hand its own forks on."""
        if req.fork_parent is not None and req in req.fork_parent.pending_forks:
            req.fork_parent.pending_forks.remove(req)
        if req.pending_forks:  # aborted before its prompt was computed: an heir takes over
            heir, *rest = req.pending_forks
            heir.pending_forks, heir.fork_parent = rest, None
            for child in rest:
                child.fork_parent = heir
            req.pending_forks = []
            self.scheduler.waiting.appendleft(heir)

    def _fail(self, tracked: _Tracked, exc: Exception, now: float) -> RequestOutput:
        """Finish a request whose processing raised: ``finish_reason="error"``, blocks freed."""
        tracked.detokenizer = IncrementalDetokenizer(None, [])  # never touch the broken one
        return self._finish(
            tracked, "error", now=now, error=f"internal error: {type(exc).__name__}"
        )

    def _stop_reason(self, tracked: _Tracked, token: int) -> tuple[str | None, str | int | None]:
        req = tracked.request
        params = req.params
        if token in params.stop_token_ids:
            return "stop", token
        if token in self.eos_token_ids and not params.ignore_eos:
            return "stop", None
        if tracked.detokenizer.add_token(token):
            return "stop", tracked.detokenizer.stopped_on
        if len(req.output_token_ids) >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def _delta(
        self,
        tracked: _Tracked,
        tokens: list[int],
        logprobs: list[TokenLogprob] | None,
        **final: object,
    ) -> RequestOutput:
        """This step's output; ``final`` (finish_reason, metrics, ...) marks the last one."""
        req = tracked.request
        return RequestOutput(
            request_id=req.request_id,
            index=req.index,
            new_token_ids=tokens,
            new_text=tracked.detokenizer.take_delta(finished=bool(final)),
            new_logprobs=logprobs,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids),
            num_cached_tokens=req.num_cached_tokens,
            finished=bool(final),
            **final,
        )

    def _finish(
        self,
        tracked: _Tracked,
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
        req = tracked.request
        self._detach_forks(req)
        self.scheduler.finish(req, reason)
        self._tracked.pop(req.request_id, None)
        req.finish_time = now
        tracked.detokenizer.flush()
        n_out = len(req.output_token_ids)
        ttft = (req.first_token_time or now) - req.arrival_time
        tpot = (
            (now - req.first_token_time) / (n_out - 1)
            if n_out > 1 and req.first_token_time
            else 0.0
        )
        metrics = RequestMetrics(
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=n_out,
            num_cached_tokens=req.num_cached_tokens,
            ttft=ttft,
            tpot=tpot,
            e2e_latency=now - req.arrival_time,
            num_preemptions=req.num_preemptions,
        )
        with self.stats.lock:
            self.stats.requests_finished_total += 1
            if req.first_token_time is not None:
                self.stats.ttft.observe(ttft)
            if n_out > 1:
                self.stats.tpot.observe(tpot)
        return self._delta(
            tracked,
            list(tokens),
            logprobs,
            finish_reason=reason,
            stop_reason=stop_reason,
            metrics=metrics,
            error=error,
        )
