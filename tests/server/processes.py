"""Servers as subprocesses: ``paged-serve`` started with a command line, its log lines read by a
thread, the ready line awaited (the tests that need a real process: the CLI, signals, tensor
parallelism, replicas behind a router)."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

READY = re.compile(r"serving (?P<model>\S+) at (?P<url>http://\S+)/v1")
START_DEADLINE_S = 120.0


class ServerProcess:
    """A ``paged-serve`` subprocess whose log lines are collected by a reader thread."""

    def __init__(self, args: list[str]):
        script = Path(sys.executable).with_name("paged-serve")
        module = [sys.executable, "-m", "paged_serve.server.cli"]
        command = [str(script)] if script.exists() else module
        self.proc = subprocess.Popen(
            command + args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.put(line)

    def wait_for(self, pattern: re.Pattern[str], deadline_s: float) -> re.Match[str]:
        end = time.monotonic() + deadline_s
        while True:
            remaining = end - time.monotonic()
            if remaining <= 0 or self.proc.poll() is not None and self.lines.empty():
                raise AssertionError(f"no line matching {pattern.pattern!r}:\n{''.join(self.log)}")
            try:
                line = self.lines.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            self.log.append(line)
            match = pattern.search(line)
            if match:
                return match

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
