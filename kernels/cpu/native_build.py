"""Compile a C kernel of ``kernels/cpu/`` at first use and open it with ctypes: what each
kernel's loader (``decode_attention.py``, ``int_gemm.py``) shares.

The source is compiled with the system's C compiler (``$CC``, else ``cc``) into
``<cache_dir>/native``, for this CPU (``-march=native``), keyed by a hash of the source, the
flags and this CPU's feature flags, so a copy built for one CPU is never loaded on another.
Opening a library runs its constructors, so one is opened only from a folder and file private to
this user (``native_cache.py``: owner and mode checked, folders created 0700, the library written
to a temporary name, made 0700 and renamed); where the cache folder fails that check the kernel
is built into a private temporary folder instead, with a warning saying why. Where no compiler
is found or the build fails, ``open_kernel`` returns None and why; the caller logs it once and
keeps torch's path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from paged_serve.kernels.cpu.native_cache import PRIVATE_MODE, file_problem, private_folder

logger = logging.getLogger(__name__)

Kernel = TypeVar("Kernel")


def cpu_flags() -> str:
    """This CPU's feature flags (``-march=native`` compiles for them), or the machine name."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def library_path(cache_dir: Path, stem: str, source: Path, flags: tuple[str, ...]) -> Path:
    """``<cache_dir>/native/<stem>-<hash of source, flags, CPU flags>.so``."""
    key = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(flags).encode(), cpu_flags().encode()):
        key.update(part)
    return cache_dir / "native" / f"{stem}-{key.hexdigest()[:16]}.so"


def build(source: Path, flags: tuple[str, ...], target: Path) -> str | None:
    """Compile ``source`` to ``target``, in a folder ``native_cache`` trusts (atomically:
    concurrent builders each write a temporary file in that folder, make it 0700 and rename
    it); the reason on failure, else None."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return "no C compiler (set CC, or install gcc)"
    scratch = None
    try:
        fd, scratch = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        done = subprocess.run(
            [compiler, *flags, str(source), "-o", scratch], capture_output=True, text=True
        )
        if done.returncode != 0:
            return f"{compiler} failed: {done.stderr.strip()[-500:]}"
        os.chmod(scratch, PRIVATE_MODE)  # the linker may have recreated it 0777 & ~umask
        os.replace(scratch, target)
        return None
    except OSError as error:
        return f"cannot build {target}: {error}"
    finally:
        if scratch is not None and os.path.exists(scratch):
            os.remove(scratch)


def _open(target: Path, wrap: Callable[[ctypes.CDLL], Kernel]) -> tuple[Kernel | None, str | None]:
    """Load the library at ``target`` (checked by the caller) and ``wrap`` it, or why not."""
    try:
        return wrap(ctypes.CDLL(str(target))), None
    except (OSError, AttributeError) as error:
        return None, f"cannot load {target}: {error}"


def _load_cached(
    target: Path, source: Path, flags: tuple[str, ...], wrap: Callable[[ctypes.CDLL], Kernel]
) -> tuple[Kernel | None, str | None]:
    """From a trusted ``target.parent``: the library there if it passes ``file_problem``, else
    one built over it (the folder is ours, so replacing a refused file is safe)."""
    if os.path.lexists(target):
        problem = file_problem(target)
        if problem is None:
            return _open(target, wrap)
        logger.warning("refusing the cached kernel (%s): rebuilding it", problem)
    reason = build(source, flags, target)
    if reason is None:
        reason = file_problem(target)
    return _open(target, wrap) if reason is None else (None, reason)


def _load_private(
    target: Path, source: Path, flags: tuple[str, ...], wrap: Callable[[ctypes.CDLL], Kernel]
) -> tuple[Kernel | None, str | None]:
    """Build into a fresh private folder (``tempfile.mkdtemp``: 0700, an unpredictable name),
    load, and remove the folder (the loaded mapping outlives the file)."""
    folder = Path(tempfile.mkdtemp(prefix="paged-serve-native-"))
    try:
        private = folder / target.name
        reason = build(source, flags, private) or file_problem(private)
        return _open(private, wrap) if reason is None else (None, reason)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def open_kernel(
    cache_dir: Path,
    target: Path,
    *,
    source: Path,
    flags: tuple[str, ...],
    wrap: Callable[[ctypes.CDLL], Kernel],
) -> tuple[Kernel | None, str | None]:
    """``wrap`` of the library ``source`` compiles to, built at ``target`` (under
    ``cache_dir/native``; ``library_path``) at first use, or, where that folder is not private
    to this user, into a temporary one; else ``(None, why)``."""
    problem = private_folder(target.parent, cache_dir)
    if problem is None:
        return _load_cached(target, source, flags, wrap)
    logger.warning(
        "not using the kernel cache: %s; building in a private temporary folder", problem
    )
    return _load_private(target, source, flags, wrap)
