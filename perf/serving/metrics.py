"""The serving metrics of ``perf.serving.bench_serving``, computed as vLLM's ``bench serve`` does.

From the client's records of one timed run (``perf.serving.client.RequestRecord``):

* output throughput: the output tokens the server reported in ``usage``, summed over the
  completed requests, per second of the run's wall time (first send to last end); request
  throughput likewise in requests per second;
* TTFT: from sending a request to the arrival of its first chunk with text, ms;
* ITL (inter-token latency): the gaps between consecutive text chunks of a request, pooled
  over all requests, ms;
* TPOT (time per output token): per request ``(e2e - ttft) / (output_tokens - 1)``, ms;
* E2E latency: from sending a request to the end of its stream, ms.

Each is given as mean, p50 and p99 (linear interpolation between order statistics, numpy's
default). ``markdown_table`` renders several runs side by side; ``median_table`` gives each
system and workload's median over repeated runs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from perf.serving.client import RequestRecord


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation; ``None`` for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def distribution_ms(seconds: Sequence[float]) -> dict[str, float | None]:
    """Mean, p50 and p99 of ``seconds``, in milliseconds."""
    ms = [s * 1000 for s in seconds]

    def rounded(x: float | None) -> float | None:
        return None if x is None else round(x, 2)

    return {
        "mean": rounded(sum(ms) / len(ms) if ms else None),
        "p50": rounded(percentile(ms, 50)),
        "p99": rounded(percentile(ms, 99)),
    }


def ttft(record: RequestRecord) -> float | None:
    """Seconds from sending to the first text chunk."""
    return record.chunk_times[0] - record.start if record.chunk_times else None


def inter_token_gaps(record: RequestRecord) -> list[float]:
    """Seconds between consecutive text chunks."""
    t = record.chunk_times
    return [b - a for a, b in zip(t, t[1:])]


def tpot(record: RequestRecord) -> float | None:
    """Seconds per output token after the first: ``(e2e - ttft) / (tokens - 1)``."""
    first = ttft(record)
    n = record.completion_tokens
    if first is None or record.end is None or not n or n < 2:
        return None
    return (record.end - record.start - first) / (n - 1)


def summarize(records: Sequence[RequestRecord], wall_s: float) -> dict[str, Any]:
    """The run's metrics; ``short_requests`` counts completed requests whose reported output
    is not their ``max_tokens`` (every mix ignores EOS, so there should be none)."""
    done = [r for r in records if r.ok]
    output_tokens = sum(r.completion_tokens or 0 for r in done)
    first = [x for x in map(ttft, done) if x is not None]
    per_token = [x for x in map(tpot, done) if x is not None]
    gaps = [g for r in done for g in inter_token_gaps(r)]
    return {
        "wall_s": round(wall_s, 3),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:3],
        "short_requests": sum(r.completion_tokens != r.max_tokens for r in done),
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in done),
        "output_tokens": output_tokens,
        "output_tok_s": round(output_tokens / wall_s, 2) if wall_s > 0 else None,
        "request_s": round(len(done) / wall_s, 3) if wall_s > 0 else None,
        "ttft_ms": distribution_ms(first),
        "tpot_ms": distribution_ms(per_token),
        "itl_ms": distribution_ms(gaps),
        "e2e_ms": distribution_ms([r.end - r.start for r in done if r.end is not None]),
    }


COLUMNS = (
    ("system", lambda r: r["system"]),
    ("workload", lambda r: r["workload"]),
    ("out tok/s", lambda r: r["metrics"]["output_tok_s"]),
    ("req/s", lambda r: r["metrics"]["request_s"]),
    ("TTFT p50 ms", lambda r: r["metrics"]["ttft_ms"]["p50"]),
    ("TTFT p99 ms", lambda r: r["metrics"]["ttft_ms"]["p99"]),
    ("ITL p50 ms", lambda r: r["metrics"]["itl_ms"]["p50"]),
    ("ITL p99 ms", lambda r: r["metrics"]["itl_ms"]["p99"]),
    ("TPOT p50 ms", lambda r: r["metrics"]["tpot_ms"]["p50"]),
    ("E2E p50 ms", lambda r: r["metrics"]["e2e_ms"]["p50"]),
    ("E2E p99 ms", lambda r: r["metrics"]["e2e_ms"]["p99"]),
    ("done/failed", lambda r: f"{r['metrics']['completed']}/{r['metrics']['failed']}"),
    ("check", lambda r: r.get("check_summary", "")),
)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"
    return str(value)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per timed run: ``rows`` hold ``system``, ``workload``, ``metrics`` (from
    ``summarize``) and optionally ``check_summary``."""
    lines = [
        "| " + " | ".join(name for name, _ in COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(_cell(get(row)) for _, get in COLUMNS) + " |")
    return "\n".join(lines)


# The columns of ``COLUMNS`` that ``median_table`` takes medians of.
MEDIAN_COLUMNS = ("out tok/s", "TTFT p50 ms", "ITL p50 ms", "E2E p50 ms")


def median_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per system and workload (in the order first seen): the median of each metric
    over its runs, and the runs' output tok/s. A metric missing from a run (no completed
    request) is left out of its median."""
    column = dict(COLUMNS)
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["system"], row["workload"]), []).append(row)
    names = [f"median {name}" for name in MEDIAN_COLUMNS]
    lines = [
        "| system | workload | runs | " + " | ".join(names) + " | runs' out tok/s |",
        "|" + "|".join("---" for _ in range(len(names) + 4)) + "|",
    ]
    for (system, workload), runs in groups.items():
        medians = []
        for name in MEDIAN_COLUMNS:
            values = [v for v in map(column[name], runs) if v is not None]
            medians.append(statistics.median(values) if values else None)
        each = ", ".join(_cell(column["out tok/s"](r)) for r in runs)
        cells = [system, workload, str(len(runs)), *map(_cell, medians), each]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
