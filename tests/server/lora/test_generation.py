"""Requests pick the base model or a LoRA adapter by ``model``: completions (token-id prompts,
streamed and not), chat and Responses run greedily equal to peft's merged model of the name they
give, and their replies carry that name; ``/v1/models`` lists the adapters after the base model;
an unknown name is the server's 404."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import assert_error, http
from tests.server.lora.conftest import BASE_NAME, LoRAModels, LoRAServers, greedy

PROMPT = [7, 30, 41, 52, 63]  # word ids of the tiny vocabulary
MAX_TOKENS = 8
IDS = {"ignore_eos": True, "return_token_ids": True}
WORD_W5 = 15  # "w5" in tests.pooling_models.WORDS


@pytest.mark.parametrize("model", [BASE_NAME, "a1", "a2"])
def test_completions_run_on_the_named_adapter(
    lora_client: openai.OpenAI, lora_models: LoRAModels, lora_servers: LoRAServers, model: str
) -> None:
    expected = greedy(lora_models.references[model], PROMPT, MAX_TOKENS)
    whole = lora_client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body=IDS
    )
    assert whole.model == model
    assert whole.choices[0].model_extra["token_ids"] == expected
    stream = lora_client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body=IDS,
    )
    streamed: list[int] = []
    for chunk in stream:
        assert chunk.model == model
        for choice in chunk.choices:
            streamed += choice.model_extra.get("token_ids") or []
    assert streamed == expected


def test_adapters_change_the_output(lora_models: LoRAModels) -> None:
    """The references differ, so the equalities above tell the adapters apart."""
    outputs = {name: greedy(m, PROMPT, MAX_TOKENS) for name, m in lora_models.references.items()}
    assert len({tuple(o) for name, o in outputs.items() if name != "a3"}) == 3


def test_one_batch_mixes_the_base_and_both_adapters(
    lora_client: openai.OpenAI, lora_models: LoRAModels, lora_servers: LoRAServers
) -> None:
    """Concurrent streams on three models share steps; each gets its own model's tokens."""
    names = (BASE_NAME, "a1", "a2")
    streams = {
        name: lora_client.completions.create(
            model=name,
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body=IDS,
        )
        for name in names
    }
    for name, stream in streams.items():
        ids = [i for chunk in stream for c in chunk.choices for i in c.model_extra["token_ids"]]
        assert ids == greedy(lora_models.references[name], PROMPT, MAX_TOKENS), name


def test_chat_and_responses_on_an_adapter(
    lora_client: openai.OpenAI, lora_models: LoRAModels, lora_servers: LoRAServers
) -> None:
    messages = [{"role": "user", "content": "w5 w6 w7"}]
    tokenizer = lora_models.tokenizer
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    expected = greedy(lora_models.references["a2"], prompt, MAX_TOKENS)
    chat = lora_client.chat.completions.create(
        model="a2", messages=messages, max_tokens=MAX_TOKENS, temperature=0, extra_body=IDS
    )
    assert chat.model == "a2"
    assert chat.choices[0].model_extra["token_ids"] == expected
    chunks = lora_client.chat.completions.create(
        model="a2",
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body=IDS,
    )
    streamed = []
    for chunk in chunks:
        assert chunk.model == "a2"
        for choice in chunk.choices:
            streamed += choice.model_extra.get("token_ids") or []
    assert streamed == expected
    response = lora_client.responses.create(
        model="a2", input="w5 w6 w7", max_output_tokens=MAX_TOKENS, temperature=0
    )
    assert response.model == "a2"
    if tokenizer.eos_token_id not in expected:  # Responses stop at EOS; chat ignored it
        assert response.output_text == chat.choices[0].message.content
        assert response.output_text.split() == tokenizer.convert_ids_to_tokens(expected)


def test_base_model_replies_carry_its_served_name(
    lora_client: openai.OpenAI, lora_servers: LoRAServers
) -> None:
    reply = lora_client.completions.create(
        model=BASE_NAME, prompt=PROMPT, max_tokens=2, temperature=0
    )
    assert reply.model == BASE_NAME
    without = http(
        "POST",
        f"{lora_servers.url}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 2},
    )
    assert without.status == 200 and without.json()["model"] == BASE_NAME


def test_unknown_model_is_404(lora_client: openai.OpenAI, lora_servers: LoRAServers) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        lora_client.completions.create(model="a9", prompt=PROMPT, max_tokens=2)
    assert "'a9' does not exist" in info.value.message and "'a1'" in info.value.message
    reply = http(
        "POST",
        f"{lora_servers.url}/v1/chat/completions",
        json={"model": "a9", "messages": [{"role": "user", "content": "w5"}]},
    )
    assert_error(reply, 404, param="model", code="model_not_found")
    assert_error(
        http("GET", f"{lora_servers.url}/v1/models/a9"), 404, param="model", code="model_not_found"
    )


def test_tokenize_accepts_an_adapter_name(lora_servers: LoRAServers) -> None:
    reply = http("POST", f"{lora_servers.url}/tokenize", json={"model": "a1", "prompt": "w5 w6"})
    assert reply.status == 200 and reply.json()["tokens"] == [WORD_W5, WORD_W5 + 1]


def test_models_lists_the_adapters_after_the_base(
    lora_client: openai.OpenAI, lora_models: LoRAModels, lora_servers: LoRAServers
) -> None:
    cards = http("GET", f"{lora_servers.url}/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [BASE_NAME, "a1", "a2"]
    base, a1, a2 = cards
    assert base["root"] == str(lora_models.base) and base["parent"] is None
    assert a1["root"] == str(lora_models.adapters["a1"]) and a1["parent"] == BASE_NAME
    assert a2["root"] == str(lora_models.adapters["a2"]) and a2["parent"] == "llama-of-a2"
    assert all(c["object"] == "model" and c["owned_by"] for c in cards)
    assert lora_client.models.retrieve("a2").model_extra["root"] == a2["root"]
