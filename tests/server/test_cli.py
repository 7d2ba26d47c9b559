"""The ``paged-serve`` command: flags, the ready log line, and a clean SIGTERM shutdown that
ends the streams in flight with a final frame and exits 0."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
from collections.abc import Iterator

import aiohttp
import openai
import pytest

from paged_serve.engine.model.loader import default_gguf_path
from tests.server.conftest import http, metric_values
from tests.server.processes import READY, START_DEADLINE_S, ServerProcess


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[ServerProcess, str]]:
    """paged-serve started with a vllm serve launch line (positional model, several names,
    vLLM's tool, logging, seed and cache flags)."""
    server = ServerProcess(
        [
            str(default_gguf_path()),
            "--port", "0",
            "--kv-cache-memory", str(32 << 20),
            "--max-model-len", "512",
            "--served-model-name", "smol", "smol-alias",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--generation-config", "vllm",
            "--max-logprobs", "3",
            "--seed", "0",
            "--kv-cache-dtype", "auto",
            "-pp", "1",
            "--disable-log-requests",
            "--uvicorn-log-level", "warning",
            "--log-level", "info",
        ]
    )  # fmt: skip
    try:
        ready = server.wait_for(READY, START_DEADLINE_S)
        yield server, ready.group("url")
    finally:
        server.stop()


def test_serves_under_the_given_name(served: tuple[ServerProcess, str]):
    server, url = served
    assert any("KV cache:" in line for line in server.log)  # the capacity is logged
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["smol", "smol-alias"]
    out = client.completions.create(model="smol", prompt="Hello", max_tokens=2)
    assert out.model == "smol"
    out = client.completions.create(model="smol-alias", prompt="Hello", max_tokens=2)
    assert out.model == "smol"  # replies carry the first name, as vLLM's
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="smol", prompt="Hello", max_tokens=2, logprobs=4)
    assert "--max-logprobs" in str(refused.value)
    values = metric_values(url)
    assert values["paged_serve_kv_blocks_used"] == 0
    assert values['vllm:num_requests_running{model_name="smol"}'] == 0


async def _stream_through_sigterm(url: str, proc: subprocess.Popen) -> list[str]:
    """Start a long stream, SIGTERM the server after two frames, read the stream to its end."""
    body = {"prompt": "Once upon a time", "max_tokens": 256, "ignore_eos": True, "stream": True}
    frames: list[str] = []
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data: "):
                    frames.append(line[len("data: ") :].decode().strip())
                    if len(frames) == 2:
                        proc.send_signal(signal.SIGTERM)
    return frames


def test_sigterm_ends_streams_with_a_final_frame_and_exits_0(served: tuple[ServerProcess, str]):
    server, url = served
    frames = asyncio.run(_stream_through_sigterm(url, server.proc))
    assert frames[-1] == "[DONE]"
    final = json.loads(frames[-2])
    assert final["error"]["code"] == "request_aborted"
    assert "shutting down" in final["error"]["message"]
    assert len(frames) < 256
    assert server.proc.wait(timeout=30) == 0
    server.wait_for(re.compile("stopped"), 5.0)
    with pytest.raises(aiohttp.ClientConnectionError):
        http("GET", f"{url}/health")
