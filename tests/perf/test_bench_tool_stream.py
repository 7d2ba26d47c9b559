"""perf.serving.bench_tool_stream runs (a tiny case): the script the documented figures came
from."""

from __future__ import annotations

from perf.serving.bench_tool_stream import cases, stream_seconds


def test_every_case_streams_and_reports_seconds():
    for parser, text in cases(words=20).values():
        assert stream_seconds(parser, text, piece=5) > 0.0
