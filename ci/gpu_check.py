"""Helper of ``ci/gpu-check.sh``: prerequisites, time-limited (sharded) steps, summary table.

    python ci/gpu_check.py preflight --log-dir DIR [--require-cuda]
    python ci/gpu_check.py run --log-dir DIR --name NAME --timeout S [--jobs N] [--junit] -- CMD..
    python ci/gpu_check.py summary --log-dir DIR [--dry-run] [--e2e-workload TEXT]

``preflight`` prints which Python modules the check needs and has (exit 1 if a required one is
missing, 3 with ``--require-cuda`` and no CUDA device) and writes ``env.json`` (versions, GPU).

``run`` runs one step under a deadline and appends its outcome to ``steps.tsv``. At the
deadline the command gets SIGINT -- pytest then stops like on Ctrl-C and still writes its junit
XML and terminal summary -- and SIGKILL 20 s later; the step's rc is then 124. With ``--jobs N``
(a pytest command) the collected tests are cut into N contiguous shards run side by side:
Triton compiles on the CPU, so compile-bound kernel tests finish several times sooner. stdout
and stderr are echoed and kept as ``NAME.out`` / ``NAME.err`` (``NAME.<shard>.log`` shards).

``summary`` prints the table ``gpu-check.sh`` ends with: machine and versions, each step's
status and test counts (from the junit XML), the performance targets from ``pytest perf/``
(``perf.json``) and the end-to-end ratios (the JSON ``perf.engine.bench_e2e`` prints).
Only the standard library is imported up front, so this runs before anything is known to be
installed. The one exception: rebuilding the report of an e2e run that was stopped imports
``perf.engine.bench_e2e`` for its speed goal, which that run has just shown to be importable.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

# (import name, distribution name, required?, what needs it)
MODULES: tuple[tuple[str, str, bool, str], ...] = (
    ("torch", "torch", True, "everything"),
    ("triton", "triton", True, "the kernels"),
    ("transformers", "transformers", True, "tests/ conftest, the e2e benchmark"),
    ("pytest", "pytest", True, "kernel tests, perf/"),
    ("safetensors", "safetensors", False, "transformers (model files)"),
    (
        "pytest_benchmark",
        "pytest-benchmark",
        False,
        "perf/ (if missing: a stand-in fixture, no pytest-benchmark JSON)",
    ),
    ("aiohttp", "aiohttp", False, "the server only: not used by this check"),
    ("msgspec", "msgspec", False, "the server only: not used by this check"),
)
STEPS = ("hazards", "kernels[cuda]", "kernels[other]", "engine[cuda]", "perf", "e2e", "tp")
# Steps a machine may be unable to run: "not measured" there, never a failure (tp: >= 2 GPUs).
OPTIONAL_STEPS = ("tp",)
KILL_GRACE_S = 20.0
WIDTH = 100


# ------------------------------------------------------------------------------------ preflight
def module_versions() -> list[tuple[str, str, bool, str, str | None]]:
    """(module, distribution, required, needed by, version or None if missing)."""
    rows = []
    for module, dist, required, needed_by in MODULES:
        version = None
        if importlib.util.find_spec(module) is not None:
            try:
                version = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                version = "present"
        rows.append((module, dist, required, needed_by, version))
    return rows


def _gpu_from_nvidia_smi() -> dict[str, str] | None:
    query = "--query-gpu=name,driver_version,memory.total"
    try:
        out = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    if not out:
        return None
    name, driver, memory = (x.strip() for x in out.splitlines()[0].split(",", 2))
    return {"name": name, "driver": driver, "memory": memory, "count": str(len(out.splitlines()))}


def _torch_cuda_info() -> dict[str, Any]:
    """torch's view of CUDA, from a child process (importing torch here would slow the rest)."""
    code = (
        "import json, torch\n"
        "ok = torch.cuda.is_available()\n"
        "print(json.dumps({'cuda_available': ok, 'torch_cuda': torch.version.cuda,\n"
        "  'device': torch.cuda.get_device_name(0) if ok else None,\n"
        "  'capability': '.'.join(map(str, torch.cuda.get_device_capability(0))) if ok else None"
        "}))\n"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
        ).stdout
        return json.loads(out.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        return {"cuda_available": False, "error": f"{type(exc).__name__}: {exc}"[:300]}


def preflight(log_dir: Path, *, require_cuda: bool) -> int:
    rows = module_versions()
    print(f"python  {sys.executable} ({platform.python_version()})")
    print(f"{'module':<18} {'version':<14} needed by")
    for module, _, required, needed_by, version in rows:
        shown = version or ("MISSING (required)" if required else "MISSING")
        print(f"{module:<18} {shown:<14} {needed_by}")
    missing_required = [m for m, _, req, _, v in rows if req and v is None]
    missing_optional = [d for _, d, req, _, v in rows if not req and v is None]
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "modules": {m: v for m, _, _, _, v in rows},
        "missing_optional": missing_optional,
        "missing": [d for _, d, _, _, v in rows if v is None],
        "gpu": _gpu_from_nvidia_smi(),
    }
    if "torch" not in missing_required:
        env.update(_torch_cuda_info())
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "env.json").write_text(json.dumps(env, indent=2) + "\n")
    if missing_optional:
        print(
            "optional packages missing: " + ", ".join(missing_optional) + " (install offline with"
            " `pip install --no-index --find-links DIR ...`; gpu-check.sh does that from .whl/ or"
            " $GPU_CHECK_WHEELS when present)"
        )
    if missing_required:
        print("REQUIRED modules missing: " + ", ".join(missing_required))
        return 1
    if require_cuda and not env.get("cuda_available"):
        print(f"no CUDA device visible to torch: {env.get('error', 'torch.cuda.is_available()')}")
        return 3
    return 0


# ------------------------------------------------------------------------------------------ run
def _tee(src: IO[str], files: Sequence[IO[str]]) -> None:
    for line in src:
        for f in files:
            f.write(line)
            f.flush()


def _is_pytest(cmd: Sequence[str]) -> bool:
    return any(Path(c).name in ("pytest", "py.test") for c in cmd) or "pytest" in cmd


def _reset_sigint() -> None:
    # A shell that runs us in the background ignores SIGINT, and children inherit that; pytest
    # must see SIGINT at the deadline to stop cleanly.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def collect_node_ids(cmd: Sequence[str], timeout: float) -> list[str]:
    """The test ids ``cmd`` (a pytest command) would run (``--collect-only -q`` lists them)."""
    # Exactly one -q: it lists node ids (-qq would list per-file counts instead).
    args = [c for c in cmd if c not in ("-q", "--quiet")] + ["--collect-only", "-q"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout).stdout
    ids = []
    for line in out.splitlines():
        if not line.strip():
            break  # the list ends at the first blank line
        if "::" in line and not line.startswith(("ERROR", "FAILED", "=", "_")):
            ids.append(line.strip())
    return ids


def without_paths(cmd: Sequence[str]) -> list[str]:
    """``cmd`` minus the test paths after ``pytest``, which the shards' node ids replace."""
    names = [Path(c).name for c in cmd]
    start = names.index("pytest") + 1 if "pytest" in names else 0
    rest = [c for c in cmd[start:] if c.startswith("-") or not Path(c.split("::")[0]).exists()]
    return [*cmd[:start], *rest]


def split_contiguous(items: Sequence[str], parts: int) -> list[list[str]]:
    """``items`` cut into ``parts`` contiguous, near-equal, non-empty runs (order kept)."""
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(list(items[start:end]))
        start = end
    return out


def _wait_all(procs: list[subprocess.Popen], deadline: float) -> bool:
    """Wait for every process; at the deadline SIGINT them, then SIGKILL. True if timed out."""
    timed_out = False
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    if timed_out:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return timed_out


def run_step(
    log_dir: Path, *, name: str, timeout: float, jobs: int, junit: bool, cmd: list[str]
) -> int:
    start = time.monotonic()
    deadline = start + timeout
    slug = name.replace("[", "_").replace("]", "")
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    opened: list[IO[str]] = []
    shard_logs: list[Path] = []
    note = ""
    if jobs > 1 and _is_pytest(cmd):
        try:
            ids = collect_node_ids(cmd, timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            ids = []  # run unsharded: the single run below reports what happens
        shards = split_contiguous(ids, jobs) if ids else []
        note = f"{len(ids)} tests in {len(shards)} shards"
        print(f"[{name}] {note}", flush=True)
        for i, shard in enumerate(shards):
            log = log_dir / f"{slug}.{i}.log"
            shard_logs.append(log)
            f = open(log, "w")  # noqa: SIM115 -- closed below, after the process ends
            opened.append(f)
            extra = [f"--junitxml={log_dir / f'{slug}.{i}.xml'}"] if junit else []
            procs.append(
                subprocess.Popen(
                    [*without_paths(cmd), *extra, *shard],
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    text=True,
                    preexec_fn=_reset_sigint,
                )
            )
    if not procs:
        extra = [f"--junitxml={log_dir / f'{slug}.xml'}"] if junit else []
        out = open(log_dir / f"{slug}.out", "w")  # noqa: SIM115
        err = open(log_dir / f"{slug}.err", "w")  # noqa: SIM115
        opened += [out, err]
        p = subprocess.Popen(
            [*cmd, *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            preexec_fn=_reset_sigint,
        )
        procs.append(p)
        threads = [
            threading.Thread(target=_tee, args=(p.stdout, [sys.stdout, out]), daemon=True),
            threading.Thread(target=_tee, args=(p.stderr, [sys.stderr, err]), daemon=True),
        ]
        for t in threads:
            t.start()
    timed_out = _wait_all(procs, deadline)
    for t in threads:
        t.join(timeout=10)
    for f in opened:
        f.close()
    for log in shard_logs:  # each shard's last line: pytest's "N passed, ..." summary
        lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
        failed = [x for x in lines if x.startswith(("FAILED", "ERROR"))]
        print(f"[{name}] {log.name}: {lines[-1] if lines else '(no output)'}")
        for line in failed[:20]:
            print(f"[{name}]   {line}")
    rcs = [p.returncode for p in procs]
    rc = 124 if timed_out else next((r for r in rcs if r not in (0, 5)), 5 if 5 in rcs else 0)
    if timed_out:
        note = (note + "; " if note else "") + f"stopped at the {timeout:.0f} s limit"
    record_step(log_dir, name, rc, time.monotonic() - start, note, cmd)
    return rc


def record_step(
    log_dir: Path, name: str, rc: int | None, seconds: float, note: str, cmd: Sequence[str]
) -> None:
    """Append one step's outcome to ``steps.tsv`` (rc None: not run)."""
    fields = [name, "" if rc is None else str(rc), f"{seconds:.1f}", note, shlex.join(cmd)]
    with open(log_dir / "steps.tsv", "a") as f:
        f.write("\t".join(x.replace("\t", " ").replace("\n", " ") for x in fields) + "\n")


# -------------------------------------------------------------------------------------- summary
@dataclass(slots=True)
class StepResult:
    name: str
    rc: int | None
    seconds: float | None
    note: str
    counts: dict[str, int] | None

    @property
    def status(self) -> str:
        if self.rc is None:
            return "NOT RUN"
        if self.rc == 124 or self.rc == 137:
            return "TIMEOUT"
        if self.rc == 5:
            return "NO TESTS"
        return "PASS" if self.rc == 0 else "FAIL"


def junit_counts(paths: Sequence[Path]) -> dict[str, int] | None:
    """passed / failed / errors / skipped summed over junit XML files (None if none readable)."""
    total = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    found = False
    for path in paths:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError):
            continue
        found = True
        suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
        for s in suites:
            tests, failures = int(s.get("tests", 0)), int(s.get("failures", 0))
            errors, skipped = int(s.get("errors", 0)), int(s.get("skipped", 0))
            total["passed"] += tests - failures - errors - skipped
            total["failed"] += failures
            total["errors"] += errors
            total["skipped"] += skipped
    return total if found else None


def read_steps(log_dir: Path) -> list[StepResult]:
    recorded: dict[str, StepResult] = {}
    path = log_dir / "steps.tsv"
    lines = path.read_text().splitlines() if path.is_file() else []
    for line in lines:
        name, rc, seconds, note, *_ = line.split("\t") + ["", "", ""]
        slug = name.replace("[", "_").replace("]", "")
        xmls = sorted(log_dir.glob(f"{slug}.xml")) + sorted(log_dir.glob(f"{slug}.*.xml"))
        recorded[name] = StepResult(
            name, int(rc) if rc else None, float(seconds or 0), note, junit_counts(xmls)
        )
    return [recorded.get(n, StepResult(n, None, None, "", None)) for n in STEPS]


# perf.engine.bench_e2e.PROGRESS_PREFIX (stdlib only here)
E2E_PROGRESS_PREFIX = "bench_e2e progress: "
REPO = Path(__file__).resolve().parents[1]


def e2e_goal() -> float:
    """paged-serve's speed goal over the best HF system on a GPU:
    ``perf.engine.bench_e2e.E2E_GOALS``.

    Imported on demand: ``perf.engine.bench_e2e`` needs torch and transformers, which a machine
    that fails the preflight may lack; only a stopped e2e run's report needs the goal here.
    """
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from perf.engine.bench_e2e import E2E_GOALS

    return E2E_GOALS.cuda


def e2e_report(path: Path) -> dict[str, Any] | None:
    """The JSON object ``perf.engine.bench_e2e`` prints (from ``{`` to ``}`` on lines of their own).

    A run stopped before its end printed no report: then the systems it finished are rebuilt
    from its progress lines (the last line of each system wins), with ``"partial": true``.
    """
    if not path.is_file():
        return None
    lines = path.read_text(errors="replace").splitlines()
    try:
        start = lines.index("{")
        end = lines.index("}", start)
        return json.loads("\n".join(lines[start : end + 1]))
    except ValueError:
        pass
    systems: dict[str, Any] = {}
    for line in lines:
        if line.startswith(E2E_PROGRESS_PREFIX):
            try:
                summary = json.loads(line[len(E2E_PROGRESS_PREFIX) :])
            except ValueError:
                continue
            systems[summary.get("name", "?")] = summary
    if not systems:
        return None
    paged = (systems.get("paged_serve") or {}).get("output_tokens_per_s")
    ratios = {
        f"paged_serve/{name}": paged / r["output_tokens_per_s"]
        for name, r in systems.items()
        if paged and name != "paged_serve" and r.get("output_tokens_per_s")
    }
    hf = [r.get("output_tokens_per_s") for n, r in systems.items() if n.startswith("hf_")]
    best_hf = max((x for x in hf if x), default=None)
    over = paged / best_hf if paged and best_hf else None
    goal = e2e_goal()
    return {
        "partial": True,
        "systems": systems,
        "ratios": ratios,
        "target": {
            "paged_over_best_hf": over,
            "goal": goal,
            "met": bool(over) and over >= goal,
        },
    }


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:.2f}{unit}" if isinstance(value, float) else str(value)


def summary_lines(log_dir: Path, *, dry_run: bool, e2e_workload: str) -> list[str]:
    env_path = log_dir / "env.json"
    env = json.loads(env_path.read_text()) if env_path.is_file() else {}
    mods = env.get("modules", {})
    gpu = env.get("gpu") or {}
    out = ["=" * WIDTH, "paged-serve gpu-check summary" + (" (DRY RUN: nothing ran)" * dry_run)]
    out.append("=" * WIDTH)
    if gpu:
        out.append(
            f"gpu       {gpu.get('name')} x{gpu.get('count')}, driver {gpu.get('driver')}, "
            f"{gpu.get('memory')}, capability {env.get('capability', '?')}"
        )
    else:
        out.append(f"gpu       none visible to nvidia-smi; torch sees: {env.get('device')}")
    out.append(
        f"software  python {env.get('python', '?')} | torch {mods.get('torch')} "
        f"(CUDA {env.get('torch_cuda')}) | triton {mods.get('triton')} | "
        f"transformers {mods.get('transformers')} | pytest-benchmark "
        f"{mods.get('pytest_benchmark') or 'MISSING (stand-in used)'}"
    )
    out.append("")
    out.append(
        f"{'step':<16}{'status':<10}{'secs':>7}{'passed':>8}{'failed':>8}{'errors':>8}"
        f"{'skipped':>9}  note"
    )
    steps = read_steps(log_dir)
    for s in steps:
        c = s.counts or {}
        status = "DRY-RUN" if dry_run else s.status
        secs = "-" if s.seconds is None or s.rc is None else f"{s.seconds:.0f}"
        out.append(
            f"{s.name:<16}{status:<10}{secs:>7}{_fmt(c.get('passed')):>8}"
            f"{_fmt(c.get('failed')):>8}{_fmt(c.get('errors')):>8}{_fmt(c.get('skipped')):>9}"
            f"  {s.note}"
        )
    out.append("")
    out.append("key figures (performance targets: reported, never asserted)")
    perf_path = log_dir / "perf.json"
    perf = json.loads(perf_path.read_text()) if perf_path.is_file() else None
    if perf is None:
        out.append("  perf: no results" + ("" if dry_run else f" ({perf_path} missing)"))
    else:
        device = [r for r in perf.get("rows", []) if r.get("section") == "device"]
        if device:
            gbps = device[0]["metrics"].get("copy_gbps")
            out.append(f"  device copy bandwidth   {gbps:.0f} GB/s (2 GiB D2D copy, read+write)")
        verdicts = {True: "met", False: "NOT met", None: "not measured"}
        for t in perf.get("targets", []):
            value = "n/a" if t["value"] is None else f"{t['value']:.2f}{t['unit']}"
            out.append(
                f"  {t['name']:<48} {t['case']:<28} {value:>9}  goal >= {t['goal']:g}{t['unit']}"
                f"  {verdicts[t['met']]}"
            )
    e2e = e2e_report(log_dir / "e2e.out")
    out.append(f"  e2e workload: {e2e_workload}")
    if e2e is None:
        out.append("  e2e: no results" + ("" if dry_run else " (no JSON in e2e.out)"))
    else:
        if e2e.get("partial"):
            out.append("  e2e: PARTIAL, stopped before its report: the systems it finished")
        for name, r in e2e.get("systems", {}).items():
            rate = r.get("output_tokens_per_s")
            err = f"  ERROR {r['error'][:80]}" if r.get("error") else ""
            out.append(f"  e2e {name:<20} {_fmt(rate)} output tok/s{err}")
        for name, ratio in e2e.get("ratios", {}).items():
            out.append(f"  e2e {name:<36} {ratio:.2f}x")
        target = e2e.get("target", {})
        agree = e2e.get("agreement", {}).get("paged_serve_vs_hf_static", {})
        out.append(
            f"  e2e paged_serve / best HF {_fmt(target.get('paged_over_best_hf'), 'x')} (goal "
            f"{target.get('goal')}x: {'met' if target.get('met') else 'NOT met'}); greedy token "
            f"match vs hf_static {agree.get('token_match_rate', '-')} (random weights: near-ties "
            "may diverge)"
        )
    out.append("logs      " + ("(dry run: none kept)" if dry_run else str(log_dir)))
    if dry_run:
        out.append("overall   DRY RUN (exit 0)")
    else:
        bad = [s.name for s in steps if s.status != "PASS"]
        out.append("overall   " + ("PASS" if not bad else f"FAIL ({', '.join(bad)})"))
    out.append("=" * WIDTH)
    return [line.rstrip() for line in out]


def overall_ok(log_dir: Path) -> bool:
    return all(
        s.status == "PASS" or (s.name in OPTIONAL_STEPS and s.rc is None)
        for s in read_steps(log_dir)
    )


# ----------------------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("preflight")
    pre.add_argument("--log-dir", type=Path, required=True)
    pre.add_argument("--require-cuda", action="store_true")
    run = sub.add_parser("run")
    run.add_argument("--log-dir", type=Path, required=True)
    run.add_argument("--name", required=True)
    run.add_argument("--timeout", type=float, required=True)
    run.add_argument("--jobs", type=int, default=1)
    run.add_argument("--junit", action="store_true", help="add --junitxml (pytest commands)")
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    skip = sub.add_parser("skip", help="record a step that was not run")
    skip.add_argument("--log-dir", type=Path, required=True)
    skip.add_argument("--name", required=True)
    skip.add_argument("--note", default="")
    summ = sub.add_parser("summary")
    summ.add_argument("--log-dir", type=Path, required=True)
    summ.add_argument("--dry-run", action="store_true")
    summ.add_argument("--e2e-workload", default="-")
    args = p.parse_args(argv)

    if args.command == "preflight":
        return preflight(args.log_dir, require_cuda=args.require_cuda)
    if args.command == "run":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            p.error("run needs a command after --")
        args.log_dir.mkdir(parents=True, exist_ok=True)
        return run_step(
            args.log_dir,
            name=args.name,
            timeout=args.timeout,
            jobs=args.jobs,
            junit=args.junit,
            cmd=cmd,
        )
    if args.command == "skip":
        record_step(args.log_dir, args.name, None, 0.0, args.note, [])
        return 0
    for line in summary_lines(args.log_dir, dry_run=args.dry_run, e2e_workload=args.e2e_workload):
        print(line)
    return 0 if args.dry_run or overall_ok(args.log_dir) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
