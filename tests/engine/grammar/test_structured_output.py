"""Structured outputs in the engine: every output satisfies its constraint by construction.

The harsh case is a tiny random-weight model with the default model's 49k-token vocabulary:
its logits are noise, so only the mask keeps an output valid. The default model checks that a
constraint which admits the model's own greedy continuation changes nothing.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest

from paged_serve.engine import EngineConfig, SamplingParams
from paged_serve.engine.errors import InvalidRequestError
from paged_serve.engine.grammar.structured_output import MAX_SPEC_CHARS, StructuredOutput
from paged_serve.engine.llm_engine import LLMEngine
from paged_serve.engine.model.loader import LoadedModel
from tests.conftest import assert_pool_clean, tiny_model, tokenizer_engine

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "address": {
                "type": "object",
                "properties": {
                    "zip": {"type": "integer", "minimum": 0, "maximum": 99},
                    "city": {"enum": ["Paris", "Lyon"]},
                },
                "required": ["zip", "city"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "bounded_array": {
        "type": "array",
        "items": {"type": "boolean"},
        "minItems": 1,
        "maxItems": 3,
    },
    "enum_and_numbers": {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "level": {"type": "integer", "minimum": -5, "maximum": 5},
            "ok": {"type": "boolean"},
        },
        "required": ["colour", "level", "ok"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 9},
            "b": {"type": ["string", "null"], "maxLength": 3},
        },
        "required": ["a"],
        "additionalProperties": False,
    },
}
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def random_engine(default_tokenizer) -> LLMEngine:
    """A random-weight Llama over the default tokenizer's vocabulary."""
    return tokenizer_engine(default_tokenizer, seed=3, max_num_seqs=16)


def run(engine: LLMEngine) -> dict[str, tuple[list[int], str, str]]:
    """Step until idle: (tokens, text, finish_reason) per request id."""
    acc: dict[str, tuple[list[int], str, str]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens, text, _ = acc.get(out.request_id, ([], "", ""))
            acc[out.request_id] = (
                tokens + out.new_token_ids,
                text + out.new_text,
                out.finish_reason or "",
            )
    return acc


def constrained(constraint: StructuredOutput, **fields) -> SamplingParams:
    fields.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(structured_output=constraint, **fields)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_model_outputs_validate_against_their_schema(random_engine, name):
    schema = SCHEMAS[name]
    constraint = StructuredOutput.json_schema(schema)
    for seed in range(3):
        random_engine.add_request("Give JSON:", constrained(constraint, seed=seed), f"s{seed}")
    random_engine.add_request("Give JSON:", constrained(constraint, temperature=0.0), "greedy")
    for rid, (_, text, reason) in run(random_engine).items():
        assert reason == "stop", (rid, text)
        jsonschema.validate(json.loads(text), schema)
    assert_pool_clean(random_engine.block_manager)


def test_json_object_regex_and_choice_hold_exactly(random_engine):
    cases = {
        "object": (StructuredOutput("json_object"), lambda t: isinstance(json.loads(t), dict)),
        "regex": (
            StructuredOutput("regex", r"[A-Z]{2}-\d{3}"),
            lambda t: re.fullmatch(r"[A-Z]{2}-\d{3}", t),
        ),
        "choice": (
            StructuredOutput("choice", choices=("yes", "no", "maybe so")),
            lambda t: t in ("yes", "no", "maybe so"),
        ),
        "grammar": (
            StructuredOutput("grammar", 'root ::= "(" digit+ ")"\ndigit ::= [0-9]'),
            lambda t: re.fullmatch(r"\(\d+\)", t),
        ),
    }
    for kind, (constraint, _) in cases.items():
        for seed in range(2):
            random_engine.add_request("x", constrained(constraint, seed=seed), f"{kind}{seed}")
    results = run(random_engine)
    for rid, (_, text, reason) in results.items():
        check = cases[rid[:-1]][1]
        if reason == "length":  # a random model may never close the object: it stays a prefix
            assert rid.startswith("object"), (rid, text)
            continue
        assert reason == "stop" and check(text), (rid, text)
    assert_pool_clean(random_engine.block_manager)


def test_mixed_batch_each_row_obeys_its_own_constraint(random_engine):
    choice = StructuredOutput("choice", choices=("alpha", "beta"))
    digits = StructuredOutput("regex", r"[0-9]{4}")
    free = SamplingParams(max_tokens=12, seed=11, ignore_eos=True)
    random_engine.add_request("prompt one", free, "free-alone")
    alone = run(random_engine)["free-alone"][0]
    random_engine.add_request("prompt one", free, "free")
    random_engine.add_request("prompt two", constrained(choice, seed=1, n=3), "choice")
    random_engine.add_request("prompt three", constrained(digits, temperature=0.0), "digits")
    results = run(random_engine)
    assert results["free"][0] == alone  # seeded draws stay batch-invariant beside masked rows
    for rid in ("choice", "choice.1", "choice.2"):
        assert results[rid][1] in ("alpha", "beta")
    assert re.fullmatch(r"[0-9]{4}", results["digits"][1])
    assert_pool_clean(random_engine.block_manager)


def test_constraints_survive_preemption_prefix_hits_and_aborts(default_tokenizer):
    model = tiny_model("qwen3", seed=5, vocab_size=len(default_tokenizer))
    loaded = LoadedModel(model, default_tokenizer, "tiny", (2,), 1024, 0.0)
    # 6 blocks of 16 tokens (2 layers x K,V x 16 x 2 heads x 64 x fp32 each): four requests of
    # ~40 tokens sharing a one-block prefix cannot all stay resident.
    engine = LLMEngine(EngineConfig(kv_cache_memory=6 * 2 * 2 * 16 * 2 * 64 * 4), loaded=loaded)
    schema = SCHEMAS["enum_and_numbers"]
    constraint = StructuredOutput.json_schema(schema)
    prompt = "The same long shared prompt for every request here, " * 2
    for i in range(4):
        engine.add_request(prompt, constrained(constraint, seed=i, max_tokens=48), f"r{i}")
    engine.add_request(prompt, constrained(constraint, seed=9, max_tokens=48), "queued")
    engine.abort("queued")  # never admitted: its matcher goes with it
    texts: dict[str, str] = {}
    reasons: dict[str, str] = {}
    while engine.has_unfinished:
        outs = engine.step()
        if len(texts.get("r1", "")) > 3 and not reasons.get("r1"):
            outs.append(engine.abort("r1"))  # mid-decode
        for out in outs:
            texts[out.request_id] = texts.get(out.request_id, "") + out.new_text
            reasons[out.request_id] = out.finish_reason or ""
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.prefix_hit_tokens > 0
    assert reasons.pop("r1") == "abort"
    for rid, reason in reasons.items():
        text = texts[rid]
        assert reason == "stop", (rid, text)
        jsonschema.validate(json.loads(text), schema)
    assert_pool_clean(engine.block_manager)


def test_a_grammar_that_admits_the_greedy_continuation_changes_nothing(default_model):
    engine = LLMEngine(EngineConfig(kv_cache_memory=16 << 20), loaded=default_model)
    prompt = "The capital of France is"
    free = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt, free, "free")
    tokens, text, _ = run(engine)["free"]
    same = SamplingParams(
        max_tokens=8,
        temperature=0.0,
        structured_output=StructuredOutput("choice", choices=(text, text + "!")),
    )
    engine.add_request(prompt, same, "constrained")
    assert run(engine)["constrained"][0] == tokens
    assert_pool_clean(engine.block_manager)


def test_a_matcher_fault_fails_that_request_alone(random_engine):
    constraint = StructuredOutput("choice", choices=("one", "two"))
    random_engine.add_request("x", constrained(constraint, seed=1), "faulty")
    random_engine.add_request("x", constrained(constraint, seed=2), "fine")
    matcher = random_engine.scheduler.waiting[0].matcher

    class Refusing:
        def fill_next_token_bitmask(self, mask, index):
            matcher.fill_next_token_bitmask(mask, index)

        def accept_token(self, token: int) -> bool:
            return False

    random_engine.scheduler.waiting[0].matcher = Refusing()
    results = run(random_engine)
    assert results["faulty"][2] == "error"
    assert results["fine"][1] in ("one", "two")
    assert_pool_clean(random_engine.block_manager)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: StructuredOutput.json_schema({"type": "objec"}), "invalid"),
        (lambda: StructuredOutput.json_schema('{"type": '), "not valid JSON"),
        (lambda: StructuredOutput("regex", "(unclosed"), "invalid"),
        (lambda: StructuredOutput("grammar", "root ::= missing_rule"), "invalid"),
        (lambda: StructuredOutput("grammar", r"root ::= [^\x00-\U0010FFFF]"), "admits no output"),
    ],
)
def test_bad_constraints_are_refused_before_queueing(random_engine, make, message):
    with pytest.raises(ValueError, match=message):
        random_engine.add_request("x", constrained(make()))
    assert not random_engine.has_unfinished


@pytest.mark.parametrize(
    "schema, keyword",
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
        ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf"),
        ({"$defs": {"x": {"type": "number", "multipleOf": 3}}, "$ref": "#/$defs/x"}, "multipleOf"),
        ({"if": {"type": "integer"}, "then": {"minimum": 3}}, "if"),
    ],
)
def test_unsupported_schema_keywords_are_named(schema, keyword):
    with pytest.raises(ValueError, match=f"unsupported JSON schema keyword '{keyword}'"):
        StructuredOutput.json_schema(schema)


def test_absurd_sizes_are_bounded():
    with pytest.raises(ValueError, match="characters; at most"):
        StructuredOutput("regex", "a" * (MAX_SPEC_CHARS + 1))
    deep: dict = {"type": "integer"}
    for _ in range(100):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="nests deeper"):
        StructuredOutput.json_schema(deep)


def test_a_model_without_tokenizer_refuses_structured_outputs():
    from tests.conftest import loaded

    engine = LLMEngine(EngineConfig(kv_cache_memory=2 << 20), loaded=loaded(tiny_model("llama")))
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        engine.add_request([1, 2, 3], constrained(StructuredOutput("json_object")))


def test_a_constraint_can_start_after_a_token(random_engine, default_tokenizer):
    """structured_output_after (a reasoning model's </think>): free up to that token, then
    constrained. A logit bias makes the free part emit the token at once."""
    bang = default_tokenizer.convert_tokens_to_ids("!")
    regex = StructuredOutput("regex", r"\d{3}")
    after = SamplingParams(
        structured_output=regex,
        structured_output_after=bang,
        logit_bias=((bang, 100.0),),
        temperature=0.0,
        max_tokens=12,
    )
    random_engine.add_request("Count:", after, "after")
    random_engine.add_request(
        "Count:", dataclasses.replace(after, structured_output_after=None), "from0"
    )
    results = run(random_engine)
    tokens, text, reason = results["after"]
    assert tokens[0] == bang and reason == "stop"
    assert re.fullmatch(r"!\d{3}", text), text
    assert re.fullmatch(r"\d{3}", results["from0"][1])
    assert_pool_clean(random_engine.block_manager)
    with pytest.raises(ValueError, match="structured_output_after"):
        SamplingParams(structured_output_after=bang)
