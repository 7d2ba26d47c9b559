"""Load test: concurrent streaming clients, a share of which hang up at random moments.

    python -m perf.serving.load_test [--num-requests 1000] [--concurrency 100]
        [--disconnect-fraction 0.3] [--min-tokens 8] [--max-tokens 16] [--kv-cache-memory BYTES]
        [--max-num-batched-tokens N] [--seed S] [--json FILE]
    python -m perf.serving.load_test --url http://127.0.0.1:8000 ...   # a server that is already up

Without ``--url`` it serves the default model in-process on a free 127.0.0.1 port, with a KV
pool small enough (``--kv-cache-memory``, 40 blocks by default) that requests get preempted,
and records the state each aborted request was in when its client hung up (queued, prefill,
decode, preempted). Traffic stays on loopback unless ``--url`` says otherwise.

Each client streams one request (completions 45 %, chat 45 %, responses 10 %), with a prompt
of a few, a dozen or about forty words and 8-16 output tokens; completions and chat use
``ignore_eos`` so a client that stays must end with ``finish_reason`` ``length`` and exactly
``max_tokens`` tokens. A ``--disconnect-fraction`` of the clients hang up: right after the
response headers (before any token), after a random number of token frames, or at the first
preemption the server reports (``paged_serve_preemptions_total``) after their first token.

It prints TTFT and end-to-end percentiles (clients that stayed), output tokens per second,
abort counts, the peak RSS of this process (the server too when in-process) and every broken
guarantee; it exits 1 if a client that stayed did not get a complete, well-formed stream or if
the server is not idle (no request live, ``paged_serve_kv_blocks_used`` 0) afterwards. The test
suite runs the same code on 100 clients (``tests/reliability/test_load.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import resource
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

ENDPOINTS = (("completions", 0.45), ("chat", 0.45), ("responses", 0.10))
PATHS = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
}
DISCONNECT_MODES = ("before_first_token", "after_tokens", "after_preemption")
PROMPT_WORDS = ((1, 8), (8, 20), (30, 45))  # short, medium and long prompts, in words
WORDS = (
    "the a river stone city light morning quiet engine paper window garden story number "
    "market winter letter mountain signal orange forest music table bridge cloud simple "
    "question silver answer travel history yellow machine ocean village summer basket"
).split()
# One 16-token block of the default model is 720 KiB (30 layers x 3 KV heads x 64 x fp32 x K,V):
# 40 blocks hold 640 tokens, a small fraction of what 100 concurrent clients ask for.
DEFAULT_KV_CACHE_BYTES = 40 * 737_280
DEFAULT_MAX_NUM_BATCHED_TOKENS = 256
MIN_TOKENS, MAX_TOKENS = 8, 16
METRICS_POLL_S = 0.05


# ------------------------------------------------------------------------------ the workload
@dataclass(frozen=True, slots=True)
class Plan:
    """One client's request and when (if ever) it hangs up."""

    index: int
    endpoint: str  # a key of PATHS
    prompt: str
    max_tokens: int
    temperature: float
    disconnect: str | None = None  # one of DISCONNECT_MODES
    disconnect_after: int = 0  # token frames to read first ("after_tokens")

    @property
    def path(self) -> str:
        return PATHS[self.endpoint]

    def body(self) -> dict[str, Any]:
        if self.endpoint == "responses":
            return {
                "input": self.prompt,
                "max_output_tokens": self.max_tokens,
                "temperature": self.temperature,
                "stream": True,
            }
        body: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        return body


def make_plans(
    num_requests: int,
    *,
    seed: int = 0,
    disconnect_fraction: float = 0.3,
    min_tokens: int = MIN_TOKENS,
    max_tokens: int = MAX_TOKENS,
) -> list[Plan]:
    """A reproducible mix of endpoints, prompt lengths, output lengths and disconnects.

    Exactly ``round(disconnect_fraction * num_requests)`` clients hang up, spread over the
    three modes in turn, so every mode is present once there are three of them.
    """
    rng = random.Random(seed)
    names = [name for name, _ in ENDPOINTS]
    weights = [w for _, w in ENDPOINTS]
    leaving = set(rng.sample(range(num_requests), round(disconnect_fraction * num_requests)))
    plans = []
    num_leaving = 0
    for i in range(num_requests):
        low, high = rng.choice(PROMPT_WORDS)
        words = [rng.choice(WORDS) for _ in range(rng.randint(low, high))]
        n_tokens = rng.randint(min_tokens, max_tokens)
        mode = None
        if i in leaving:
            mode = DISCONNECT_MODES[num_leaving % len(DISCONNECT_MODES)]
            num_leaving += 1
        plans.append(
            Plan(
                index=i,
                endpoint=rng.choices(names, weights)[0],
                prompt=" ".join(words).capitalize() + ".",
                max_tokens=n_tokens,
                temperature=rng.choice((0.0, 0.8)),
                disconnect=mode,
                disconnect_after=rng.randint(1, max(1, n_tokens - 2)),
            )
        )
    return plans


# ------------------------------------------------------------------------------ one client
@dataclass(slots=True)
class Outcome:
    """What one client saw. ``finish`` is the finish_reason (completions, chat) or the final
    status (responses: ``completed`` / ``incomplete``)."""

    plan: Plan
    status: int = 0
    token_frames: int = 0  # frames that carried generated text
    text: str = ""
    finish: str | None = None
    completion_tokens: int | None = None
    error: str | None = None  # an error frame's code, or a client-side failure
    disconnected: bool = False  # the client hung up on purpose before the end
    ttft: float | None = None  # seconds from sending the request to the first generated text
    e2e: float | None = None  # seconds from sending the request to the end of the stream


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[str | None, str]]:
    """``(event, data)`` for each server-sent event of ``resp``."""
    event = None
    async for raw in resp.content:
        line = raw.decode().rstrip("\r\n")
        if line.startswith("event: "):
            event = line[len("event: ") :]
        elif line.startswith("data: "):
            yield event, line[len("data: ") :]
            event = None


def _apply_event(out: Outcome, event: str | None, data: str) -> tuple[bool, bool]:
    """Fold one event into ``out``; returns (carried generated text, the stream is over)."""
    if data == "[DONE]":
        return False, True
    obj = json.loads(data)
    if event == "error" or "error" in obj:
        error = obj.get("error", obj)
        out.error = str(error.get("code") or error.get("message"))
        return False, event == "error"  # chat/completions still send [DONE]
    if out.plan.endpoint == "responses":
        if event == "response.output_text.delta":
            out.text += obj["delta"]
            return True, False
        if event in ("response.completed", "response.incomplete"):
            response = obj["response"]
            out.finish = response["status"]
            out.completion_tokens = response["usage"]["output_tokens"]
            return False, True
        return False, False
    if obj.get("usage"):
        out.completion_tokens = obj["usage"]["completion_tokens"]
    carried = False
    for choice in obj["choices"]:
        text = (
            choice["text"] if out.plan.endpoint == "completions" else choice["delta"].get("content")
        )
        if text:
            out.text += text
            carried = True
        if choice["finish_reason"]:
            out.finish = choice["finish_reason"]
            carried = True
    return carried, False


async def run_client(
    session: aiohttp.ClientSession,
    base_url: str,
    plan: Plan,
    watch: PreemptionWatch,
) -> Outcome:
    """Stream ``plan``'s request, hanging up as planned."""
    out = Outcome(plan)
    start = time.perf_counter()
    async with session.post(base_url + plan.path, json=plan.body()) as resp:
        out.status = resp.status
        if resp.status != 200:
            body = await resp.read()
            try:
                out.error = str(json.loads(body)["error"]["code"] or resp.status)
            except (ValueError, KeyError, TypeError):
                out.error = f"HTTP {resp.status}: {body[:200]!r}"
            return out
        if plan.disconnect == "before_first_token":
            out.disconnected = True
            resp.close()  # hang up before reading a single frame
            return out
        events = sse_events(resp)
        next_event: asyncio.Future = asyncio.ensure_future(anext(events))
        preempted: asyncio.Future | None = None
        try:
            while True:
                waiting = {next_event} if preempted is None else {next_event, preempted}
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if preempted in done and next_event not in done:
                    out.disconnected = True
                    break
                try:
                    event, data = next_event.result()
                except StopAsyncIteration:
                    break
                carried, over = _apply_event(out, event, data)
                if carried:
                    out.token_frames += 1
                    if out.ttft is None:
                        out.ttft = time.perf_counter() - start
                if over:
                    out.e2e = time.perf_counter() - start
                    break
                if plan.disconnect == "after_tokens" and out.token_frames >= plan.disconnect_after:
                    out.disconnected = True
                    break
                if plan.disconnect == "after_preemption" and carried and preempted is None:
                    preempted = asyncio.ensure_future(watch.wait_beyond(watch.count))
                next_event = asyncio.ensure_future(anext(events))
        finally:
            pending = {t for t in (next_event, preempted) if t is not None and not t.done()}
            for task in pending:
                task.cancel()
            if pending:  # let the cancelled read leave the generator before closing it
                await asyncio.wait(pending)
            if out.disconnected:
                resp.close()  # drop the connection mid-stream
            await events.aclose()
    return out


# ------------------------------------------------------------------------------ the server
async def fetch_metrics(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    """``/metrics`` samples by name (labels included in the name)."""
    async with session.get(f"{base_url}/metrics") as resp:
        text = await resp.text()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


class PreemptionWatch:
    """Polls ``paged_serve_preemptions_total``; clients wait for it to pass a value."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str):
        self.session = session
        self.base_url = base_url
        self.count = 0
        self._changed = asyncio.Event()

    async def run(self) -> None:
        """Poll until cancelled."""
        while True:
            metrics = await fetch_metrics(self.session, self.base_url)
            count = int(metrics["paged_serve_preemptions_total"])
            if count != self.count:
                self.count = count
                self._changed.set()
                self._changed = asyncio.Event()
            await asyncio.sleep(METRICS_POLL_S)

    async def wait_beyond(self, count: int) -> None:
        while self.count <= count:
            await self._changed.wait()


async def wait_idle(base_url: str, deadline_s: float = 30.0) -> dict[str, float]:
    """Poll ``/metrics`` (bounded) until no request is live and no KV block is used."""
    end = time.monotonic() + deadline_s
    async with aiohttp.ClientSession() as session:
        while True:
            m = await fetch_metrics(session, base_url)
            live = m["paged_serve_requests_running"] + m["paged_serve_requests_waiting"]
            if live == 0 and m["paged_serve_kv_blocks_used"] == 0:
                return m
            if time.monotonic() > end:
                raise TimeoutError(f"the server is not idle after {deadline_s} s: {m}")
            await asyncio.sleep(METRICS_POLL_S)


@dataclass(slots=True)
class LoadResult:
    outcomes: list[Outcome]
    wall_s: float
    before: dict[str, float]  # /metrics before and after (once idle)
    after: dict[str, float]

    def delta(self, name: str) -> float:
        return self.after[name] - self.before[name]


async def run_load(
    base_url: str, plans: Sequence[Plan], *, concurrency: int, timeout_s: float = 120.0
) -> LoadResult:
    """Run every plan, at most ``concurrency`` at a time, each bounded by ``timeout_s``."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with (
        aiohttp.ClientSession(timeout=timeout, connector=connector) as session,
        aiohttp.ClientSession(timeout=timeout) as metrics_session,
    ):
        before = await fetch_metrics(metrics_session, base_url)
        watch = PreemptionWatch(metrics_session, base_url)
        watch.count = int(before["paged_serve_preemptions_total"])
        watcher = asyncio.create_task(watch.run())
        gate = asyncio.Semaphore(concurrency)

        async def one(plan: Plan) -> Outcome:
            async with gate:
                try:
                    return await asyncio.wait_for(
                        run_client(session, base_url, plan, watch), timeout_s
                    )
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                    return Outcome(plan, error=f"client: {exc!r}")

        start = time.perf_counter()
        try:
            outcomes = await asyncio.gather(*(one(p) for p in plans))
        finally:
            watcher.cancel()
        wall = time.perf_counter() - start
    after = await wait_idle(base_url)
    return LoadResult(list(outcomes), wall, before, after)


def broken_guarantees(outcomes: Sequence[Outcome]) -> list[str]:
    """Every client that did not hang up got a complete stream with the right ending."""
    problems = []
    for o in outcomes:
        p = o.plan
        if o.disconnected:
            continue
        who = f"request {p.index} ({p.endpoint}, max_tokens {p.max_tokens})"
        if o.status != 200 or o.error:
            problems.append(f"{who}: status {o.status}, error {o.error}")
        elif p.endpoint == "responses":
            ok = (o.finish == "incomplete" and o.completion_tokens == p.max_tokens) or (
                o.finish == "completed" and 1 <= (o.completion_tokens or 0) <= p.max_tokens
            )
            if not ok:
                problems.append(f"{who}: ended {o.finish} after {o.completion_tokens} tokens")
        elif o.finish != "length" or o.completion_tokens != p.max_tokens:
            problems.append(f"{who}: finish_reason {o.finish}, {o.completion_tokens} tokens")
    return problems


# ------------------------------------------------------------------------------ in-process
class AbortRecorder:
    """Records the state a request was in when the engine aborted it (in-process servers).

    Wraps ``LLMEngine.abort`` of one engine; the wrapper runs on the engine thread between
    steps, so the state it reads is consistent. States: ``queued`` (never scheduled),
    ``prefill`` (prompt, or prompt plus outputs after a preemption, not fully computed),
    ``decode``, ``preempted`` (sent back to the waiting queue).
    """

    def __init__(self, llm_engine: Any):
        self.llm_engine = llm_engine
        self.states: Counter[str] = Counter()
        self._real = llm_engine.abort
        llm_engine.abort = self._abort

    def close(self) -> None:
        del self.llm_engine.abort

    def _abort(self, request_id: str) -> Any:
        from paged_serve.engine.sched.request import RequestStatus

        scheduler = self.llm_engine.scheduler
        live = [*scheduler.running, *scheduler.waiting]
        request = next((r for r in live if r.request_id == request_id), None)
        if request is not None:
            if request.status is RequestStatus.WAITING:
                state = "preempted" if request.num_preemptions else "queued"
            elif request.num_computed_tokens < request.num_tokens - 1:
                state = "prefill"
            else:
                state = "decode"
            self.states[state] += 1
        return self._real(request_id)


class InProcessServer:
    """paged-serve on a free 127.0.0.1 port, its event loop in a daemon thread."""

    def __init__(self, engine_kwargs: dict[str, Any]):
        from paged_serve.engine.async_engine import AsyncEngine
        from paged_serve.engine.config import EngineConfig

        self.engine = AsyncEngine(EngineConfig(**engine_kwargs))
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._runner = None
        port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=60)
        self.url = f"http://127.0.0.1:{port}"

    async def _start(self) -> int:
        from aiohttp import web

        from paged_serve.server.app import create_app, make_runner

        self._runner = make_runner(create_app(self.engine))
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        return self._runner.addresses[0][1]

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.engine.shutdown()


# ------------------------------------------------------------------------------ the report
def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass(slots=True)
class Summary:
    requests: int
    stayed: int
    disconnected: int
    disconnects_by_mode: dict[str, int]
    aborts_by_engine_state: dict[str, int]
    preemptions: int
    wall_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    output_tokens_per_s: float  # tokens of clients that stayed / wall time
    generated_tokens_per_s: float  # every generated token (server counter) / wall time
    requests_per_s: float
    peak_rss_mib: float
    kv_blocks_used_after: float
    problems: list[str] = field(default_factory=list)


def summarize(result: LoadResult, aborts: Counter[str] | None) -> Summary:
    outs = result.outcomes
    stayed = [o for o in outs if not o.disconnected]
    return Summary(
        requests=len(outs),
        stayed=len(stayed),
        disconnected=len(outs) - len(stayed),
        disconnects_by_mode=dict(Counter(o.plan.disconnect for o in outs if o.disconnected)),
        aborts_by_engine_state=dict(aborts or {}),
        preemptions=int(result.delta("paged_serve_preemptions_total")),
        wall_s=result.wall_s,
        ttft_p50_s=percentile([o.ttft for o in stayed if o.ttft is not None], 50),
        ttft_p99_s=percentile([o.ttft for o in stayed if o.ttft is not None], 99),
        e2e_p50_s=percentile([o.e2e for o in stayed if o.e2e is not None], 50),
        e2e_p99_s=percentile([o.e2e for o in stayed if o.e2e is not None], 99),
        output_tokens_per_s=sum(o.completion_tokens or 0 for o in stayed) / result.wall_s,
        generated_tokens_per_s=result.delta("paged_serve_generation_tokens_total") / result.wall_s,
        requests_per_s=len(stayed) / result.wall_s,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        kv_blocks_used_after=result.after["paged_serve_kv_blocks_used"],
        problems=broken_guarantees(outs),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m perf.serving.load_test", description=__doc__)
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--disconnect-fraction", type=float, default=0.3)
    parser.add_argument("--min-tokens", type=int, default=MIN_TOKENS)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--kv-cache-memory", type=int, default=DEFAULT_KV_CACHE_BYTES)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS
    )
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--json", default=None, help="also write the summary to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    plans = make_plans(
        args.num_requests,
        seed=args.seed,
        disconnect_fraction=args.disconnect_fraction,
        min_tokens=args.min_tokens,
        max_tokens=args.max_tokens,
    )
    server = recorder = None
    url = args.url.rstrip("/") if args.url else None
    if url is None:
        server = InProcessServer(
            {
                "kv_cache_memory": args.kv_cache_memory,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "max_num_seqs": args.max_num_seqs,
            }
        )
        url = server.url
        recorder = AbortRecorder(server.engine.engine)
    try:
        result = asyncio.run(
            run_load(url, plans, concurrency=args.concurrency, timeout_s=args.timeout)
        )
        summary = summarize(result, recorder.states if recorder else None)
        if server is not None:
            server.engine.check_integrity()
    finally:
        if server is not None:
            server.close()
    report = asdict(summary)
    report["where"] = "in-process server (RSS includes it)" if args.url is None else url
    for key, value in report.items():
        if key != "problems":
            print(f"{key:24} {round(value, 3) if isinstance(value, float) else value}")
    for problem in summary.problems:
        print(f"BROKEN: {problem}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 1 if summary.problems or summary.kv_blocks_used_after else 0


if __name__ == "__main__":
    sys.exit(main())
