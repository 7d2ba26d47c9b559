"""The CPU engine's attention kernels of our own, in C: decode rows read the paged KV cache in
place, and the step's new K/V rows are written to their slots.

Triton kernels need a GPU (or the interpreter, far too slow to serve), so the CPU engine attends
with torch (``engine/platform/cpu/attention.py``): per layer it gathers each sequence's K and V
blocks
into a dense copy and calls ``F.scaled_dot_product_attention``. For decode rows (one query token
per sequence) the copy, the call's dispatch and its many small tiles cost more than the
arithmetic. ``paged_decode_*`` (``cpu_decode_attention.c``) attends each sequence's decode row
straight from its cache blocks, sequences spread over torch's OpenMP threads::

    for each sequence s (one thread's work), token p of its context (block table order):
        scores[h, p] = scale * q[s, h] . K[block(s, p), p % block_size, h // G]   (fp32)
    out[s, h] = softmax_p(scores[h]) @ V[...]                                     (fp32)

and ``write_kv_rows`` copies token rows to their slots (what ``write_kv_ref``'s two indexed
assignments do, without their dispatch), for every step.

Measured on the 2-core CPU (``python -m perf.cpu.bench_attention``: one layer of SmolLM2-135M's
shape, 9 query heads over 3 KV heads of 64, blocks of 16, 30 layers' caches read in turn, 2
threads), against the torch path (gather and SDPA), at a 128-token context: fp32 1 row 47
against 148 us, 24 rows 377 against 763 us; bf16 24 rows 321 against 759 us. The engine's
decode step and the servers: docs/measurements/cpu-kernels.md.

It computes in fp32 with its own order of sums and its own exponential (Cephes' polynomial:
within 1.02 ulp of e^x over [-87.2, 0], checked at every 7th float), so its outputs equal the
reference's up to fp32 rounding, not bit for bit (tests); bf16 inputs are widened on load and
the output rounded once (nearest even).

The C source is compiled at first use with the system's C compiler (``$CC``, else ``cc``) into
``<cache_dir>/native``, for this CPU (``-march=native``), keyed by a hash of the source, the
flags and this CPU's feature flags, so a copy built for one CPU is never loaded on another
(about 0.4 s once). Opening a library runs its constructors, so one is opened only from a
folder and file private to this user (``kernels/cpu/native_cache.py``: owner and mode checked,
folders created 0700, the library written to a temporary name, made 0700 and renamed); where
the cache folder fails that check the kernel is built into a private temporary folder instead,
with a warning saying why. The library links libgomp by its soname, which resolves to the copy
torch has loaded: one OpenMP runtime, one thread pool. Where no compiler is found or the build
fails, ``load`` returns None and says why once; callers then keep torch's path.
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
from pathlib import Path

import torch

from paged_serve.kernels.cpu.native_cache import PRIVATE_MODE, file_problem, private_folder

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11")

_I64, _I32, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_ARGTYPES = [
    _PTR,  # q [T, Hq, D], heads contiguous
    _I64,  # q's row stride (elements)
    _PTR,  # q_rows [S] int64, or NULL: row s
    _PTR,  # k_cache
    _PTR,  # v_cache
    _I64,  # block_stride (elements)
    _I64,  # token_stride (elements)
    _I32,  # block_size
    _I32,  # num_kv_heads
    _I32,  # group (query heads per KV head)
    _I32,  # head_dim
    _PTR,  # block_tables [S, *] int32
    _I64,  # table_stride (elements)
    _PTR,  # seq_lens [S] int32
    _I32,  # num_seqs
    ctypes.c_float,  # scale
    _I32,  # window (0: none)
    _PTR,  # out [T, Hq, D]
    _I32,  # num_threads
]
_WRITE_ARGTYPES = [
    _PTR,  # key [T, Hkv, D]
    _I64,  # key's row stride (elements)
    _PTR,  # value [T, Hkv, D]
    _I64,  # value's row stride (elements)
    _PTR,  # k_cache
    _PTR,  # v_cache
    _PTR,  # slots [T] int64
    _I32,  # T
    _I64,  # the caches' slots
    _I64,  # a token row's elements (Hkv * D)
    _I32,  # element size (bytes)
]


def _cpu_flags() -> str:
    """This CPU's feature flags (``-march=native`` compiles for them), or the machine name."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _library_path(cache_dir: Path) -> Path:
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), _cpu_flags().encode()):
        key.update(part)
    return cache_dir / "native" / f"cpu_decode_attention-{key.hexdigest()[:16]}.so"


def _build(target: Path) -> str | None:
    """Compile the source to ``target``, in a folder ``native_cache`` trusts (atomically:
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
            [compiler, *FLAGS, str(SOURCE), "-o", scratch], capture_output=True, text=True
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


class CpuDecodeAttention:
    """The loaded kernel: ``attend`` runs it on CPU tensors (see ``supports``)."""

    SYMBOLS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}

    def __init__(self, library: ctypes.CDLL):
        self._kernels = {}
        for dtype, name in self.SYMBOLS.items():
            function = getattr(library, name)
            function.argtypes, function.restype = _ARGTYPES, None
            self._kernels[dtype] = function
        self._write = library.write_kv_rows
        self._write.argtypes, self._write.restype = _WRITE_ARGTYPES, ctypes.c_int

    def supports_write(
        self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> bool:
        """Whether ``write_kv`` takes these: CPU tensors of one dtype, key and value ``[T, Hkv,
        D]`` with each row contiguous (rows may lie apart), contiguous caches alike."""
        return (
            key.device.type == "cpu"
            and key.dtype == value.dtype == k_cache.dtype == v_cache.dtype
            and key.shape == value.shape
            and key.dim() == 3
            and key.shape[1:] == k_cache.shape[2:]
            and k_cache.shape == v_cache.shape
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (key, value))
        )

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        slot_mapping: torch.Tensor,
    ) -> None:
        """As ``write_kv_ref``: token ``t``'s ``key``/``value`` rows to slot ``slot_mapping[t]``
        (int64; -1: skip) of the ``[num_blocks, block_size, Hkv, D]`` caches. The caller checks
        ``supports_write`` first. Raises IndexError for a slot outside the caches."""
        slots = slot_mapping.to(torch.int64).contiguous()
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        refused = self._write(
            key.data_ptr(),
            key.stride(0),
            value.data_ptr(),
            value.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slots.data_ptr(),
            key.shape[0],
            num_slots,
            key.shape[1] * key.shape[2],
            key.element_size(),
        )
        if refused:
            raise IndexError(f"{refused} slot(s) outside the cache's {num_slots}")

    def supports(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """Whether ``attend`` takes these: CPU tensors, fp32 or bf16 alike; q ``[T, Hq, D]``
        with each row's heads contiguous (rows may lie apart: a split of the q/k projection);
        the caches ``[num_blocks, block_size, Hkv, D]`` laid out alike, each block contiguous."""
        return (
            q.device.type == "cpu"
            and k_cache.device.type == "cpu"
            and q.dim() == 3
            and q.dtype in self._kernels
            and k_cache.dtype == q.dtype == v_cache.dtype
            and q.stride(2) == 1
            and q.stride(1) == q.shape[2]
            and k_cache.stride() == v_cache.stride()
            and k_cache.shape == v_cache.shape
            and k_cache[0].is_contiguous()
            and q.shape[1] % k_cache.shape[2] == 0
            and q.shape[2] == k_cache.shape[3]
        )

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        q_rows: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Sequence ``s``'s query row ``q[q_rows[s]]`` (``q_rows`` None: row ``s``) attends over its
        first ``seq_lens[s]`` cached tokens (the ``sliding_window`` latest when set).

        q: ``[T, Hq, D]``; k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``;
        block_tables: ``[S, max_blocks]`` int32; seq_lens: ``[S]`` int32; q_rows: ``[S]`` int64.
        Writes those rows of ``out`` (``[T, Hq, D]``, new when None) and returns it; other rows
        are left as they were. The caller checks ``supports`` first.
        """
        num_seqs = seq_lens.shape[0]
        _, block_size, kv_heads, head_dim = k_cache.shape
        block_tables = block_tables.to(torch.int32).contiguous()
        seq_lens = seq_lens.to(torch.int32).contiguous()
        if q_rows is not None:
            q_rows = q_rows.to(torch.int64).contiguous()
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype)
        self._kernels[q.dtype](
            q.data_ptr(),
            q.stride(0),
            None if q_rows is None else q_rows.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            k_cache.stride(0),
            k_cache.stride(1),
            block_size,
            kv_heads,
            q.shape[1] // kv_heads,
            head_dim,
            block_tables.data_ptr(),
            block_tables.stride(0),
            seq_lens.data_ptr(),
            num_seqs,
            scale,
            sliding_window or 0,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out


_loaded: dict[Path, CpuDecodeAttention | None] = {}


def _open(target: Path) -> tuple[CpuDecodeAttention | None, str | None]:
    """Load the library at ``target`` (checked by the caller): the kernel, or why not."""
    try:
        return CpuDecodeAttention(ctypes.CDLL(str(target))), None
    except (OSError, AttributeError) as error:
        return None, f"cannot load {target}: {error}"


def _load_cached(target: Path) -> tuple[CpuDecodeAttention | None, str | None]:
    """From a trusted ``target.parent``: the library there if it passes ``file_problem``, else
    one built over it (the folder is ours, so replacing a refused file is safe)."""
    if os.path.lexists(target):
        problem = file_problem(target)
        if problem is None:
            return _open(target)
        logger.warning("refusing the cached kernel (%s): rebuilding it", problem)
    reason = _build(target)
    if reason is None:
        reason = file_problem(target)
    return _open(target) if reason is None else (None, reason)


def _load_private(target: Path) -> tuple[CpuDecodeAttention | None, str | None]:
    """Build into a fresh private folder (``tempfile.mkdtemp``: 0700, an unpredictable name),
    load, and remove the folder (the loaded mapping outlives the file)."""
    folder = Path(tempfile.mkdtemp(prefix="paged-serve-native-"))
    try:
        private = folder / target.name
        reason = _build(private) or file_problem(private)
        return _open(private) if reason is None else (None, reason)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def load(cache_dir: Path) -> CpuDecodeAttention | None:
    """The kernel, built into ``cache_dir/native`` at first use (or, where that folder is not
    private to this user, into a temporary one; see ``kernels/cpu/native_cache.py``); None (and a
    log line, once) where it cannot be built or loaded here."""
    target = _library_path(cache_dir)
    if target in _loaded:
        return _loaded[target]
    problem = private_folder(target.parent, cache_dir)
    if problem is None:
        kernel, reason = _load_cached(target)
    else:
        logger.warning(
            "not using the kernel cache: %s; building in a private temporary folder", problem
        )
        kernel, reason = _load_private(target)
    if reason is not None:
        logger.warning("CPU decode attention kernel unavailable (%s): torch's path is used", reason)
    _loaded[target] = kernel
    return kernel
