"""perf.serving.bench_grammar_isolation's pieces: the bodies it sends and the CPU it reads."""

from __future__ import annotations

import os

from perf.serving.bench_grammar_isolation import costly_bodies, tree_cpu_seconds


def test_the_bodies_carry_the_costly_constraints():
    bodies = costly_bodies("m", [3])
    schema = bodies["schema 3"]["response_format"]["json_schema"]["schema"]
    assert list(schema["properties"]) == ["p0", "p1", "p2"]
    assert bodies["fill grammar"]["structured_outputs"]["grammar"].count(" w") == 1000


def test_the_process_tree_cpu_is_read():
    assert tree_cpu_seconds(os.getpid()) > 0.0
