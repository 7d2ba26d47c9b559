"""pytest configuration for ``perf/``: GPU microbenchmarks that run only where CUDA is present.

``pytest perf/`` collects the kernel benchmarks of ``perf/kernels/`` (``test_*.py``). Without a
CUDA device it collects nothing (so a benchmark module that needs Triton or a GPU at import time
cannot turn into a collection error) and says why in the header and the summary; pytest then
exits with code 5, "no tests collected". The other folders (``cpu/``, ``engine/``,
``serving/``) hold command-line programs (``python -m perf.engine.bench_e2e``, ``python -m
perf.serving.load_test``) and are never collected as tests. With ``TRITON_INTERPRET=1`` set the
benchmarks are skipped the same way: timing the interpreter would be meaningless.

With CUDA, this file also provides the benchmarks' shared pieces:

* ``copy_bandwidth_gbps`` (session): the device's copy bandwidth, measured once with a large
  device-to-device copy; every GB/s figure is also reported as a percentage of it.
* ``perf_report`` (session): the :class:`perf.kernels.report.PerfReport` the benchmarks add rows
  to; it is printed as a compact table at the end of the session and written as JSON to the file
  named by ``$PAGED_SERVE_PERF_JSON`` if set.
* a stand-in ``benchmark`` fixture (``extra_info`` + ``pedantic``) when pytest-benchmark is not
  installed, so the figures and the table still come out.
* memory hygiene: CUDA memory is released after every benchmark (some allocate tens of GB).
* ordering: the cases with targets (``perf.kernels.report.Target``) run first.
"""

from __future__ import annotations

import gc
import importlib.util
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from perf.kernels.report import PerfReport

SKIP_REASON = "perf/: no CUDA device, GPU benchmarks skipped"
INTERPRET_SKIP_REASON = "perf/: TRITON_INTERPRET=1 is set, GPU benchmarks skipped"
PERF_JSON_ENV = "PAGED_SERVE_PERF_JSON"


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


CUDA_AVAILABLE = _cuda_available()
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
HAS_PYTEST_BENCHMARK = importlib.util.find_spec("pytest_benchmark") is not None
REPORT = PerfReport()

# Only kernels/ holds test modules. The other folders hold command-line programs, and
# serving/load_test.py would match pytest's ``*_test.py`` pattern and import the load test's
# server dependencies.
collect_ignore = ["cpu", "engine", "serving"]
collect_ignore_glob: list[str] = []
if not CUDA_AVAILABLE or INTERPRETING:
    collect_ignore_glob += ["kernels/test_*.py"]


def _skip_reason() -> str | None:
    if not CUDA_AVAILABLE:
        return SKIP_REASON
    if INTERPRETING:
        return INTERPRET_SKIP_REASON
    return None


def pytest_report_header(config: pytest.Config) -> str | None:
    reason = _skip_reason()
    if reason is None and not HAS_PYTEST_BENCHMARK:
        return "perf/: pytest-benchmark is not installed; using a minimal stand-in fixture"
    return reason


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    reason = _skip_reason()
    if reason is not None:
        terminalreporter.write_line(reason)
        return
    if REPORT.rows:
        terminalreporter.write_sep("=", "paged-serve perf summary")
        for line in REPORT.lines():
            terminalreporter.write_line(line)
    path = os.environ.get(PERF_JSON_ENV)
    if path:
        REPORT.write_json(path)
        terminalreporter.write_line(f"perf summary JSON written to {path}")


def _is_target_case(item: pytest.Item) -> bool:
    check = getattr(getattr(item, "module", None), "is_target_case", None)
    callspec = getattr(item, "callspec", None)
    name = getattr(item, "originalname", item.name)
    return bool(check and callspec and check(name, callspec.params))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the cases that carry targets first (a module's ``is_target_case(name,
    params)`` says which), so that a run cut short by a time limit still reports them."""
    items.sort(key=lambda item: not _is_target_case(item))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def perf_report() -> PerfReport:
    return REPORT


@pytest.fixture(scope="session")
def copy_bandwidth_gbps(perf_report: PerfReport) -> float:
    """Device-to-device copy bandwidth, GB/s (read + write bytes), measured once per session."""
    import torch

    from perf.kernels.cuda_timing import device_copy_bandwidth_gbps, l2_cache_bytes

    bandwidth = device_copy_bandwidth_gbps()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    perf_report.add(
        "device",
        props.name,
        {
            "copy_gbps": bandwidth,
            "l2_mib": l2_cache_bytes() / 2**20,
            "mem_gib": props.total_memory / 2**30,
            "torch": torch.__version__,
        },
        title="device (copy bandwidth = 2 x bytes / time of a 2 GiB device-to-device copy)",
    )
    return bandwidth


@pytest.fixture(autouse=True)
def _release_cuda_memory() -> Iterator[None]:
    """Give every benchmark the whole device: drop the previous one's tensors and graphs."""
    yield
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


class StandInBenchmark:
    """The part of pytest-benchmark's ``benchmark`` fixture that ``perf/`` uses."""

    def __init__(self) -> None:
        self.extra_info: dict[str, Any] = {}

    def pedantic(
        self,
        target: Callable[..., Any],
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        setup: Callable[[], Any] | None = None,
        teardown: Callable[..., Any] | None = None,
        rounds: int = 1,
        warmup_rounds: int = 0,
        iterations: int = 1,
    ) -> Any:
        result = None
        for _ in range(warmup_rounds + rounds):
            if setup is not None:
                setup()
            for _ in range(iterations):
                result = target(*args, **(kwargs or {}))
            if teardown is not None:
                teardown()
        return result


if not HAS_PYTEST_BENCHMARK:

    @pytest.fixture
    def benchmark() -> StandInBenchmark:
        return StandInBenchmark()
