"""vllm serve's flags: accepted where paged-serve does the same, refused with a reason (exit 2)
otherwise; --generation-config defaults applied where a request leaves a field out."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import openai
import pytest
from transformers import GenerationConfig

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.engine.config import EngineConfig
from paged_serve.server.app import create_app
from paged_serve.server.cli import build_parser, main
from paged_serve.server.generation.defaults import SamplingDefaults, load_sampling_defaults
from paged_serve.server.generation.sampling import output_limit, responses_params, sampling_params
from paged_serve.server.protocol.chat import ChatCompletionRequest
from paged_serve.server.protocol.completions import CompletionRequest
from paged_serve.server.protocol.errors import APIError
from paged_serve.server.protocol.responses import ResponsesRequest
from paged_serve.server.vllm_flags import REFUSALS
from tests.conftest import assert_pool_clean, tiny_model
from tests.server.conftest import ServerThread, wait_idle


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("refusal", REFUSALS, ids=lambda r: r.flags[0])
def test_each_refused_flag_names_itself_and_exits_2(refusal, capsys):
    for flag in refusal.flags:
        argv = [flag, "fp8"] if refusal.takes_value else [flag]
        message = _refused(argv, capsys)
        assert f"{flag}" in message and refusal.reason in message
        assert "not supported by paged-serve" in message


@pytest.mark.parametrize(
    "argv", [["--kv-cache-dtype", "auto"], ["-pp", "1"], ["-dp", "1"], ["--load-format", "auto"]]
)
def test_vllm_defaults_spelled_out_are_accepted(argv):
    build_parser().parse_args(argv)


def test_a_vllm_launch_line_parses_to_our_settings():
    args = build_parser().parse_args(
        [
            "Qwen/Qwen3-0.6B",
            "--served-model-name", "a", "b",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--reasoning-parser", "qwen3",
            "--generation-config", "vllm",
            "--max-logprobs", "3",
            "--seed", "7",
            "--no-enable-prefix-caching",
            "--max-model-len", "4096",
            "-tp", "2",
            "--disable-log-requests",
        ]
    )  # fmt: skip
    assert args.model_tag == "Qwen/Qwen3-0.6B"
    assert args.served_model_name == ["a", "b"]
    assert (args.tool_call_parser, args.reasoning_parser) == ("hermes", "qwen3")
    assert (args.max_logprobs, args.seed, args.tensor_parallel_size) == (3, 7, 2)
    assert args.enable_prefix_caching is False


def test_help_groups_flags_as_vllm_does():
    text = build_parser().format_help()
    for group in ("Frontend", "ModelConfig", "CacheConfig", "ParallelConfig", "SchedulerConfig"):
        assert f"\n{group}:" in text


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["model-a", "--model", "model-b"], "the model is given twice"),
        (["--max-logprobs", "21"], "--max-logprobs"),
        (["--generation-config", "/no/such/folder"], "--generation-config"),
        (["--chat-template", "/no/such/file"], "--chat-template"),
    ],
)
def test_bad_vllm_values_exit_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert needle in capsys.readouterr().err


def _write_generation_config(folder: Path, **values) -> Path:
    """A generation_config.json as model folders ship it (sampling on, its values set)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True, **values}))
    return folder


def test_generation_config_sources(tmp_path: Path):
    folder = _write_generation_config(
        tmp_path / "g",
        temperature=0.6,
        top_p=0.9,
        top_k=20,
        repetition_penalty=1.05,
        max_new_tokens=256,
    )
    expected = SamplingDefaults(
        temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.05, max_tokens=256
    )
    assert load_sampling_defaults(str(folder), None) == expected
    assert load_sampling_defaults("auto", GenerationConfig.from_pretrained(folder)) == expected
    assert load_sampling_defaults("vllm", GenerationConfig.from_pretrained(folder)) == (
        SamplingDefaults()
    )
    plain = _write_generation_config(tmp_path / "p")  # sampling on, no value set
    assert load_sampling_defaults(str(plain), None) == SamplingDefaults()
    with pytest.raises(ValueError, match="generation_config.json"):
        load_sampling_defaults(str(tmp_path / "empty"), None)


def test_defaults_fill_only_what_a_request_leaves_out():
    defaults = SamplingDefaults(temperature=0.6, top_k=20, repetition_penalty=1.05)
    body = msgspec.json.decode(
        b'{"prompt": "x", "temperature": 0.0, "top_k": null}', type=CompletionRequest
    )
    filled = defaults.fill(body)
    assert (filled.temperature, filled.top_k, filled.repetition_penalty) == (0.0, 20, 1.05)
    params = sampling_params(filled, 1000, max_tokens=4, logprobs=None)
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0.0, 20, 1.05)
    chat = defaults.fill(
        msgspec.json.decode(
            b'{"messages": [{"role": "user", "content": "x"}]}', type=ChatCompletionRequest
        )
    )
    assert chat.temperature == 0.6
    responses = defaults.fill_responses(
        msgspec.json.decode(b'{"input": "x"}', type=ResponsesRequest)
    )
    assert (responses.temperature, responses.top_p) == (0.6, 1.0)
    params = responses_params(responses, max_tokens=4, defaults=defaults)
    assert (params.top_k, params.repetition_penalty) == (20, 1.05)


def test_the_server_applies_the_defaults(engine: AsyncEngine, monkeypatch, tmp_path: Path):
    """Through HTTP: the engine receives the generation config's values for the fields the
    request leaves out, and the request's own for the rest."""
    folder = _write_generation_config(tmp_path / "g", temperature=0.7, top_k=5, max_new_tokens=3)
    seen = []
    add_request = engine.add_request

    def spy(prompt, params, *args, **kwargs):
        seen.append(params)
        return add_request(prompt, params, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", spy)
    thread = ServerThread()
    try:
        url = thread.serve(
            lambda: create_app(engine, sampling_defaults=load_sampling_defaults(str(folder), None))
        )
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        client.completions.create(model=engine.model_name, prompt="Hi", max_tokens=2)
        client.completions.create(model=engine.model_name, prompt="Hi", max_tokens=2, temperature=0)
        client.completions.create(model=engine.model_name, prompt="Hi")  # OpenAI's 16, capped
        client.completions.create(model=engine.model_name, prompt="Hi", max_tokens=9)
        chat = {"model": engine.model_name, "messages": [{"role": "user", "content": "Hi"}]}
        client.chat.completions.create(**chat)  # max_new_tokens caps the rest of the context
        client.chat.completions.create(**chat, max_tokens=5)
        client.chat.completions.create(**chat, max_completion_tokens=1)
        client.responses.create(model=engine.model_name, input="Hi")
        client.responses.create(model=engine.model_name, input="Hi", max_output_tokens=16)
        client.responses.create(model=engine.model_name, input="Hi", max_output_tokens=2)
    finally:
        thread.close()
    wait_idle(engine)
    assert [(p.temperature, p.top_k) for p in seen[:2]] == [(0.7, 5), (0.0, 5)]
    # The smallest of the request's limit, the rest of the context and max_new_tokens (3).
    assert [p.max_tokens for p in seen] == [2, 2, 3, 3, 3, 3, 1, 3, 3, 2]
    assert_pool_clean(engine.engine.block_manager)
    assert json.loads((folder / "generation_config.json").read_text())["temperature"] == 0.7


def test_the_output_limit_is_the_smallest_of_every_limit():
    assert output_limit(100, 10, None, "messages") == 90  # the rest of the context
    assert output_limit(100, 10, None, "messages", 8) == 8
    assert output_limit(100, 95, None, "messages", 8) == 5  # the context is smaller
    assert output_limit(100, 10, 50, "messages", 8) == 8  # max_new_tokens caps the request's
    assert output_limit(100, 10, 4, "messages", 8) == 4  # the request's own is smaller
    assert output_limit(100, 10, 0, "prompt", 8) == 0  # a completion that only scores
    with pytest.raises(APIError, match="maximum context length is 100"):
        output_limit(100, 10, 91, "messages", 8)  # a limit that does not fit is still refused


def test_auto_reads_the_generation_config_a_model_folder_ships(tmp_path: Path):
    """A tiny model saved with its generation_config.json: the engine loads it from the folder
    and ``auto`` takes its sampling values and max_new_tokens."""
    model = tiny_model("llama")
    model.generation_config = GenerationConfig(
        do_sample=True, temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=64
    )
    model.save_pretrained(tmp_path)
    config = EngineConfig(model=str(tmp_path), dtype="float32", kv_cache_memory=1 << 20)
    engine = AsyncEngine(config)
    try:
        defaults = load_sampling_defaults("auto", engine.generation_config)
    finally:
        engine.shutdown()
    assert defaults == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, max_tokens=64)


def test_speculative_config_parses_as_vllm_writes_it(capsys):
    from paged_serve.engine.engine_args import engine_kwargs
    from paged_serve.engine.spec.config import SpeculativeConfig

    spec = (
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, '
        '"prompt_lookup_min": 2}'
    )
    args = build_parser().parse_args(["--speculative-config", spec])
    assert engine_kwargs(args)["speculative_config"] == SpeculativeConfig(
        num_speculative_tokens=3, prompt_lookup_max=5
    )
    assert build_parser().parse_args([]).speculative_config == "auto"
    for off in (["--speculative-config", "off"], ["--no-speculation"]):
        assert build_parser().parse_args(off).speculative_config is None
    message = _refused(["--speculative-config", '{"method": "eagle3", "model": "x"}'], capsys)
    assert "--speculative-config" in message and "eagle3" in message
    EngineConfig(speculative_config=SpeculativeConfig())  # a valid engine setting


@pytest.mark.parametrize(
    ("value", "name"),
    [("int8", "int8"), ("fp8", "fp8"), ("fp8_per_token_head", "fp8_per_token_head")],
)
def test_kv_cache_dtype_reaches_the_engine(value, name):
    from paged_serve.engine.engine_args import engine_kwargs

    args = build_parser().parse_args(["--kv-cache-dtype", value])
    assert engine_kwargs(args)["kv_cache_dtype"] == name


def test_an_unknown_kv_cache_dtype_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--kv-cache-dtype", "int4"])
    assert exit_info.value.code == 2
    assert "--kv-cache-dtype" in capsys.readouterr().err
