"""Tensor-parallel faults and shutdown: a worker killed mid-stream fails the engine cleanly (the
stream ends with an ``engine_dead`` error frame, ``/health`` turns 503, ``paged-serve`` exits 1)
and no worker process outlives its engine, after a fault or after a clean SIGTERM; a rank
launched on its own through the torch.distributed environment (the multi-node way) joins.

The model is the tiny random Llama at TP=2 on gloo, with the default model's tokenizer so that
its tokens stream as text (prompts are token ids within its 512-token vocabulary).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from transformers import AutoTokenizer

from paged_serve.engine import LLM, SamplingParams
from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.engine.config import EngineConfig
from paged_serve.engine.model.loader import LoadedModel, resolve_model_path
from paged_serve.server.app import create_app
from tests.conftest import hf_greedy, loaded, tiny_model
from tests.server.conftest import ServerThread, http
from tests.server.processes import READY, START_DEADLINE_S, ServerProcess

STREAM = {"model": "tiny", "prompt": [3, 1, 4, 1, 5], "max_tokens": 400, "ignore_eos": True}
WORKER_STARTED = re.compile(r"tensor-parallel rank 1 started \(pid (?P<pid>\d+)\)")
EXIT_DEADLINE_S = 30.0


def process_gone(pid: int, deadline_s: float = EXIT_DEADLINE_S) -> bool:
    """Poll (bounded) until ``pid`` no longer exists, or is a zombie awaiting its reaper."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


async def stream_until(url: str, after_frames: int, act) -> list[str]:
    """Stream a long completion, call ``act()`` after ``after_frames`` frames, read to the end."""
    frames: list[str] = []
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json={**STREAM, "stream": True}) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data: "):
                    frames.append(line[len("data: ") :].decode().strip())
                    if len(frames) == after_frames:
                        act()
    return frames


def assert_ends_with_engine_dead(frames: list[str]) -> None:
    assert frames[-1] == "[DONE]"
    error = json.loads(frames[-2])["error"]
    assert error["code"] == "engine_dead"
    assert len(frames) < STREAM["max_tokens"]


@pytest.fixture(scope="module")
def tokenizer() -> object:
    return AutoTokenizer.from_pretrained(resolve_model_path(None)[0])


# ------------------------------------------------------------------ in process
@pytest.fixture
def tp_server(tokenizer: object) -> Iterator[tuple[AsyncEngine, str]]:
    config = EngineConfig(tensor_parallel_size=2, kv_cache_memory=4 << 20)
    tiny = loaded(tiny_model("llama"))
    tiny = LoadedModel(tiny.model, tokenizer, "tiny", (), tiny.max_model_len, 0.0)
    engine = AsyncEngine(config, loaded=tiny)
    thread = ServerThread()
    try:
        yield engine, thread.serve(lambda: create_app(engine))
    finally:
        thread.close()
        engine.shutdown()


def test_a_worker_killed_mid_stream_fails_the_engine_cleanly(tp_server):
    engine, url = tp_server
    worker = engine.engine.tp.processes[1]
    assert http("GET", f"{url}/health").status == 200
    frames = asyncio.run(stream_until(url, 3, lambda: os.kill(worker.pid, signal.SIGKILL)))
    assert_ends_with_engine_dead(frames)
    assert http("GET", f"{url}/health").status == 503
    assert "rank 1" in str(engine.dead) and "SIGKILL" in str(engine.dead)
    reply = http("POST", f"{url}/v1/completions", json={**STREAM, "max_tokens": 2})
    assert reply.status == 503
    engine.shutdown()
    assert process_gone(worker.pid)


# ------------------------------------------------------------------ paged-serve -tp 2
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: object) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def start_server(model_dir: Path) -> tuple[ServerProcess, str, int]:
    """``paged-serve -tp 2`` on the tiny model: (process, base URL, worker pid)."""
    server = ServerProcess(
        [
            "--model", str(model_dir),
            "--served-model-name", "tiny",
            "-tp", "2",
            "--port", "0",
            "--kv-cache-memory", str(4 << 20),
            "--log-level", "info",
        ]
    )  # fmt: skip
    try:
        pid = int(server.wait_for(WORKER_STARTED, START_DEADLINE_S).group("pid"))
        url = server.wait_for(READY, START_DEADLINE_S).group("url")
    except BaseException:
        server.stop()
        raise
    return server, url, pid


def test_paged_serve_exits_1_when_a_worker_dies_and_leaves_no_process(model_dir):
    server, url, worker = start_server(model_dir)
    try:
        frames = asyncio.run(stream_until(url, 3, lambda: os.kill(worker, signal.SIGKILL)))
        assert_ends_with_engine_dead(frames)
        assert server.proc.wait(timeout=EXIT_DEADLINE_S) == 1
        server.wait_for(re.compile("the engine died.*rank 1"), 5.0)
    finally:
        server.stop()
    assert process_gone(worker)


def test_paged_serve_sigterm_stops_the_workers_and_exits_0(model_dir):
    server, url, worker = start_server(model_dir)
    try:
        frames = asyncio.run(stream_until(url, 3, lambda: server.proc.send_signal(signal.SIGTERM)))
        assert json.loads(frames[-2])["error"]["code"] == "request_aborted"
        assert server.proc.wait(timeout=EXIT_DEADLINE_S) == 0
    finally:
        server.stop()
    assert process_gone(worker)


def test_workers_exit_when_the_driver_is_killed(model_dir):
    server, _, worker = start_server(model_dir)
    server.stop()  # SIGKILL: no shutdown code runs in the driver
    assert process_gone(worker)


def test_a_rank_launched_on_its_own_joins_through_the_environment(model_dir, monkeypatch):
    """The multi-node launch, on one node: the driver spawns no rank (LOCAL_WORLD_SIZE=1) and
    rank 1 is ``python -m paged_serve.engine.executor.rank`` with RANK/WORLD_SIZE/MASTER_* set."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    flags = ["--model", str(model_dir), "--kv-cache-memory", str(4 << 20)]
    rank1 = subprocess.Popen(
        [sys.executable, "-m", "paged_serve.engine.executor.rank", *flags],
        env={**os.environ, **env},
    )
    try:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", port)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        prompt = [3, 1, 4, 1, 5, 9, 2, 6]
        with LLM(str(model_dir), tensor_parallel_size=2, kv_cache_memory=4 << 20) as llm:
            assert not llm.engine.tp.processes  # nothing spawned: rank 1 came on its own
            greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            [result] = llm.generate([prompt], greedy)
        assert result.token_ids == hf_greedy(tiny_model("llama"), prompt, 8)
        assert rank1.wait(timeout=EXIT_DEADLINE_S) == 0  # SHUTDOWN reached it
    finally:
        if rank1.poll() is None:
            rank1.kill()
            rank1.wait()
