"""A new constraint is compiled first in a process of its own, where a budget can stop it.

xgrammar's compile cannot be interrupted, and some small constraints cost minutes of CPU and
gigabytes: an object schema of N optional properties compiles in about N^2.3 time (800 of them,
a 9.6 KB schema: 1.7 CPU-seconds; 1,600: 20 s). So before the server compiles a constraint it
has not seen, a probe process (``python -m paged_serve.engine.grammar.probe``, started on first use
from the engine's serialized vocabulary) compiles it, checks that it admits some output, and walks
``WALK_TOKENS`` random tokens through it, timing each mask fill. The parent watches the probe's
CPU time and resident memory (``/proc/<pid>/stat``, ``/proc/<pid>/statm``) and kills it the
moment either passes the budget, or when no request waits on the answer any more; a killed
probe is started again for the next constraint. The probe runs at a lower priority (nice 10),
so the engine keeps its cores.

A constraint the probe passed is then compiled in the server (``GrammarCompiler.compile``) at
the cost the probe measured; one it refused is a 400 naming the budget. Where ``/proc`` is
missing (not Linux), wall-clock seconds stand in for CPU time and memory is not watched.
"""

from __future__ import annotations

import json
import os
import random
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from paged_serve.engine.errors import InvalidRequestError
from paged_serve.engine.grammar.structured_output import StructuredOutput, compile_constraint

WALK_TOKENS = 16  # random tokens the probe feeds the grammar, timing each mask fill
POLL_S = 0.02  # how often the parent checks the probe's CPU time and memory
START_TIMEOUT_S = 120.0  # importing xgrammar and reading the vocabulary, on a loaded machine
PROBE_NICE = 10
# A probe starved of CPU (a busy machine, at its lower priority) is stopped after this long.
WALL_FACTOR, MIN_WALL_S = 10.0, 60.0
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class ProbeCancelled(Exception):
    """No request waits for the probe's answer any more; the probe was stopped."""


@dataclass(frozen=True, slots=True)
class ProbeBudget:
    """What one constraint may cost: ``cpu_s`` CPU-seconds to compile and walk, ``memory_bytes``
    of growth in the probe's resident memory, ``fill_s`` seconds for any one mask fill."""

    cpu_s: float
    memory_bytes: int
    fill_s: float


def too_complex(constraint: StructuredOutput, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"the {constraint.kind} constraint is too complex: {why}")


class GrammarProbe:
    """The parent's side of the probe process; ``check`` is thread-safe (one at a time)."""

    def __init__(self, tokenizer_info_json: Callable[[], str], budget: ProbeBudget):
        self.budget = budget
        self._info_json = tokenizer_info_json
        self._info_path: Path | None = None
        self._proc: subprocess.Popen | None = None
        self._pending = b""  # what the probe wrote past its last whole line
        self._lock = threading.Lock()
        # The probe's command line (the vocabulary file's path is appended).
        self.command = [sys.executable, "-m", "paged_serve.engine.grammar.probe"]

    def check(self, constraint: StructuredOutput, cancelled: threading.Event) -> None:
        """Return when the probe compiled ``constraint`` within budget. Raises
        InvalidRequestError (invalid, admits nothing, or past the budget: ``too_complex``) or
        ProbeCancelled once ``cancelled`` is set."""
        with self._lock:
            proc = self._started(cancelled)
            cpu0, rss0 = _cpu_seconds(proc), _rss_bytes(proc)
            request = {"kind": constraint.kind, "spec": constraint.spec}
            request |= {"choices": list(constraint.choices), "fill_s": self.budget.fill_s}
            assert proc.stdin is not None
            proc.stdin.write((json.dumps(request) + "\n").encode())
            proc.stdin.flush()
            wall0 = time.monotonic()
            try:
                reply = self._message(
                    proc, "ok", lambda: self._watch(proc, constraint, cancelled, cpu0, rss0, wall0)
                )
            except EOFError:
                self.stop()
                raise InvalidRequestError(
                    f"the {constraint.kind} constraint crashed the grammar compiler"
                ) from None
        if not reply["ok"]:
            raise InvalidRequestError(reply["error"])
        slowest = max(reply["fills_s"])
        if slowest > self.budget.fill_s:
            raise too_complex(
                constraint,
                f"its token mask took {slowest * 1000:.0f} ms to compute after "
                f"{len(reply['fills_s']) - 1} tokens (the limit is "
                f"{self.budget.fill_s * 1000:.0f} ms per token; --grammar-fill-timeout)",
            )

    def _watch(
        self,
        proc: subprocess.Popen,
        constraint: StructuredOutput,
        cancelled: threading.Event,
        cpu0: float | None,
        rss0: int | None,
        wall0: float,
    ) -> None:
        """Kill the probe and raise if it is past the budget, died, or nobody waits."""
        if cancelled.is_set():
            self.stop()
            raise ProbeCancelled
        if proc.poll() is not None:
            self.stop()
            raise InvalidRequestError(
                f"the {constraint.kind} constraint crashed the grammar compiler "
                f"(exit status {proc.returncode})"
            )
        cpu, rss = _cpu_seconds(proc), _rss_bytes(proc)
        used = cpu - cpu0 if cpu is not None and cpu0 is not None else time.monotonic() - wall0
        # A wall-clock bound too, for a probe starved of CPU time by a busy machine.
        wall_limit = max(WALL_FACTOR * self.budget.cpu_s, MIN_WALL_S)
        if used > self.budget.cpu_s or time.monotonic() - wall0 > wall_limit:
            self.stop()
            raise too_complex(
                constraint,
                f"compiling it took more than {self.budget.cpu_s:g} CPU-seconds "
                "(--grammar-compile-timeout)",
            )
        if rss is not None and rss0 is not None and rss - rss0 > self.budget.memory_bytes:
            self.stop()
            raise too_complex(
                constraint,
                f"compiling it needed more than {self.budget.memory_bytes >> 20} MiB of memory "
                "(--grammar-compile-memory)",
            )

    def _message(
        self, proc: subprocess.Popen, key: str, waiting: Callable[[], None]
    ) -> dict[str, Any]:
        """The probe's next answer: a JSON line holding ``key``; ``waiting()`` runs every
        ``POLL_S`` seconds until it comes (it raises to give up). Other lines (a library that
        printed to stdout before the probe took it over) are skipped; EOFError when the probe
        closed its end."""
        assert proc.stdout is not None
        while True:
            while b"\n" not in self._pending:
                if not _readable(proc.stdout, POLL_S):
                    waiting()
                    continue
                chunk = os.read(proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    raise EOFError
                self._pending += chunk
            line, _, self._pending = self._pending.partition(b"\n")
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict) and key in message:
                return message

    def _started(self, cancelled: threading.Event) -> subprocess.Popen:
        """The running probe, started (and waited for) when there is none."""
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if self._info_path is None:
            handle, name = tempfile.mkstemp(prefix="paged-serve-vocab-", suffix=".json")
            with os.fdopen(handle, "w") as file:
                file.write(self._info_json())
            self._info_path = Path(name)
        self._pending = b""
        self._proc = subprocess.Popen(
            [*self.command, str(self._info_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            preexec_fn=_lower_priority if os.name == "posix" else None,
        )
        proc = self._proc
        deadline = time.monotonic() + START_TIMEOUT_S

        def waiting() -> None:
            if cancelled.is_set() or proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                if cancelled.is_set():
                    raise ProbeCancelled
                raise RuntimeError("the grammar probe process did not start")

        try:
            self._message(proc, "ready", waiting)
        except EOFError:
            self.stop()
            raise RuntimeError("the grammar probe process did not start") from None
        return proc

    def stop(self) -> None:
        """Kill the probe process (a later ``check`` starts a new one)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()

    def close(self) -> None:
        """Stop the probe and remove its vocabulary file."""
        self.stop()
        if self._info_path is not None:
            self._info_path.unlink(missing_ok=True)
            self._info_path = None


def _lower_priority() -> None:
    os.nice(PROBE_NICE)


def _readable(pipe: IO[bytes] | None, timeout_s: float) -> bool:
    assert pipe is not None
    return bool(select.select([pipe], [], [], timeout_s)[0])


def _cpu_seconds(proc: subprocess.Popen) -> float | None:
    """User plus system CPU seconds of ``proc`` (all its threads), or None without /proc."""
    try:
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)"; utime, stime are 14, 15
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def _rss_bytes(proc: subprocess.Popen) -> int | None:
    """Resident bytes of ``proc``, or None without /proc."""
    try:
        return int(Path(f"/proc/{proc.pid}/statm").read_text().split()[1]) * _PAGE_BYTES
    except OSError:
        return None


# ---------------------------------------------------------------------------- the probe side


def walk(
    compiled: Any, vocab_size: int, stop_token_ids: set[int], fill_s: float, seed: int = 0
) -> list[float]:
    """Thread CPU seconds of each mask fill along ``WALK_TOKENS`` random allowed tokens (stop
    tokens avoided while others are allowed), ending early at a fill over ``fill_s``; empty
    when the first mask allows nothing."""
    import torch
    import xgrammar

    from paged_serve.engine.sample.token_mask import allowed_tokens

    matcher = xgrammar.GrammarMatcher(compiled)
    mask = xgrammar.allocate_token_bitmask(1, vocab_size)
    rng = random.Random(seed)
    fills: list[float] = []
    for _ in range(WALK_TOKENS):
        start = time.thread_time()
        matcher.fill_next_token_bitmask(mask)
        fills.append(time.thread_time() - start)
        if fills[-1] > fill_s:
            break
        allowed = torch.nonzero(allowed_tokens(mask[0], vocab_size)).flatten().tolist()
        if not allowed:
            return [] if len(fills) == 1 else fills
        going_on = [t for t in allowed if t not in stop_token_ids]
        if not going_on:
            break
        if not matcher.accept_token(rng.choice(going_on)) or matcher.is_terminated():
            break
    return fills


def _serve(info_path: str) -> None:
    """Answer one JSON line per constraint on stdin: ``{"ok": true, "fills_s": [...]}`` or
    ``{"ok": false, "error": ...}``. The answers own stdout: anything a library prints there
    (from Python or C) goes to stderr instead."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import xgrammar

    info = xgrammar.TokenizerInfo.deserialize_json(Path(info_path).read_text())
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    stop = set(info.stop_token_ids)
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            constraint = StructuredOutput(
                request["kind"], request["spec"], choices=tuple(request["choices"])
            )
            compiled = compile_constraint(compiler, constraint)
            fills = walk(compiled, info.vocab_size, stop, request["fill_s"])
            reply: dict[str, Any] = {"ok": True, "fills_s": fills}
            if not fills:
                reply = {"ok": False, "error": f"the {constraint.kind} constraint admits no output"}
        except (InvalidRequestError, ValueError) as exc:
            reply = {"ok": False, "error": str(exc)}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    _serve(sys.argv[1])
