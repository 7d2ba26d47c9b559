"""The servers ``perf.serving.bench_serving`` measures, and starting and stopping them.

A system is named on the command line:

* ``paged-serve[:DTYPE]``: this checkout's ``paged-serve`` (``python -m paged_serve.server.cli``)
started
  as a subprocess with ``--dtype DTYPE`` (default float32); its greedy tokens must equal HF's
  in float32, and are compared with HF in the same dtype otherwise;
* ``llama-cpp-f32``: llama.cpp's ``llama-server`` on the shipped Q4_1 weights turned into an F32
  GGUF (the weights paged-serve runs in float32); ``llama-cpp-q4_1``: on the shipped Q4_1 file.
  Both are compared with HF float32, with llama.cpp's banned end-of-generation tokens
  suppressed (``perf.serving.check``);
* ``external``: a server already running at ``--base-url`` (compared with HF float32).

With ``model`` (bench_serving's ``--model``, a Hugging Face folder) the started systems serve
that model instead of the embedded default: paged-serve with ``--model``, llama.cpp on the GGUF
files converted from it by llama.cpp's own converter (``perf.serving.llama_cpp.model_gguf``:
F32, and Q4_1 quantized from that F32).

``Server`` starts a system on a free 127.0.0.1 port, waits until ``GET /v1/models`` answers,
and stops it (SIGTERM, then SIGKILL) on exit; its output goes to a log file.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

REPO_ROOT = Path(__file__).resolve().parents[2]  # perf/serving/systems.py -> the checkout
DTYPES = ("float32", "bfloat16", "float16", "auto")
LLAMA_CPP_SYSTEMS = ("llama-cpp-f32", "llama-cpp-q4_1")


@dataclass(frozen=True, slots=True)
class System:
    """What to start (or reach) and what its greedy tokens are compared with."""

    name: str
    kind: str  # "paged-serve", "llama-cpp" or "external"
    dtype: str = "float32"  # paged-serve's --dtype
    hf_dtype: str = "float32"  # the HF reference's precision
    require_hf_equality: bool = False
    suppress_eog: bool = False  # llama-server's ignore_eos bans end-of-generation tokens
    base_url: str | None = None  # external only
    extra_args: tuple[str, ...] = field(default=())
    model: str | None = None  # a Hugging Face folder both servers serve; None: the default


# paged-serve flags that change its arithmetic: with one, float32 need not equal HF fp32.
NUMERICS_FLAGS = ("--quantization",)


def parse_system(
    text: str,
    *,
    base_url: str | None = None,
    extra_args: tuple[str, ...] = (),
    model: str | None = None,
) -> System:
    """``paged-serve[:DTYPE]``, ``llama-cpp-f32``, ``llama-cpp-q4_1`` or ``external``, optionally
    followed by flags for that system alone: ``"paged-serve:float32 --quantization int8"``
    (they come after ``extra_args`` and name the system apart). ``model``: the Hugging Face
    folder a started system serves (default: the embedded model)."""
    spec, *own_args = text.split()
    name, _, dtype = spec.partition(":")
    label = " ".join([spec.replace(":", "-"), *own_args]) if own_args else ""
    args = (*extra_args, *own_args)
    if name == "paged-serve":
        dtype = dtype or "float32"
        if dtype not in DTYPES:
            raise ValueError(f"paged-serve dtype must be one of {DTYPES}, got {dtype!r}")
        exact = dtype == "float32" and not any(a.startswith(NUMERICS_FLAGS) for a in args)
        return System(
            label or f"paged-serve-{dtype}",
            "paged-serve",
            dtype=dtype,
            # auto resolves inside the server; its tokens are compared with HF float32.
            hf_dtype=dtype if dtype in ("bfloat16", "float16") else "float32",
            require_hf_equality=exact,
            extra_args=args,
            model=model,
        )
    if dtype:
        raise ValueError(f"only paged-serve takes a dtype, got {text!r}")
    if name in LLAMA_CPP_SYSTEMS:
        return System(
            label or name, "llama-cpp", suppress_eog=True, extra_args=args, model=model
        )
    if name == "external":
        if not base_url:
            raise ValueError("--system external needs --base-url")
        return System("external", "external", base_url=base_url.rstrip("/"))
    raise ValueError(
        f"unknown system {text!r}: paged-serve[:DTYPE], {', '.join(LLAMA_CPP_SYSTEMS)}, external"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(
    system: System, port: int, *, llama_slots: int, llama_ctx_per_slot: int, threads: int
) -> list[str]:
    """The command line that serves ``system`` on 127.0.0.1:``port``."""
    if system.kind == "paged-serve":
        return [
            sys.executable, "-m", "paged_serve.server.cli",
            *(["--model", system.model] if system.model else []),
            "--host", "127.0.0.1", "--port", str(port),
            "--dtype", system.dtype, "--no-dashboard", "--log-level", "warning",
            *system.extra_args,
        ]
    if system.kind == "llama-cpp":
        from perf.serving.llama_cpp import binary, gguf_for

        return [
            str(binary("llama-server")),
            "-m", str(gguf_for(system.name.split()[0], model=system.model)),
            "--host", "127.0.0.1", "--port", str(port),
            # One slot per concurrent request, sharing one KV pool, as paged-serve's pool.
            "--parallel", str(llama_slots), "--kv-unified",
            "--ctx-size", str(llama_slots * llama_ctx_per_slot),
            "--threads", str(threads), "--threads-batch", str(threads),
            "--no-webui",
            *system.extra_args,
        ]
    raise ValueError(f"{system.name} is not started by the bench")


class Server:
    """A system's server process for the length of a ``with`` block; ``base_url`` to reach it.

    An ``external`` system is only checked to answer.
    """

    def __init__(
        self,
        system: System,
        *,
        log_path: Path,
        llama_slots: int = 32,
        llama_ctx_per_slot: int = 1024,
        threads: int = 2,
        startup_timeout_s: float = 600.0,
    ) -> None:
        self.system = system
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None
        self.command: list[str] = []
        self.startup_s: float | None = None  # seconds from launch to answering
        if system.kind == "external":
            self.base_url = system.base_url or ""
            return
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        self.command = server_command(
            system, port, llama_slots=llama_slots, llama_ctx_per_slot=llama_ctx_per_slot,
            threads=threads,
        )

    def __enter__(self) -> Server:
        started = time.perf_counter()
        if self.command:
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p
            )
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(
                    self.command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
                )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.startup_s = round(time.perf_counter() - started, 2)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.system.name} exited with {self.process.returncode} while starting; "
                    f"see {self.log_path}"
                )
            try:
                with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.system.name} did not answer within {self.startup_timeout_s} s")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
