"""Offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``; on a pooling model
(``--runner pooling``) ``embed(prompts)`` and ``classify(prompts)``, vLLM's offline names."""

from __future__ import annotations

from collections.abc import Sequence

from paged_serve.engine.config import EngineConfig
from paged_serve.engine.llm_engine import LLMEngine
from paged_serve.engine.model.loader import LoadedModel
from paged_serve.engine.multimodal_inputs import MultimodalPrompt
from paged_serve.engine.outputs import CompletionResult
from paged_serve.engine.pooling_params import POOLING_SAMPLING, PoolingParams
from paged_serve.engine.sampling_params import SamplingParams
from paged_serve.engine.sched.forks import sample_ids

Prompt = str | Sequence[int] | MultimodalPrompt  # engine.multimodal_prompt(text, images)


class LLM:
    """Runs batches of prompts to completion on the paged engine.

    ``LLM(model=None)`` loads the embedded default model; keyword arguments go to EngineConfig.
    With ``tensor_parallel_size > 1`` call ``shutdown()`` (or use ``with LLM(...) as llm``)
    to stop the worker processes before starting another tensor-parallel engine.
    """

    def __init__(self, model: str | None = None, *, loaded: LoadedModel | None = None, **config):
        self.engine = LLMEngine(EngineConfig(model=model, **config), loaded=loaded)

    @property
    def tokenizer(self) -> object | None:
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers (a no-op without tensor parallelism)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        lora: str | None = None,
    ) -> list[CompletionResult]:
        """Generate for every prompt (all batched together); results in prompt order.

        A prompt with ``n > 1`` contributes its ``n`` samples, consecutively. ``lora``: the
        served LoRA adapter every prompt runs with (``--lora-modules``), None for the base.
        """
        if isinstance(prompts, (str, MultimodalPrompt)) or (
            prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if params is None:
            params = SamplingParams()
        param_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(param_list)} SamplingParams")
        results: dict[str, CompletionResult] = {}
        order: list[str] = []
        try:
            for prompt, p in zip(prompts, param_list):
                ids = self.engine.tokenize(prompt)
                prompt = ids if isinstance(prompt, str) else prompt
                rid = self.engine.add_request(prompt, p, lora=lora)
                for sample_id in sample_ids(rid, p.n):
                    results[sample_id] = CompletionResult(sample_id, ids)
                    order.append(sample_id)
            while self.engine.has_unfinished:
                for out in self.engine.step():
                    results[out.request_id].add(out)
        except BaseException:
            for rid in order:
                self.engine.abort(rid)
            raise
        return [results[rid] for rid in order]

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[list[float]]:
        """The embedding of every prompt (all batched together), in prompt order."""
        return self.pool(prompts, params or PoolingParams("embed"))

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[list[float]]:
        """The label scores of every prompt (probabilities unless ``activation=False``)."""
        return self.pool(prompts, params or PoolingParams("classify"))

    def pool(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: PoolingParams | Sequence[PoolingParams],
    ) -> list[list[float]]:
        """Every prompt pooled with ``params`` (one for all, or one per prompt: a cross-
        encoder's pairs carry their own segment ids), all batched together, in prompt order; a
        request that fails raises RuntimeError naming why."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        param_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(param_list)} PoolingParams")
        order: list[str] = []
        results: dict[str, list[float]] = {}
        try:
            for prompt, p in zip(prompts, param_list):
                order.append(self.engine.add_request(prompt, POOLING_SAMPLING, pooling=p))
            while self.engine.has_unfinished:
                for out in self.engine.step():
                    if out.finish_reason != "stop":
                        raise RuntimeError(f"request {out.request_id}: {out.error}")
                    results[out.request_id] = out.pooled
        except BaseException:
            for rid in order:
                self.engine.abort(rid)
            raise
        return [results[rid] for rid in order]
