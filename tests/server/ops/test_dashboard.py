"""The dashboard page and GET /v1/engine/state: self-contained page, JSON consistent with
/metrics and with the block pool mid-run, API keys, the history, and --no-dashboard."""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.engine.observe.metrics import EngineStats
from paged_serve.server.app import create_app
from paged_serve.server.cli import _is_loopback, _log_dashboard, build_parser
from paged_serve.server.ops.dashboard import History
from tests.server.conftest import (
    API_KEYS,
    Reply,
    ServerThread,
    assert_error,
    http,
    metric_values,
    parse_sse,
)
from tests.server.processes import READY, START_DEADLINE_S, ServerProcess

# EngineSnapshot field -> the /metrics sample that renders it
GAUGE_METRICS = {
    "num_running": "paged_serve_requests_running",
    "num_waiting": "paged_serve_requests_waiting",
    "kv_blocks_total": "paged_serve_kv_blocks_total",
    "kv_blocks_used": "paged_serve_kv_blocks_used",
    "kv_blocks_cached": "paged_serve_kv_blocks_cached",
    "num_preemptions": "paged_serve_preemptions_total",
    "prefix_query_tokens": "paged_serve_prefix_cache_query_tokens_total",
    "prefix_hit_tokens": "paged_serve_prefix_cache_hit_tokens_total",
    "num_steps": "paged_serve_steps_total",
    "num_graph_steps": "paged_serve_decode_graph_steps_total",
}
PROMPT_IDS = list(range(100, 140))  # 40 tokens: two full blocks of 16 and a partial one
RUN_DEADLINE_S = 60.0


def engine_state(url: str, headers: dict[str, str] | None = None) -> dict:
    reply = http("GET", f"{url}/v1/engine/state", headers=headers)
    assert reply.status == 200, reply.body
    assert reply.headers["Content-Type"].startswith("application/json")
    return reply.json()


def check_against_metrics(state: dict, metrics: dict[str, float]) -> None:
    """The state's gauges and block figures are what /metrics reports at the same step."""
    gauges = state["gauges"]
    for field, name in GAUGE_METRICS.items():
        assert gauges[field] == metrics[name], field
    usage = state["kv"]["usage"]
    assert state["step"] == gauges["num_steps"]
    assert usage["used_blocks"] == gauges["kv_blocks_used"]
    assert usage["cached_blocks"] == gauges["kv_blocks_cached"]
    assert state["kv"]["num_blocks"] == gauges["kv_blocks_total"]


def check_pool(state: dict) -> Counter:
    """The map, the usage and the request tables agree; returns the holders of each block."""
    kv = state["kv"]
    pool, usage = kv["map"], kv["usage"]
    holders = Counter(b for r in state["running"] for b in r["blocks"])
    # blocks in use = the distinct blocks of the running requests (a shared block counts once)
    assert usage["used_blocks"] == len(holders) == pool.count("u") + pool.count("s")
    shared = {b for b, n in holders.items() if n > 1}
    assert kv["shared_blocks"] == len(shared) == pool.count("s")
    assert shared == {i for i, ch in enumerate(pool) if ch == "s"}
    assert usage["cached_blocks"] == pool.count("c")
    assert usage["free_blocks"] == pool.count(".") + pool.count("c")
    assert len(pool) == kv["num_blocks"]
    assert all(r["blocks"] == [] for r in state["waiting"])
    return holders


@pytest.mark.parametrize("path", ["/", "/dashboard"])
def test_the_page_is_self_contained(base_url: str, path: str):
    reply = http("GET", f"{base_url}{path}")
    assert reply.status == 200
    assert reply.headers["Content-Type"] == "text/html; charset=utf-8"
    csp = reply.headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    html = reply.body.decode()
    assert html.startswith("<!doctype html>")
    # nothing is fetched from elsewhere: no absolute URL, no external script or style sheet
    assert not re.search(r"https?://|(src|href)\s*=\s*[\"']?//", html)
    assert not re.search(r"<script[^>]+src=|<link[^>]+stylesheet", html)
    assert "/v1/engine/state" in html and "/v1/chat/completions" in html


def test_the_idle_state_matches_metrics(base_url: str, engine: AsyncEngine):
    body = engine_state(base_url)
    assert body["object"] == "engine.state"
    assert body["model"] == engine.model_name
    assert body["history_interval_s"] == 1.0
    weights = body["weights"]
    params = sum(p.numel() * p.element_size() for p in engine.engine.loaded.model.parameters())
    assert weights["bytes"] >= params and weights["quantization"] is None
    assert weights["dtype"] in ("float32", "bfloat16", "float16")
    state = body["engine"]
    check_against_metrics(state, metric_values(base_url))
    check_pool(state)
    assert state["running"] == [] and state["waiting"] == []
    assert set(state["kv"]["map"]) <= {".", "c"}
    assert state["kv"]["block_size"] == engine.block_size
    assert state["kv"]["cache_dtype"] == weights["dtype"]  # --kv-cache-dtype auto


def _stream(url: str, body: dict, out: list[Reply]) -> threading.Thread:
    thread = threading.Thread(
        target=lambda: out.append(http("POST", f"{url}/v1/completions", json=body))
    )
    thread.start()
    return thread


def test_the_state_mid_run_agrees_with_metrics_and_the_pool(
    base_url: str, engine: AsyncEngine, model_name: str, monkeypatch: pytest.MonkeyPatch
):
    # A state after every step while watched, so the one frozen below is the last step's.
    monkeypatch.setattr(engine.state_watch, "min_interval_s", 0.0)
    monkeypatch.setattr(engine.state_watch, "max_busy_fraction", float("inf"))
    cow_before = engine_state(base_url)["engine"]["kv"]["copy_on_write_total"]
    body = {
        "model": model_name,
        "prompt": PROMPT_IDS,
        "n": 3,
        "max_tokens": 48,
        "temperature": 1.0,
        "seed": 5,
        "ignore_eos": True,
        "stream": True,
    }
    replies: list[Reply] = []
    thread = _stream(base_url, body, replies)
    try:
        end = time.monotonic() + RUN_DEADLINE_S
        while True:  # until the three samples have forked and each written its own tokens
            running = engine_state(base_url)["engine"]["running"]
            if len(running) == 3 and all(r["output_tokens"] >= 2 for r in running):
                break
            assert time.monotonic() < end, running
            time.sleep(0.05)
        with engine.between_steps() as llm:
            body_now = engine_state(base_url)
            metrics = metric_values(base_url)
            bm = llm.block_manager
            bm.check_integrity()
            state = body_now["engine"]
            assert state["step"] == llm.num_steps  # taken after the step the engine is held at
            check_against_metrics(state, metrics)
            holders = check_pool(state)
            assert state["kv"]["map"] == bm.pool_map()
            assert state["kv"]["usage"] == dataclasses.asdict(bm.usage())
            for r in state["running"]:
                assert r["blocks"] == bm.block_table(r["id"])
                assert r["computed_tokens"] >= r["prompt_tokens"] == len(PROMPT_IDS)
            # the two full prompt blocks are shared by the three samples, and counted once
            assert state["kv"]["shared_blocks"] >= 2
            assert metrics["paged_serve_kv_blocks_used"] == len(holders)
            assert sum(len(r["blocks"]) for r in state["running"]) > len(holders)
            kv = state["kv"]
        # each sample but the last copied the shared partial block before writing into it
        assert kv["copy_on_write_total"] >= cow_before + 2
        for src, dst in kv["recent_copies"][-2:]:
            assert holders[dst] == 1 and src != dst
    finally:
        thread.join(RUN_DEADLINE_S)
    [reply] = replies
    assert reply.status == 200
    assert parse_sse(reply.body)[-1] == (None, "[DONE]")
    after = engine_state(base_url)["engine"]
    check_pool(after)


def test_the_state_needs_a_key_when_keys_are_set(keyed_url: str):
    assert_error(http("GET", f"{keyed_url}/v1/engine/state"), 401, code="invalid_api_key")
    bad = {"Authorization": "Bearer nope"}
    assert_error(
        http("GET", f"{keyed_url}/v1/engine/state", headers=bad), 401, code="invalid_api_key"
    )
    good = {"Authorization": f"Bearer {API_KEYS[1]}"}
    assert engine_state(keyed_url, headers=good)["object"] == "engine.state"
    assert http("GET", f"{keyed_url}/").status == 200  # the page holds no data itself


def test_without_the_dashboard_there_is_no_page_and_no_state(
    engine: AsyncEngine, server_thread: ServerThread
):
    url = server_thread.serve(lambda: create_app(engine, dashboard=False))
    for path in ("/", "/dashboard", "/v1/engine/state"):
        assert_error(http("GET", f"{url}{path}"), 404)
    assert http("GET", f"{url}/metrics").status == 200


def test_history_turns_counters_into_rates():
    stats = EngineStats()
    snap = SimpleNamespace(num_running=2, num_waiting=1, kv_blocks_used=7, num_preemptions=0)
    engine = SimpleNamespace(snapshot=lambda: snap, stats=stats)
    history = History(maxlen=3)
    history.sample(engine, now=10.0)
    assert list(history.points) == []  # a first sample is only a baseline
    stats.generation_tokens_total += 30
    stats.prompt_tokens_total += 100
    stats.ttft.observe(0.5)
    stats.ttft.observe(0.25)
    snap.num_preemptions = 2
    history.sample(engine, now=12.0)
    [point] = history.points
    assert point.generation_tokens_per_s == 15.0
    assert point.prompt_tokens_per_s == 50.0
    assert point.ttft_s == 0.375
    assert (point.requests_running, point.requests_waiting, point.kv_blocks_used) == (2, 1, 7)
    assert point.preemptions == 2
    for t in (13.0, 14.0, 15.0):
        history.sample(engine, now=t)
    assert len(history.points) == 3  # the oldest fell out
    assert history.points[-1].ttft_s is None  # nobody finished in that second
    assert history.points[-1].generation_tokens_per_s == 0.0


def test_the_state_carries_the_history(base_url: str):
    end = time.monotonic() + 10.0
    while not engine_state(base_url)["history"]:  # the sampler runs once a second
        assert time.monotonic() < end
        time.sleep(0.2)
    point = engine_state(base_url)["history"][-1]
    assert set(point) == {
        "time",
        "generation_tokens_per_s",
        "prompt_tokens_per_s",
        "ttft_s",
        "requests_running",
        "requests_waiting",
        "kv_blocks_used",
        "preemptions",
    }


def test_no_dashboard_flag_and_loopback_detection():
    assert build_parser().parse_args(["--no-dashboard"]).no_dashboard
    assert not build_parser().parse_args([]).no_dashboard
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert _is_loopback(host)
    for host in ("0.0.0.0", "::", "", "192.168.1.4", "example.org"):
        assert not _is_loopback(host)


def test_a_dashboard_beyond_loopback_is_logged(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.INFO, logger="server"):
        _log_dashboard("http://127.0.0.1:8000/", "127.0.0.1", keyed=False)
        assert "dashboard at http://127.0.0.1:8000/" in caplog.text
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        _log_dashboard("http://0.0.0.0:8000/", "0.0.0.0", keyed=False)
        [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert "anyone who reaches the server" in warning.getMessage()


@pytest.fixture(scope="module")
def no_dashboard_server() -> Iterator[tuple[ServerProcess, str]]:
    args = ["--port", "0", "--kv-cache-memory", str(16 << 20), "--max-model-len", "256"]
    server = ServerProcess([*args, "--no-dashboard"])
    try:
        yield server, server.wait_for(READY, START_DEADLINE_S).group("url")
    finally:
        server.stop()


def test_the_cli_flag_turns_the_dashboard_off(no_dashboard_server: tuple[ServerProcess, str]):
    _, url = no_dashboard_server
    assert_error(http("GET", f"{url}/"), 404)
    assert_error(http("GET", f"{url}/v1/engine/state"), 404)
    assert http("GET", f"{url}/health").status == 200
