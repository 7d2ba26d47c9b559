"""A costly output constraint is refused within its budget and never starves the others.

Issue 31 item 1: an object schema of N optional ``{}`` properties compiles in about N^2.3 time
(a 20 KB body: 25-39 CPU-seconds on main ``efb1aa5``, on 8 compiler threads), identical requests
compiled twice, a client that hung up did not stop its compile, and nothing bounded the queue.
``engine/grammar/compiles.py`` compiles one constraint at a time, first in the probe process of
``engine/grammar/probe.py`` under a CPU, memory and mask-fill budget, merges identical ones,
drops or kills what nobody waits for, and refuses a full queue.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

import pytest

from paged_serve.engine.errors import InvalidRequestError
from paged_serve.engine.grammar.compiles import CompileQueueFullError, GrammarCompiles
from paged_serve.engine.grammar.json_schema_rules import MAX_OBJECT_PROPERTIES
from paged_serve.engine.grammar.probe import PROBE_NICE, ProbeBudget
from paged_serve.engine.grammar.structured_output import (
    COMPILE_THREADS,
    GrammarCompiler,
    StructuredOutput,
)
from tests.reliability.conftest import (
    arequest,
    assert_error_object,
    request,
    serve_engine,
    stop_server,
)

SLOW_GRAMMAR = "root ::= " + " ".join(["w"] * 1000) + '\nw ::= [^"]*\n'


def optional_properties(n: int, tag: str = "p") -> dict:
    """An object schema of ``n`` optional properties of any value: about N^2.3 to compile
    (1,000 of them: seconds)."""
    return {
        "type": "object",
        "properties": {f"{tag}{i}": {} for i in range(n)},
        "additionalProperties": False,
    }


def schema_constraint(n: int, tag: str = "p") -> StructuredOutput:
    return StructuredOutput.json_schema(optional_properties(n, tag))


SMALL = StructuredOutput("choice", choices=("yes", "no"))


class Counting:
    """Counts the calls of one method of an object, passing them on."""

    def __init__(self, target: object, name: str):
        self.calls = 0
        inner = getattr(target, name)

        def counted(*args: object) -> object:
            self.calls += 1
            return inner(*args)

        setattr(target, name, counted)


def compile_queue(
    tokenizer, cpu_s: float, memory_bytes: int = 1 << 30, max_pending: int = 2
) -> GrammarCompiles:
    """A queue of ``max_pending`` compiles whose probe may spend ``cpu_s`` CPU-seconds and
    ``memory_bytes`` on one, and 0.1 s on a mask fill."""
    grammars = GrammarCompiler(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[2])
    budget = ProbeBudget(cpu_s=cpu_s, memory_bytes=memory_bytes, fill_s=0.1)
    return GrammarCompiles(grammars, budget, max_pending=max_pending)


@pytest.fixture
def compiles(default_tokenizer) -> GrammarCompiles:
    """One CPU-second per compile, which the ``MAX_OBJECT_PROPERTIES``-property schema
    (1,024) exceeds."""
    queue = compile_queue(default_tokenizer, cpu_s=1.0)
    yield queue
    queue.close()


@pytest.fixture
def roomy_compiles(default_tokenizer) -> GrammarCompiles:
    """Sixty CPU-seconds per compile, for tests whose 300-property schemas must compile: one
    took more than 1 CPU-second on a slow CI machine."""
    queue = compile_queue(default_tokenizer, cpu_s=60.0)
    yield queue
    queue.close()


def probe_pid(compiles: GrammarCompiles) -> int | None:
    proc = compiles.probe._proc
    return None if proc is None or proc.poll() is not None else proc.pid


def test_identical_constraints_in_flight_compile_once(roomy_compiles):
    compiles = roomy_compiles
    constraint = schema_constraint(300)
    probed = Counting(compiles.probe, "check")
    compiled = Counting(compiles.grammars, "compile")

    async def four() -> None:
        await asyncio.gather(*(compiles.compile(constraint) for _ in range(4)))

    asyncio.run(four())
    assert (probed.calls, compiled.calls) == (1, 1)
    assert compiles.grammars.is_cached(constraint)
    asyncio.run(compiles.compile(constraint))  # cached: nothing more
    assert probed.calls == 1


def test_a_constraint_past_the_cpu_budget_is_refused_and_remembered(compiles):
    costly = schema_constraint(MAX_OBJECT_PROPERTIES)
    probed = Counting(compiles.probe, "check")
    start = time.process_time()
    with pytest.raises(InvalidRequestError, match="more than 1 CPU-seconds"):
        asyncio.run(compiles.compile(costly))
    assert time.process_time() - start < 1.0  # the server's own threads did not compile it
    with pytest.raises(InvalidRequestError, match="too complex"):
        asyncio.run(compiles.compile(costly))  # a repeat is refused without a probe
    assert probed.calls == 1 and not compiles.grammars.is_cached(costly)
    asyncio.run(compiles.compile(SMALL))  # a new probe serves the next constraint
    assert compiles.grammars.is_cached(SMALL)


def test_a_constraint_past_the_memory_budget_is_refused(default_tokenizer):
    queue = compile_queue(default_tokenizer, cpu_s=60.0, memory_bytes=4 << 20)
    try:
        with pytest.raises(InvalidRequestError, match="more than 4 MiB of memory"):
            asyncio.run(queue.compile(schema_constraint(MAX_OBJECT_PROPERTIES)))
    finally:
        queue.close()


def test_a_grammar_whose_mask_fill_grows_is_refused_up_front(compiles):
    with pytest.raises(InvalidRequestError, match="token mask took .* ms to compute after"):
        asyncio.run(compiles.compile(StructuredOutput("grammar", SLOW_GRAMMAR)))


def test_the_last_waiter_leaving_kills_the_probe(compiles):
    asyncio.run(compiles.compile(SMALL))  # the probe is up
    pid = probe_pid(compiles)
    assert pid is not None
    costly = schema_constraint(MAX_OBJECT_PROPERTIES, tag="gone")
    probed = threading.Event()
    check = compiles.probe.check

    def flagged(*args: object) -> None:
        probed.set()
        check(*args)

    compiles.probe.check = flagged

    async def hang_up() -> None:
        task = asyncio.ensure_future(compiles.compile(costly))
        await asyncio.to_thread(probed.wait, 10)
        await asyncio.sleep(0.2)  # compiling in the probe now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(hang_up())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.02)
    assert not _alive(pid)
    assert not compiles._jobs and not compiles.grammars.is_cached(costly)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_full_queue_is_refused_and_identical_ones_still_join(roomy_compiles):
    compiles = roomy_compiles
    first, second, third = (schema_constraint(300, tag=t) for t in "abc")

    async def three() -> list[object]:
        tasks = [asyncio.ensure_future(compiles.compile(c)) for c in (first, second)]
        await asyncio.sleep(0)
        with pytest.raises(CompileQueueFullError, match="limit 2"):
            await compiles.compile(third)
        return await asyncio.gather(*tasks, compiles.compile(first))

    assert asyncio.run(three()) == [None, None, None]


def test_the_probe_runs_below_the_engine_and_xgrammar_on_one_thread(compiles):
    asyncio.run(compiles.compile(SMALL))
    pid = probe_pid(compiles)
    assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0) + PROBE_NICE
    assert COMPILE_THREADS == 1


def test_the_server_refuses_a_costly_schema_with_400_and_a_full_queue_with_503(
    server_thread, default_model
):
    local = serve_engine(
        server_thread,
        default_model,
        kv_cache_memory=32 << 20,
        grammar_compile_timeout_s=1.0,
        max_pending_grammar_compiles=1,
    )
    url = f"{local.url}/v1/chat/completions"

    def body(schema: dict) -> dict:
        return {
            "model": default_model.name,
            "messages": [{"role": "user", "content": "Fill the form."}],
            "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
        }

    async def together() -> list:
        costly = arequest("POST", url, json=body(optional_properties(MAX_OBJECT_PROPERTIES)))
        task = asyncio.ensure_future(costly)
        await asyncio.sleep(0.5)  # compiling now: the queue is full
        other = await arequest("POST", url, json=body(optional_properties(600, "q")))
        plain = await arequest(
            "POST",
            url,
            json={
                "model": default_model.name,
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
            },
        )
        return [await task, other, plain]

    try:
        costly, other, plain = asyncio.run(together())
        error = assert_error_object(costly, 400, param="response_format")
        assert "too complex" in error["message"]
        assert_error_object(other, 503, code="queue_full")
        assert plain.status == 200
        later = request("POST", url, json=body(optional_properties(3, "r")))
        assert later.status == 200
    finally:
        stop_server(server_thread, local)


def test_lines_a_library_prints_on_the_probes_stdout_are_not_answers(compiles):
    """Text on the probe's stdout before it takes stdout over (a library's print, a stray JSON
    line) is skipped; its answers still come through."""
    noisy = (
        "import runpy, sys; print('a library says hello'); print('{\"not\": \"an answer\"}'); "
        "sys.argv = ['probe', *sys.argv[1:]]; "
        "runpy.run_module('paged_serve.engine.grammar.probe', run_name='__main__')"
    )
    compiles.probe.command = [sys.executable, "-c", noisy]
    asyncio.run(compiles.compile(SMALL))
    assert compiles.grammars.is_cached(SMALL)
    with pytest.raises(InvalidRequestError, match="does not exist|invalid"):
        asyncio.run(compiles.compile(StructuredOutput("grammar", "root ::= missing")))


def test_closing_answers_every_waiter(default_tokenizer):
    """A compile queued behind another when the engine shuts down: its waiter gets an error
    at once rather than a future nobody will settle."""
    queue = compile_queue(default_tokenizer, cpu_s=60.0, max_pending=4)

    async def shut_down_while_waiting() -> list[object]:
        tasks = [
            asyncio.ensure_future(queue.compile(schema_constraint(MAX_OBJECT_PROPERTIES, t)))
            for t in "xy"
        ]
        await asyncio.sleep(0.5)
        queue.close()
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)

    results = asyncio.run(shut_down_while_waiting())
    assert all(isinstance(r, RuntimeError) and "shutting down" in str(r) for r in results)
