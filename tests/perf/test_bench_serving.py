"""perf.serving.bench_serving's parts: the workloads are deterministic and shaped as documented, the
metrics math, the streaming client against a scripted server, and the correctness check
failing on wrong outputs (a scripted server) and passing on the real paged-serve server.

Nothing here times anything or starts llama.cpp."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.engine.config import EngineConfig
from paged_serve.engine.model.loader import LoadedModel
from paged_serve.server.app import create_app, make_runner
from perf.serving import bench_serving
from perf.serving.bench_serving import timing_order
from perf.serving.check import check_replies, hf_references, matched_tokens, sample_indices
from perf.serving.client import (
    Reply,
    RequestRecord,
    complete_all,
    completion_body,
    new_session,
    run_closed_loop,
    run_open_loop,
    served_model,
)
from perf.serving.metrics import (
    inter_token_gaps,
    median_table,
    percentile,
    summarize,
    tpot,
    ttft,
)
from perf.serving.systems import REPO_ROOT, parse_system
from perf.serving.workloads import (
    SYSTEM_PROMPT,
    WORKLOADS,
    ServingWorkload,
    arrival_offsets,
    copy_heavy,
    decode_heavy,
)


# ------------------------------------------------------------------------------ workloads
@pytest.mark.parametrize(
    "name, n, prompt_range, output_range, streams",
    [
        ("decode-heavy", 24, (10, 120), (8, 96), None),
        ("long-prompt", 24, (10, 400), (8, 96), None),
        ("shared-prefix", 24, (250, 450), (16, 64), None),
        ("concurrency-1", 8, (64, 76), (32, 32), 1),
        ("concurrency-8", 32, (64, 76), (32, 32), 8),
    ],
)
def test_workloads_are_deterministic_and_shaped(
    default_tokenizer, name, n, prompt_range, output_range, streams
):
    build = WORKLOADS[name]
    w = build(default_tokenizer, None, 0)
    assert w == build(default_tokenizer, None, 0)
    assert w.prompts != build(default_tokenizer, None, 1).prompts
    assert (w.name, w.num_requests, w.streams) == (name, n, streams)
    assert all(prompt_range[0] <= len(p) <= prompt_range[1] for p in w.prompts)
    assert all(output_range[0] <= m <= output_range[1] for m in w.max_tokens)
    special = set(default_tokenizer.all_special_ids)
    if name != "shared-prefix":  # random ordinary tokens; the chat mix has its template's
        assert not any(t in special for p in w.prompts for t in p)
    assert len(set(map(tuple, w.prompts))) == n
    assert WORKLOADS[name](default_tokenizer, 5, 0).num_requests == 5


def test_servers_run_from_the_checkout_and_copy_prompts_read_it(default_tokenizer):
    """The servers' working folder and PYTHONPATH are the checkout (perf/ there would shadow
    Hugging Face's ``kernels`` with perf/kernels/), and the copy-heavy mix finds the checkout's
    functions and docs paragraphs to copy."""
    assert (REPO_ROOT / "pyproject.toml").is_file()
    w = copy_heavy(default_tokenizer, 1)
    assert w.num_requests == 4 and all(len(p) > 100 for p in w.prompts)


def test_decode_heavy_is_bench_e2e_generator(default_tokenizer):
    # the decode-heavy mix: bench_e2e's generator with prompts of 10-120 tokens
    from perf.engine.e2e_workload import make_workload

    w = decode_heavy(default_tokenizer)
    ref = make_workload(
        default_tokenizer,
        49152,
        num_requests=24,
        min_prompt=10,
        max_prompt=120,
        min_tokens=8,
        max_tokens=96,
        seed=0,
    )
    assert (w.prompts, w.max_tokens) == (ref.prompts, ref.max_tokens)


def test_shared_prefix_requests_share_the_system_prompt(default_tokenizer):
    w = WORKLOADS["shared-prefix"](default_tokenizer, None, 0)
    common = 0
    while all(p[common] == w.prompts[0][common] for p in w.prompts):
        common += 1
    system_tokens = len(default_tokenizer(SYSTEM_PROMPT).input_ids)
    assert common >= system_tokens > 250
    assert SYSTEM_PROMPT in default_tokenizer.decode(w.prompts[0])


def test_poisson_arrivals():
    assert arrival_offsets(4, math.inf) == [0.0] * 4
    offsets = arrival_offsets(4000, 8.0, seed=3)
    assert offsets == arrival_offsets(4000, 8.0, seed=3)
    assert offsets[0] == 0 and all(b >= a for a, b in zip(offsets, offsets[1:]))
    assert offsets[-1] / (len(offsets) - 1) == pytest.approx(1 / 8.0, rel=0.1)
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)


# ------------------------------------------------------------------------------ metrics
@pytest.mark.parametrize("q", [0, 25, 50, 90, 99, 100])
def test_percentile_interpolates_like_numpy(q):
    values = [5.0, 1.0, 9.5, 3.0, 7.25, 2.0, 8.0]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], q) is None


def _record(start, chunks, end, tokens, max_tokens=None, error=None) -> RequestRecord:
    return RequestRecord(
        0,
        max_tokens if max_tokens is not None else tokens,
        start=start,
        chunk_times=chunks,
        end=end,
        completion_tokens=tokens,
        prompt_tokens=10,
        error=error,
    )


def test_latencies_come_from_chunk_timestamps():
    r = _record(10.0, [10.5, 10.6, 10.8, 11.1], 11.2, tokens=4)
    assert ttft(r) == pytest.approx(0.5)
    assert inter_token_gaps(r) == pytest.approx([0.1, 0.2, 0.3])
    assert tpot(r) == pytest.approx((1.2 - 0.5) / 3)
    assert ttft(_record(0.0, [], 1.0, tokens=0)) is None


def test_summarize_counts_usage_tokens_over_wall_time():
    records = [
        _record(0.0, [0.5, 0.7, 1.0], 1.0, tokens=3),
        _record(0.0, [1.0, 2.0], 2.0, tokens=4),  # a chunk may carry several tokens
        _record(0.0, [0.5], 0.6, tokens=1, max_tokens=5),  # came back short
        _record(0.0, [], None, tokens=0, error="HTTP 500: boom"),
    ]
    m = summarize(records, wall_s=4.0)
    assert (m["completed"], m["failed"], m["short_requests"]) == (3, 1, 1)
    assert m["output_tokens"] == 8 and m["output_tok_s"] == 2.0 and m["request_s"] == 0.75
    assert m["errors"] == ["HTTP 500: boom"]
    assert m["ttft_ms"]["p50"] == pytest.approx(500.0)
    assert m["itl_ms"]["p50"] == pytest.approx(float(np.percentile([200, 300, 1000], 50)))
    assert m["e2e_ms"]["p99"] == pytest.approx(float(np.percentile([1000, 2000, 600], 99)))


def test_systems_take_turns_in_each_repeat_and_workload():
    a, b = ServingWorkload("a", [[1]], [1]), ServingWorkload("b", [[2]], [1])
    order = timing_order(["x", "y"], [a, b], repeats=2)
    assert [(r, w.name, s) for r, w, s in order] == [
        (0, "a", "x"),
        (0, "a", "y"),
        (0, "b", "x"),
        (0, "b", "y"),
        (1, "a", "x"),
        (1, "a", "y"),
        (1, "b", "x"),
        (1, "b", "y"),
    ]
    assert timing_order([], [a], repeats=3) == []


def _run_row(system: str, workload: str, tok_s: float, ttft_ms: float | None) -> dict:
    dist = {"p50": ttft_ms}
    metrics = {
        "output_tok_s": tok_s,
        "ttft_ms": dist,
        "itl_ms": {"p50": 2 * tok_s},
        "e2e_ms": dist,
    }
    return {"system": system, "workload": workload, "metrics": metrics}


def test_median_table_takes_each_system_and_workloads_median_over_its_runs():
    rows = [
        _run_row("x", "w", 100.0, 10.0),
        _run_row("y", "w", 50.0, None),  # no request completed: no TTFT
        _run_row("x", "w", 130.0, 30.0),
        _run_row("y", "w", 70.0, 40.0),
        _run_row("x", "w", 90.0, 20.0),
    ]
    lines = median_table(rows).splitlines()
    assert lines[0].startswith("| system | workload | runs | median out tok/s |")
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert cells == [
        ["x", "w", "3", "100.0", "20.0", "200.0", "20.0", "100.0, 130.0, 90.0"],
        ["y", "w", "2", "60.0", "40.0", "120.0", "40.0", "50.0, 70.0"],
    ]


# ------------------------------------------------------------------------------ a scripted server
def run_against(
    app: web.Application, client: Callable[[str], Awaitable[Any]], paged: bool = False
) -> Any:
    """Serve ``app`` on a free port (through the CLI's runner for paged-serve's app) and run
    ``client(base_url)`` against it."""

    async def go() -> Any:
        runner = make_runner(app) if paged else web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            return await client(f"http://127.0.0.1:{runner.addresses[0][1]}")
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def scripted_server(
    replies: dict[tuple[int, ...], tuple[list[str], int]], bodies: list[dict] | None = None
) -> web.Application:
    """A /v1/completions that answers each prompt with its scripted text pieces and usage
    (and appends each request body to ``bodies``)."""

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "scripted"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if bodies is not None:
            bodies.append(body)
        pieces, tokens = replies[tuple(body["prompt"])]
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": tokens}
        if not body.get("stream"):
            choice = {"index": 0, "text": "".join(pieces), "finish_reason": "length"}
            return web.json_response({"choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, piece in enumerate(pieces):
            finish = "length" if i == len(pieces) - 1 else None
            chunk = {"choices": [{"index": 0, "text": piece, "finish_reason": finish}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.001)
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


WORKLOAD = ServingWorkload("tiny", [[5, 6, 7], [8, 9], [10]], [3, 2, 2])
SCRIPT = {(5, 6, 7): (["a", "b", "c"], 3), (8, 9): (["de"], 2), (10,): (["f", "g"], 2)}


@pytest.mark.parametrize("streams", [None, 1, 2])
def test_client_records_chunks_and_usage(streams):
    async def client(url: str):
        if streams is None:
            return await run_open_loop(url, "scripted", WORKLOAD, [0.0, 0.0, 0.01])
        return await run_closed_loop(url, "scripted", WORKLOAD, streams)

    records, wall = run_against(scripted_server(SCRIPT), client)
    assert [r.index for r in records] == [0, 1, 2] and wall > 0
    assert [r.text for r in records] == ["abc", "de", "fg"]
    assert [len(r.chunk_times) for r in records] == [3, 1, 2]
    assert [r.completion_tokens for r in records] == [3, 2, 2]
    assert all(r.ok and r.finish_reason == "length" for r in records)
    assert summarize(records, wall)["short_requests"] == 0


@pytest.mark.parametrize("streams", [None, 2])
def test_sampled_runs_send_the_fields_and_a_seed_per_request(streams):
    args = bench_serving.parse_args(["--temperature", "0.7", "--top-p", "0.9"])
    assert args.sampling == {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0}
    assert bench_serving.parse_args([]).sampling is None
    bodies: list[dict] = []

    async def client(url: str):
        if streams is None:
            return await run_open_loop(url, "scripted", WORKLOAD, [0.0] * 3, args.sampling)
        return await run_closed_loop(url, "scripted", WORKLOAD, streams, args.sampling)

    records, _ = run_against(scripted_server(SCRIPT, bodies), client)
    assert all(r.ok for r in records)
    by_prompt = {tuple(b["prompt"]): b for b in bodies}
    for i, prompt in enumerate(WORKLOAD.prompts):
        body = by_prompt[tuple(prompt)]
        assert body["seed"] == i and body["stream"] and body["max_tokens"] == WORKLOAD.max_tokens[i]
        assert {k: body[k] for k in args.sampling} == args.sampling
    greedy = completion_body("m", [1], 2, stream=False)
    assert greedy["temperature"] == 0.0 and "seed" not in greedy


@pytest.mark.parametrize("flags", [["--temperature", "0"], ["--temperature", "1", "--top-p", "0"]])
def test_sampling_flags_are_checked(flags):
    with pytest.raises(SystemExit):
        bench_serving.parse_args(flags)


class FakeTokenizer:
    """Token ``i`` is the letter ``chr(ord('a') + i)``; token 0 is special (renders empty)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if i == 0 and skip_special_tokens else chr(ord("a") + i) for i in ids)


REFERENCES = {0: [0, 1, 2], 2: [5, 6]}  # "bc" (token 0 special) and "fg"


def _check(script, require_hf_equality=True):
    replies = run_against(
        scripted_server(script), lambda url: complete_all(url, "scripted", WORKLOAD)
    )
    return check_replies(
        WORKLOAD,
        replies,
        tokenizer=FakeTokenizer(),
        references=REFERENCES,
        hf_dtype="float32",
        require_hf_equality=require_hf_equality,
    )


def test_check_passes_on_the_reference_output():
    result = _check({**SCRIPT, (5, 6, 7): (["bc"], 3)})
    assert result.passed, result
    assert (result.hf_checked, result.hf_exact, result.token_match_rate) == (2, 2, 1.0)


def test_check_fails_on_a_wrong_token():
    result = _check({**SCRIPT, (5, 6, 7): (["bc"], 3), (10,): (["fh"], 2)})
    assert not result.passed
    assert result.first_divergence == {2: 1} and result.token_match_rate == 0.8
    assert "FAILED" in result.summary()
    # a system that need not equal HF reports the rate and passes
    assert _check({**SCRIPT, (5, 6, 7): (["bc"], 3), (10,): (["fh"], 2)}, False).passed


def test_check_fails_on_a_wrong_length():
    result = _check({**SCRIPT, (5, 6, 7): (["bc"], 3), (8, 9): (["de"], 1)})
    assert not result.passed and result.wrong_length == {1: 1}
    assert not _check({**SCRIPT, (5, 6, 7): (["bc"], 3), (8, 9): (["de"], 1)}, False).passed


def test_check_counts_failed_requests():
    replies = [Reply("bc", 3), Reply("", None, "HTTP 500: boom"), Reply("fg", 2)]
    result = check_replies(
        WORKLOAD,
        replies,
        tokenizer=FakeTokenizer(),
        references=REFERENCES,
        hf_dtype="float32",
        require_hf_equality=False,
    )
    assert not result.passed and result.failed_requests == 1


def test_matched_tokens_and_samples():
    assert matched_tokens(FakeTokenizer(), [1, 2, 3], "bcx") == 2
    assert matched_tokens(FakeTokenizer(), [1, 2, 3], "xbc") == 0
    assert sample_indices(24, 4) == [0, 8, 15, 23]
    assert sample_indices(3, 8) == [0, 1, 2] and sample_indices(5, 1) == [0]


@pytest.mark.parametrize(
    "text, name, equality",
    [
        ("paged-serve", "paged-serve-float32", True),
        ("paged-serve:bfloat16", "paged-serve-bfloat16", False),
        ("llama-cpp-f32", "llama-cpp-f32", False),
    ],
)
def test_systems(text, name, equality):
    system = parse_system(text)
    assert (system.name, system.require_hf_equality) == (name, equality)
    assert system.suppress_eog == text.startswith("llama")
    with pytest.raises(ValueError):
        parse_system("external")  # needs a base URL
    with pytest.raises(ValueError):
        parse_system("llama-cpp-f32:bfloat16")


def test_a_system_may_carry_its_own_flags():
    int8 = parse_system("paged-serve:float32 --quantization int8", extra_args=("--max-num-seqs=8",))
    assert int8.name == "paged-serve-float32 --quantization int8"
    assert int8.extra_args == ("--max-num-seqs=8", "--quantization", "int8")
    assert not int8.require_hf_equality  # int8 weights: report the agreement rate
    assert parse_system("paged-serve", extra_args=("--max-num-seqs=8",)).require_hf_equality


# ------------------------------------------------------------------------------ the real server
def test_check_passes_on_paged_serve_fp32(default_model: LoadedModel, hf_default_model):
    """Through the real server, in float32: exact lengths and HF's greedy tokens."""
    full = decode_heavy(default_model.tokenizer, num_requests=3)
    workload = ServingWorkload("small", full.prompts, [5, 9, 7])
    engine = AsyncEngine(EngineConfig(kv_cache_memory=32 << 20), loaded=default_model)
    try:

        async def client(url: str):
            async with new_session() as session:
                model = await served_model(session, url)
            return await complete_all(url, model, workload)

        replies = run_against(create_app(engine), client, paged=True)
    finally:
        engine.shutdown()
    references = hf_references(hf_default_model, workload, [0, 2])
    result = check_replies(
        workload,
        replies,
        tokenizer=default_model.tokenizer,
        references=references,
        hf_dtype="float32",
        require_hf_equality=True,
    )
    assert result.passed, result
    assert (result.hf_checked, result.hf_exact) == (2, 2)
    # the same replies against a reference that differs in one token fail
    wrong = {i: ref[:-1] + [(ref[-1] + 1) % 49152] for i, ref in references.items()}
    bad = check_replies(
        workload,
        replies,
        tokenizer=default_model.tokenizer,
        references=wrong,
        hf_dtype="float32",
        require_hf_equality=True,
    )
    assert not bad.passed and bad.hf_exact == 0
