"""Two paged-serve replicas behind SGLang's model gateway (``sglang-router``, PyPI), run as its
users run it (``python -m sglang_router.launch_router --worker-urls A B --policy P``).

The traffic: ``GROUPS`` prompts that each open with their own ~150-token prefix (a system
prompt), sent ``ROUNDS`` times, each round all groups together. Each replica's KV cache holds
about four of the seven prefixes, so a replica that sees every group (round robin: an odd number
of groups makes each group alternate replicas by round) keeps evicting them, while one that
sees about half of them (cache-aware: a prompt goes where its prefix went) keeps its share. The
fleet's prefix-cache hit rate (hit tokens over queried tokens, summed over both replicas'
``vllm:prefix_cache_*`` counters) must be at least 1.5x round robin's on the same traffic, and
at least ``MIN_AWARE_HIT_RATE``.
Between the two policies the router's own ``POST /flush_cache`` empties both replicas' caches
(our ``/flush_cache``), and a fresh router starts with an empty routing tree. The fleet is keyed
as one across machines would be: the replicas and the router share ``--api-key``, clients send
it to the router (401 without), and the router sends it to the replicas."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server.conftest import http, metric_values
from tests.server.processes import READY, START_DEADLINE_S, ServerProcess

pytest.importorskip("sglang_router", reason="sglang-router is a test extra (x86_64 Linux)")

GROUPS = 7
ROUNDS = 3
KV_CACHE_BYTES = 32 << 20  # 45 blocks of 16 tokens in fp32 (--dtype below): about four prefixes
MIN_AWARE_HIT_RATE = 0.3  # of 3 rounds, 2 can hit a prefix of ~144 of ~160 tokens: ~0.6
ROUTER_DEADLINE_S = 30.0
STAGGER_S = 0.03  # between a round's sends: they reach the router in group order
KEY = "sk-fleet"
AUTH = {"Authorization": f"Bearer {KEY}"}
TOPICS = ("astronomy", "baking", "chess", "dentistry", "economics", "falconry", "geology")


def prompt(group: int, round_: int) -> str:
    topic = TOPICS[group]
    facts = " ".join(f"Fact {i} about {topic} is worth remembering." for i in range(14))
    return f"You are an expert on {topic}. {facts}\nQuestion {round_}: tell me more."


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Router:
    """An sglang-router process in front of ``workers`` with ``policy``."""

    def __init__(self, workers: list[str], policy: str):
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = tempfile.TemporaryFile("w+")  # a pipe nobody reads could fill and stall it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router"]
            + ["--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1]]
            + ["--worker-urls", *workers, "--policy", policy, "--api-key", KEY]
            + ["--log-level", "warn"],
            stdout=subprocess.DEVNULL,
            stderr=self.log,
        )
        end = time.monotonic() + ROUTER_DEADLINE_S
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > end:
                self.log.seek(0)
                log = self.log.read()
                self.stop()
                raise AssertionError(f"the router did not start:\n{log}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            return http("GET", f"{self.url}/v1/models", headers=AUTH).status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


def prefix_counters(url: str) -> tuple[float, float, float]:
    """(queried tokens, hit tokens, finished requests) on one replica, as vLLM names them."""
    values = metric_values(url)

    def total(name: str) -> float:
        return sum(v for k, v in values.items() if re.fullmatch(rf"{name}\{{.*\}}", k))

    return (
        total("vllm:prefix_cache_queries_total"),
        total("vllm:prefix_cache_hits_total"),
        total("vllm:request_success_total"),
    )


def send_traffic(router: Router, model: str) -> None:
    """Each round's requests together (each sent ``STAGGER_S`` after the one before, so round
    robin's choice depends on the group and round alone, while a prefill of ~150 tokens outlasts
    the gap and cache-aware routing sees the first ones in flight); every one must come back
    with its token."""

    def one(group: int, round_: int) -> None:
        body = {"model": model, "prompt": prompt(group, round_), "max_tokens": 1, "temperature": 0}
        reply = http("POST", f"{router.url}/v1/completions", json=body, headers=AUTH)
        assert reply.status == 200, reply.body
        assert json.loads(reply.body)["usage"]["completion_tokens"] == 1

    with ThreadPoolExecutor(GROUPS) as pool:
        for round_ in range(ROUNDS):
            futures = []
            for group in range(GROUPS):
                futures.append(pool.submit(one, group, round_))
                time.sleep(STAGGER_S)
            for future in futures:
                future.result()


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[str]]:
    args = ["--port", "0", "--kv-cache-memory", str(KV_CACHE_BYTES), "--max-model-len", "512"]
    args += ["--api-key", KEY, "--dtype", "float32"]  # the same block count on every CPU
    servers = [ServerProcess(args) for _ in range(2)]
    try:
        yield [s.wait_for(READY, START_DEADLINE_S)["url"] for s in servers]
    finally:
        for server in servers:
            server.stop()


def run_policy(replicas: list[str], policy: str) -> dict[str, tuple[float, float, float]]:
    """The traffic through a fresh router with ``policy``, from empty caches; per replica the
    (queried, hit, requests) it added."""
    router = Router(replicas, policy)
    try:
        flushed = http("POST", f"{router.url}/flush_cache", headers=AUTH)
        assert flushed.status == 200 and json.loads(flushed.body)["workers_flushed"] == 2
        before = {url: prefix_counters(url) for url in replicas}
        model = json.loads(http("GET", f"{replicas[0]}/v1/models", headers=AUTH).body)
        model = model["data"][0]["id"]
        body = {"model": model, "prompt": "Hi", "max_tokens": 1}
        assert http("POST", f"{router.url}/v1/completions", json=body).status == 401
        send_traffic(router, model)
    finally:
        router.stop()
    after = {url: prefix_counters(url) for url in replicas}
    return {url: tuple(a - b for a, b in zip(after[url], before[url])) for url in replicas}


def fleet_hit_rate(per_replica: dict[str, tuple[float, float, float]]) -> float:
    queried = sum(q for q, _, _ in per_replica.values())
    return sum(h for _, h, _ in per_replica.values()) / queried


def assert_replica_clean(url: str) -> None:
    """Idle, no block held, and the pool's own integrity check passes."""
    end = time.monotonic() + 10
    while True:
        state = json.loads(http("GET", f"{url}/v1/engine/state", headers=AUTH).body)["engine"]
        if state["kv"]["usage"]["used_blocks"] == 0 and not state["running"] or (
            time.monotonic() > end
        ):
            break
        time.sleep(0.2)
    assert state["kv"]["integrity"] == "ok"
    assert state["kv"]["usage"]["used_blocks"] == 0
    assert not state["running"] and not state["waiting"]
    assert json.loads(http("GET", f"{url}/get_load").body)[0]["num_reqs"] == 0


def test_cache_aware_routing_beats_round_robin_on_shared_prefixes(replicas: list[str]):
    cache_aware = run_policy(replicas, "cache_aware")
    round_robin = run_policy(replicas, "round_robin")
    for result in (cache_aware, round_robin):
        assert sum(r for _, _, r in result.values()) == GROUPS * ROUNDS  # every request served
        assert all(r > 0 for _, _, r in result.values())  # on both replicas
    aware, robin = fleet_hit_rate(cache_aware), fleet_hit_rate(round_robin)
    ratio = f"{aware / robin:.2f}" if robin else "inf"
    print(
        f"\nfleet prefix-cache hit rate: cache_aware {aware:.3f}, round_robin {robin:.3f}, "
        f"ratio {ratio}; requests per replica: "
        f"cache_aware {[int(r) for _, _, r in cache_aware.values()]}, "
        f"round_robin {[int(r) for _, _, r in round_robin.values()]}"
    )
    assert aware >= MIN_AWARE_HIT_RATE and aware >= 1.5 * robin
    for url in replicas:
        assert_replica_clean(url)
