"""perf.engine.bench_logit_adjustments runs (a tiny case): the script the documented figures
came from."""

from __future__ import annotations

import torch

from perf.engine.bench_logit_adjustments import time_case


def test_time_case_runs_and_reports_milliseconds():
    ms = time_case(rows=3, prompt=20, vocab=64, device=torch.device("cpu"), repeats=2)
    assert ms > 0.0
