"""How much one costly output constraint slows a plain request beside it, on a running server.

    python -m perf.serving.bench_grammar_isolation --url http://127.0.0.1:8000 [--pid PID]

Cases (each a chat request with ``max_tokens`` 8 for the plain one):

* ``schema N``: ``response_format`` with an object schema of N optional ``{}`` properties and
  ``additionalProperties: false`` (about N^2.3 to compile; 1,000 is a 12 KB body);
* ``fill grammar``: ``structured_outputs.grammar`` = ``root ::= w w ... w`` (1,000 times) with
  ``w ::= [^"]*``, whose mask fill grows with every token, ``max_tokens`` 32.

For each case it prints the costly request's status and seconds, the CPU-seconds the server
(with its child processes) spent meanwhile when ``--pid`` is given, the plain request's median
seconds alone and beside the costly one, and their ratio (the stall).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

FILL_GRAMMAR = "root ::= " + " ".join(["w"] * 1000) + '\nw ::= [^"]*\n'


def post(url: str, body: dict, timeout: float) -> tuple[int, float]:
    """(status, seconds) of one JSON POST."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        exc.read()
        status = exc.code
    return status, time.perf_counter() - start


def chat(model: str, **fields: object) -> dict:
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    return {"model": model, "messages": messages, "temperature": 0.0, **fields}


def costly_bodies(model: str, sizes: list[int]) -> dict[str, dict]:
    bodies = {}
    for n in sizes:
        schema = {
            "type": "object",
            "properties": {f"p{i}": {} for i in range(n)},
            "additionalProperties": False,
        }
        fmt = {"type": "json_schema", "json_schema": {"name": "form", "schema": schema}}
        bodies[f"schema {n}"] = chat(model, max_tokens=8, response_format=fmt)
    bodies["fill grammar"] = chat(
        model, max_tokens=32, temperature=1.0, structured_outputs={"grammar": FILL_GRAMMAR}
    )
    return bodies


def _stat_ticks(pid: int, count: int) -> int:
    """The sum of ``count`` CPU fields of /proc/<pid>/stat from utime on (clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11 : 11 + count])


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid``, its reaped children and its live children (Linux /proc)."""
    children = {
        int(c)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for c in (task / "children").read_text().split()
    }
    ticks = _stat_ticks(pid, 4) + sum(_stat_ticks(c, 2) for c in children)
    return ticks / os.sysconf("SC_CLK_TCK")


def plain_seconds(url: str, model: str, runs: int, timeout: float) -> list[float]:
    return [post(url, chat(model, max_tokens=8), timeout)[1] for _ in range(runs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--pid", type=int, default=None, help="the server's process id")
    parser.add_argument("--sizes", type=int, nargs="*", default=[1000])
    parser.add_argument("--runs", type=int, default=3, help="plain requests per measurement")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    url = f"{args.url}/v1/chat/completions"
    plain_seconds(url, args.model, 3, args.timeout)  # warm up
    alone = statistics.median(plain_seconds(url, args.model, args.runs, args.timeout))
    print(f"plain alone: {alone:.3f} s (median of {args.runs})")
    for name, body in costly_bodies(args.model, args.sizes).items():
        cpu0 = tree_cpu_seconds(args.pid) if args.pid else None
        result: list[tuple[int, float]] = []

        def send(body: dict = body, result: list = result) -> None:
            result.append(post(url, body, args.timeout))

        costly = threading.Thread(target=send)
        costly.start()
        time.sleep(0.2)
        beside = statistics.median(plain_seconds(url, args.model, args.runs, args.timeout))
        costly.join()
        status, seconds = result[0]
        cpu = f"{tree_cpu_seconds(args.pid) - cpu0:7.2f}" if cpu0 is not None else "      -"
        print(
            f"{name:14s} status {status}  {seconds:7.2f} s  server CPU {cpu} s  "
            f"plain beside {beside:6.3f} s  stall x{beside / alone:5.1f}"
        )


if __name__ == "__main__":
    main()
