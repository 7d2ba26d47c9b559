"""perf.engine.bench_e2e's pure parts: the speed goals, which systems the flags select, and the
ratios the report compares with the goal. Nothing here runs a model."""

from __future__ import annotations

import pytest
import torch

from perf.engine.bench_e2e import E2E_GOALS, chosen_systems, parse_args, speed_ratios
from perf.engine.e2e_workload import SystemResult, agreement


def test_speed_goals_are_pinned():
    # The documented targets (docs/measurements/engine-vs-hf.md, gpu.md); ci/gpu_check.py reports
    # against the GPU one.
    assert (E2E_GOALS.cuda, E2E_GOALS.cpu) == (3.0, 1.5)
    assert E2E_GOALS.for_device(torch.device("cuda", 0)) == 3.0
    assert E2E_GOALS.for_device(torch.device("cpu")) == 1.5


@pytest.mark.parametrize(
    "flags, systems",
    [
        ([], ["paged_serve", "hf_static", "hf_cb", "hf_generate_batch"]),
        (
            # ci/gpu-check.sh's e2e step
            ["--hf-batch-api", "generate_batch", "--compare-eager"],
            ["paged_serve", "paged_serve_eager", "hf_static", "hf_generate_batch"],
        ),
        (
            ["--enforce-eager", "--compare-eager", "--skip-hf-static"],
            ["paged_serve", "hf_cb", "hf_generate_batch"],
        ),
        (["--skip-hf-batch", "--hf-batch-api", "manager"], ["paged_serve", "hf_static"]),
        (["--hf-batch-api", "manager", "--skip-hf-static"], ["paged_serve", "hf_cb"]),
    ],
)
def test_flags_select_the_systems(flags: list[str], systems: list[str]):
    assert chosen_systems(parse_args(flags)) == systems


def _result(name: str, rate: float | None) -> SystemResult:
    return SystemResult(name, output_tokens_per_s=rate)


def test_speed_ratios_compare_with_the_best_hf_system():
    results = {
        "paged_serve": _result("paged_serve", 60.0),
        "paged_serve_eager": _result("paged_serve_eager", 50.0),
        "hf_static": _result("hf_static", 30.0),
        "hf_cb": _result("hf_cb", 40.0),
        "hf_generate_batch": _result("hf_generate_batch", None),  # failed: no rate
    }
    report = speed_ratios(results, goal=1.5)
    assert report["ratios"] == {
        "paged_serve/paged_serve_eager": 1.2,
        "paged_serve/hf_static": 2.0,
        "paged_serve/hf_cb": 1.5,
    }
    # the eager paged-serve run, faster than every HF system, is not a baseline
    assert report["target"] == {"paged_over_best_hf": 1.5, "goal": 1.5, "met": True}
    assert speed_ratios(results, goal=1.6)["target"]["met"] is False
    alone = speed_ratios({"paged_serve": _result("paged_serve", 60.0)}, goal=1.5)
    assert alone["target"] == {"paged_over_best_hf": None, "goal": 1.5, "met": False}


def test_agreement_is_the_common_prefix():
    report = agreement([[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 5]])
    assert report == {
        "requests": 2,
        "exact_requests": 1,
        "token_match_rate": 0.8,
        "first_divergence": {0: 2},
    }
