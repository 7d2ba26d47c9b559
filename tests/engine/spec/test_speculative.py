"""Speculative decoding changes the speed, never the tokens: every scenario runs with and
without speculation and compares token for token, then checks the pools.

Random tiny models rarely repeat themselves, so most scenarios draft with a scripted drafter
that knows the output without speculation and gets a varying part of it wrong (runs of 0..k
accepted tokens); prompt lookup itself runs on the default model, whose copies it drafts.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from paged_serve.engine import EngineConfig, SamplingParams
from paged_serve.engine.grammar.structured_output import StructuredOutput
from paged_serve.engine.llm_engine import LLMEngine
from paged_serve.engine.sched.request import Request
from paged_serve.engine.spec.config import SpeculativeConfig
from tests.conftest import (
    assert_pool_clean,
    loaded,
    random_prompts,
    tiny_model,
    tokenizer_engine,
)

K = 4


class ScriptedDrafter:
    """Drafts ``answers[rid]`` (each request's output without speculation) from the request's
    position, wrong at every output position ``p`` with ``p % 7 == 3``, so the accepted runs
    vary from 0 to k; ``wrong="all"`` gets every token wrong, ``None`` none."""

    def __init__(self, answers: dict[str, list[int]], vocab: int, wrong: str | None = "one"):
        self.answers, self.vocab, self.wrong = answers, vocab, wrong
        self.released: list[str] = []

    def propose(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        drafts = []
        for request, k in zip(requests, limits):
            n = len(request.output_token_ids)
            draft = list(self.answers.get(request.request_id, [])[n : n + k])
            for i in range(len(draft)):
                if self.wrong == "all" or self.wrong == "one" and (n + i) % 7 == 3:
                    draft[i] = (draft[i] + 1) % self.vocab
            drafts.append(draft)
        return drafts

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


def spec_config(**fields) -> SpeculativeConfig:
    fields.setdefault("num_speculative_tokens", K)
    fields.setdefault("disable_by_batch_size", 64)
    return SpeculativeConfig(**fields)


def engine_for(model, spec: SpeculativeConfig | None, **config) -> LLMEngine:
    settings = {"kv_cache_memory": 8 << 20, "max_num_seqs": 8, **config}
    return LLMEngine(EngineConfig(speculative_config=spec, **settings), loaded=loaded(model))


def run(engine: LLMEngine, prompts, params: SamplingParams | list[SamplingParams]):
    """Every prompt to the end: {request id: tokens}, {request id: finish reason}; the pool is
    clean after."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params_list)):
        engine.add_request(prompt, p, request_id=f"r{i}")
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert_pool_clean(engine.block_manager)
    return tokens, reasons


def scripted(model, answers, wrong="one", **config) -> LLMEngine:
    engine = engine_for(model, spec_config(), **config)
    engine.speculator.drafter = ScriptedDrafter(answers, int(model.config.vocab_size), wrong)
    return engine


def greedy(max_tokens: int = 24, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **fields)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


PROMPTS = random_prompts([5, 17, 33, 9], seed=4)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "gpt_oss", "deepseek_v3"])
def test_partly_right_drafts_change_no_token(family):
    """Batched prompts of different lengths, greedy: accepted runs of every length, the
    rejected positions trimmed, the same tokens (softmax, sliding-window and sink attention,
    MoE, latent attention)."""
    from tests.engine.model.test_model_coverage import tiny_architecture

    model = tiny_model(family) if family in ("llama", "qwen3") else tiny_architecture(family)
    expected, _ = run(engine_for(model, None), PROMPTS, greedy())
    engine = scripted(model, expected)
    got, _ = run(engine, PROMPTS, greedy())
    assert got == expected
    stats = engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens


def test_always_right_drafts_give_k_plus_one_tokens_per_step(llama):
    expected, _ = run(engine_for(llama, None), PROMPTS[:1], greedy(max_tokens=41))
    engine = scripted(llama, expected, wrong=None)
    got, _ = run(engine, PROMPTS[:1], greedy(max_tokens=41))
    assert got == expected
    assert engine.num_steps == 1 + 40 // (K + 1)  # the prefill, then k + 1 tokens a step
    assert engine.speculator.stats.acceptance_rate == 1.0


def test_always_wrong_drafts_change_nothing_and_pause(llama):
    expected, _ = run(engine_for(llama, None), PROMPTS, greedy(max_tokens=40))
    engine = scripted(llama, expected, wrong="all")
    got, _ = run(engine, PROMPTS, greedy(max_tokens=40))
    assert got == expected
    stats = engine.speculator.stats
    assert stats.num_accepted_tokens == 0
    # Pausing: far fewer drafting steps than decoding steps (39 per request).
    assert 0 < stats.num_drafts < 4 * 39 / 2


@pytest.mark.parametrize(
    "fields",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_p=0.8, top_k=40),
        dict(temperature=1.3, min_p=0.05, repetition_penalty=1.2, frequency_penalty=0.3),
        dict(temperature=1.0, logit_bias={7: 3.0}, presence_penalty=0.5, logprobs=3),
    ],
)
def test_seeded_samples_equal_the_unspeculated_ones(llama, fields):
    """Each token is the target's draw at its (seed, position): the same with drafts."""
    params = [
        SamplingParams(max_tokens=20, seed=seed, ignore_eos=True, **fields) for seed in range(8)
    ]
    prompts = [PROMPTS[seed % 4] for seed in range(8)]
    plain = engine_for(llama, None)
    expected, _ = run(plain, prompts, params)
    engine = scripted(llama, expected)
    got, _ = run(engine, prompts, params)
    assert got == expected
    assert engine.speculator.stats.num_accepted_tokens > 0


def test_logprobs_are_the_targets(llama):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)

    def outputs(engine):
        engine.add_request(PROMPTS[1], params, request_id="r0")
        result = []
        while engine.has_unfinished:
            for out in engine.step():
                result += out.new_logprobs
        return result

    expected = outputs(engine_for(llama, None))
    answers = {"r0": [lp.token_id for lp in expected]}
    got = outputs(scripted(llama, answers))
    assert [lp.token_id for lp in got] == answers["r0"]
    for a, b in zip(got, expected):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def _chi_square_p(observed: list[int], expected: list[float]) -> float:
    """Pearson's chi-square test's p-value (Wilson-Hilferty's normal approximation)."""
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    dof = len(observed) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@torch.inference_mode()
def test_sampled_pairs_follow_the_target_distribution(llama):
    """600 seeds, top-k 3 at temperature 1.5, three tokens each, the second one verified
    against a one-token draft: the frequencies of the first two against p(t1) p(t2 | t1)
    computed independently in float64 from Hugging Face's logits (chi-square over the 9
    cells), and token for token the run without speculation."""
    prompt = PROMPTS[2]
    fields = dict(max_tokens=3, temperature=1.5, top_k=3, ignore_eos=True)
    params = [SamplingParams(seed=seed, **fields) for seed in range(600)]
    prompts = [prompt] * len(params)
    plain, _ = run(engine_for(llama, None, max_num_seqs=64), prompts, params)
    # Draft the likeliest second token always: right about half the time.
    engine = engine_for(llama, spec_config(), max_num_seqs=64)

    def top_k_probs(tokens: list[int]) -> dict[int, float]:
        logits = llama(torch.tensor([tokens])).logits[0, -1].double() / 1.5
        values, ids = logits.topk(3)
        return dict(zip(ids.tolist(), torch.softmax(values, 0).tolist()))

    first = top_k_probs(prompt)
    second = {t1: top_k_probs(prompt + [t1]) for t1 in first}
    likeliest = {t1: max(p, key=p.get) for t1, p in second.items()}

    class Likeliest:
        def propose(self, requests, limits):
            return [[likeliest[r.output_token_ids[0]]] for r in requests]

        def release(self, request_id):
            pass

    engine.speculator.drafter = Likeliest()
    got, _ = run(engine, prompts, params)
    assert got == plain
    assert engine.speculator.stats.num_drafts == len(params)
    cells = [(t1, t2) for t1 in first for t2 in second[t1]]
    counts = Counter(tuple(tokens[:2]) for tokens in got.values())
    assert sum(counts[c] for c in cells) == len(params)  # nothing outside the kept set
    expected = [len(params) * first[t1] * second[t1][t2] for t1, t2 in cells]
    assert min(expected) >= 5
    assert _chi_square_p([counts[c] for c in cells], expected) > 1e-3


def test_chunked_prefill_and_the_token_budget(llama):
    """A budget of 8 tokens a step: drafts are cut to what is left after the decodes and
    share steps with prefill chunks."""
    long_prompts = random_prompts([40, 3, 25], seed=9)
    expected, _ = run(engine_for(llama, None, max_num_batched_tokens=8), long_prompts, greedy())
    engine = scripted(llama, expected, max_num_batched_tokens=8)
    got, _ = run(engine, long_prompts, greedy())
    assert got == expected
    assert engine.speculator.stats.num_accepted_tokens > 0


def test_preemption_mid_speculation(llama):
    """A pool too small for every request: drafts never preempt, requests that are preempted
    recompute and go on speculating."""
    hf = llama.config
    block_bytes = hf.num_hidden_layers * 2 * 16 * hf.num_key_value_heads * hf.head_dim * 4
    config = dict(kv_cache_memory=10 * block_bytes, max_num_batched_tokens=64)
    prompts = random_prompts([30, 28, 26, 20], seed=5)
    plain = engine_for(llama, None, **config)
    expected, _ = run(plain, prompts, greedy(max_tokens=30))
    assert plain.scheduler.num_preemptions > 0
    engine = scripted(llama, expected, **config)
    got, _ = run(engine, prompts, greedy(max_tokens=30))
    assert got == expected
    assert engine.scheduler.num_preemptions > 0
    assert engine.speculator.stats.num_accepted_tokens > 0


def test_n_samples_fork_then_speculate(llama):
    params = SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=11, ignore_eos=True)
    expected, _ = run(engine_for(llama, None), PROMPTS[:2], params)
    engine = scripted(llama, expected)
    got, _ = run(engine, PROMPTS[:2], params)
    assert got == expected and len(got) == 6
    assert engine.speculator.stats.num_accepted_tokens > 0


def test_prefix_cache_never_keeps_a_rejected_draft(llama):
    """Requests that share a prompt, one after the other: the later ones hit the earlier
    one's blocks, which include blocks its accepted drafts filled, and still get the tokens a
    fresh engine without speculation gives."""
    shared = random_prompts([40], seed=2)[0]
    prompts = [shared + [5], shared + [5], shared + [9]]
    expected = {}
    for i, prompt in enumerate(prompts):
        tokens, _ = run(engine_for(llama, None, enable_prefix_caching=False), [prompt], greedy(40))
        expected[f"r{i}"] = tokens["r0"]
    engine = engine_for(llama, spec_config())
    drafter = ScriptedDrafter({}, int(llama.config.vocab_size))
    engine.speculator.drafter = drafter
    for i, prompt in enumerate(prompts):
        drafter.answers = {f"r{i}": expected[f"r{i}"]}
        engine.add_request(prompt, greedy(40), request_id=f"r{i}")
        got = []
        while engine.has_unfinished:
            for out in engine.step():
                got += out.new_token_ids
        assert got == expected[f"r{i}"]
        assert_pool_clean(engine.block_manager)
    assert engine.scheduler.prefix_hit_tokens > 0
    # Prompt 2 (shared + [5]) + its output, again: every full block of it is a cache hit.
    again = prompts[1] + expected["r1"]
    assert len(engine.block_manager.cached_prefix(again)) == (len(again) - 1) // 16


def test_abort_mid_speculation_frees_everything(llama):
    expected, _ = run(engine_for(llama, None), PROMPTS, greedy(max_tokens=40))
    engine = scripted(llama, expected)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, greedy(max_tokens=40), request_id=f"r{i}")
    for _ in range(4):
        engine.step()
    for i in range(len(PROMPTS)):
        engine.abort(f"r{i}")
    assert_pool_clean(engine.block_manager)
    assert sorted(engine.speculator.drafter.released) == [f"r{i}" for i in range(4)]
    assert not engine.speculator._pace


def test_stops_inside_a_draft(llama):
    """A stop token, max_tokens and min_tokens falling inside an accepted draft end the request
    exactly where it ends without drafts."""
    expected, _ = run(engine_for(llama, None), PROMPTS, greedy(max_tokens=30))
    stop = expected["r1"][7]
    params = [
        greedy(max_tokens=30, stop_token_ids=[stop]),
        greedy(max_tokens=30, stop_token_ids=[stop], min_tokens=9),
        greedy(max_tokens=13),
        greedy(max_tokens=30),
    ]
    expected, reasons = run(engine_for(llama, None), PROMPTS, params)
    engine = scripted(llama, expected, wrong=None)
    got, got_reasons = run(engine, PROMPTS, params)
    assert got == expected and got_reasons == reasons
    assert len(got["r2"]) == 13


def test_only_small_batches_speculate(llama):
    """More running sequences than disable_by_batch_size: no step drafts."""
    expected, _ = run(engine_for(llama, None), PROMPTS, greedy())
    engine = engine_for(llama, spec_config(disable_by_batch_size=3))
    engine.speculator.drafter = ScriptedDrafter(expected, int(llama.config.vocab_size), None)
    got, _ = run(engine, PROMPTS, greedy())
    assert got == expected
    assert engine.speculator.stats.num_drafts == 0


def test_grammar_constrained_drafts(default_tokenizer):
    """A JSON-schema request on a random model over a real vocabulary: drafted rows' masks
    come from the matcher walked over the drafts (and rolled back), drafts the grammar refuses
    are cut; the same text as without drafts."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    constraint = StructuredOutput.json_schema(schema)
    params = [
        SamplingParams(max_tokens=96, structured_output=constraint, seed=s, temperature=0.8)
        for s in range(3)
    ] + [SamplingParams(max_tokens=96, structured_output=constraint, temperature=0.0)]
    prompts = ["Give JSON:"] * 4
    plain = tokenizer_engine(default_tokenizer, seed=3, speculative_config=None)
    expected, reasons = run(plain, prompts, params)
    assert set(reasons.values()) == {"stop"}
    engine = tokenizer_engine(default_tokenizer, seed=3, speculative_config=spec_config())
    engine.speculator.drafter = ScriptedDrafter(expected, len(default_tokenizer))
    got, got_reasons = run(engine, prompts, params)
    assert got == expected and got_reasons == reasons
    assert engine.speculator.stats.num_accepted_tokens > 0


# ----------------------------------------------------------------------------- prompt lookup
COPY_TEXT = (
    "The library opens at nine in the morning and closes at eight in the evening. Members may "
    "borrow ten books at a time, and a loan lasts three weeks."
)


def test_prompt_lookup_on_the_default_model(default_model, default_tokenizer):
    """The real drafter on a prompt the answer copies: fewer steps, the same fp32 tokens, as
    alone and batched beside a request that has nothing to copy."""
    messages = [{"role": "user", "content": f"Repeat this text exactly:\n\n{COPY_TEXT}"}]
    text = default_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    prompts = [text, "Write a haiku about rain."]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)

    def go(spec):
        engine = LLMEngine(
            EngineConfig(kv_cache_memory=16 << 20, speculative_config=spec), loaded=default_model
        )
        return run(engine, prompts, params)[0], engine

    expected, plain = go(None)
    got, engine = go(SpeculativeConfig())
    assert got == expected
    stats = engine.speculator.stats
    assert stats.acceptance_rate > 0.5
    assert engine.num_steps < plain.num_steps * 0.7


# ----------------------------------------------------------------------------- draft model
@pytest.fixture(scope="module")
def draft_folders(tmp_path_factory, llama):
    """The target itself (always right) and another random Llama with its vocabulary."""
    same = tmp_path_factory.mktemp("same")
    llama.save_pretrained(same)
    other = tmp_path_factory.mktemp("other")
    tiny_model("llama", seed=1).save_pretrained(other)
    wider = tmp_path_factory.mktemp("wider")
    tiny_model("llama", seed=1, vocab_size=640).save_pretrained(wider)
    return {"same": str(same), "other": str(other), "wider": str(wider)}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_model_changes_no_token(llama, draft_folders, temperature):
    """The target as its own draft accepts every token (greedy, and sampled: the draft draws
    with the request's seed and position as the target will); another model, few."""
    params = [
        SamplingParams(max_tokens=21, temperature=temperature, seed=s, ignore_eos=True)
        for s in range(len(PROMPTS))
    ]
    expected, _ = run(engine_for(llama, None), PROMPTS, params)
    for name in ("same", "other"):
        spec = spec_config(method="draft_model", model=draft_folders[name])
        engine = engine_for(llama, spec, dtype="float32")
        got, _ = run(engine, PROMPTS, params)
        assert got == expected, name
        drafter = engine.speculator.drafter
        drafter.block_manager.check_integrity()
        assert drafter.block_manager.usage().used_blocks == 0  # released with the requests
        stats = engine.speculator.stats
        if name == "same":
            assert stats.acceptance_rate == 1.0
            assert engine.num_steps == 1 + 20 // (K + 1)  # the prefill, then k + 1 a step
        else:
            assert stats.acceptance_rate < 0.5


def test_a_draft_model_with_another_vocabulary_is_refused(llama, draft_folders):
    spec = spec_config(method="draft_model", model=draft_folders["wider"])
    with pytest.raises(ValueError, match="vocabulary"):
        engine_for(llama, spec, dtype="float32")


# ----------------------------------------------------------------------------- where it is off
def test_hybrid_models_do_not_speculate():
    """A recurrent state cannot give back rejected drafts: refused when asked for, off by
    default."""
    from tests.engine.model.test_model_coverage import tiny_architecture

    model = tiny_architecture("qwen3_next")
    assert engine_for(model, "auto").speculator is None
    with pytest.raises(ValueError, match="roll back"):
        engine_for(model, spec_config())


def test_the_default_is_prompt_lookup_on_the_cpu(llama):
    engine = LLMEngine(EngineConfig(kv_cache_memory=8 << 20), loaded=loaded(llama))
    assert engine.speculator is not None
    assert engine.speculator.config == SpeculativeConfig()
    assert engine_for(llama, None).speculator is None
