"""The CPU engine's attention kernels of our own, in C: decode rows read the paged KV cache in
place, and the step's new K/V rows are written to their slots.

Triton kernels need a GPU (or the interpreter, far too slow to serve), so the CPU engine attends
with torch (``engine/platform/cpu/attention.py``): per layer it gathers each sequence's K and V
blocks
into a dense copy and calls ``F.scaled_dot_product_attention``. For decode rows (one query token
per sequence) the copy, the call's dispatch and its many small tiles cost more than the
arithmetic. ``paged_decode_*`` (``cpu_decode_attention.c``) attends each sequence's decode row
straight from its cache blocks, rows spread over torch's OpenMP threads (a row of more than
1,024 positions in fixed 1,024-token pieces, merged in order after)::

    for each sequence s (or piece of one: one thread's work), token p (block table order):
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

The C source is compiled at first use with the system's C compiler, for this CPU, into
``<cache_dir>/native`` (about 0.4 s once; ``kernels/cpu/native_build.py``: keyed by the source,
the flags and this CPU's features, opened only from a folder and file private to this user).
The library links libgomp by its soname, which resolves to the copy torch has loaded: one
OpenMP runtime, one thread pool. Where no compiler is found or the build fails, ``load`` returns
None and says why once; callers then keep torch's path.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from paged_serve.kernels.cpu.native_build import library_path, open_kernel

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
    _I32,  # attention chunk (0: none)
    _PTR,  # out [T, Hq, D]
    _I32,  # num_threads
    _PTR,  # k_scales [num_blocks, block_size, Hkv] fp32, or NULL
    _PTR,  # v_scales, or NULL
    _I32,  # fp8 codes: e5m2 (1) or e4m3 (0)
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


def _library_path(cache_dir: Path) -> Path:
    return library_path(cache_dir, "cpu_decode_attention", SOURCE, FLAGS)


class CpuDecodeAttention:
    """The loaded kernel: ``attend`` runs it on CPU tensors (see ``supports``)."""

    # (query dtype, what the cache holds: values or int8 / fp8 codes) -> the kernel
    SYMBOLS = {
        (torch.float32, "values"): "paged_decode_f32",
        (torch.bfloat16, "values"): "paged_decode_bf16",
        (torch.float32, "int8"): "paged_decode_int8_f32",
        (torch.bfloat16, "int8"): "paged_decode_int8_bf16",
        (torch.float32, "fp8"): "paged_decode_fp8_f32",
        (torch.bfloat16, "fp8"): "paged_decode_fp8_bf16",
    }

    def __init__(self, library: ctypes.CDLL):
        self._kernels = {}
        for key, name in self.SYMBOLS.items():
            function = getattr(library, name)
            function.argtypes, function.restype = _ARGTYPES, None
            self._kernels[key] = function
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

    def supports(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> bool:
        """Whether ``attend`` takes these: CPU tensors, fp32 or bf16 alike; q ``[T, Hq, D]``
        with each row's heads contiguous (rows may lie apart: a split of the q/k projection);
        the caches ``[num_blocks, block_size, Hkv, D]`` laid out alike, each block contiguous.
        With ``scales`` (K's and V's ``[num_blocks, block_size, Hkv]`` fp32) the caches hold
        one-byte codes (int8 or fp8) and the scales are laid out as the codes without their
        ``D`` lanes."""
        if scales is not None and not _scales_fit(k_cache, v_cache, scales):
            return False
        values = q.dtype if scales is None else k_cache.dtype
        return (
            q.device.type == "cpu"
            and k_cache.device.type == "cpu"
            and q.dim() == 3
            and (q.dtype, _holds(k_cache, scales)) in self._kernels
            and k_cache.dtype == values == v_cache.dtype
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
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_chunk: int | None = None,
    ) -> torch.Tensor:
        """Sequence ``s``'s query row ``q[q_rows[s]]`` (``q_rows`` None: row ``s``) attends over its
        first ``seq_lens[s]`` cached tokens (the ``sliding_window`` latest when set; with
        ``attention_chunk`` C none before its chunk's start ``(seq_lens[s] - 1) // C * C``).

        q: ``[T, Hq, D]``; k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``;
        block_tables: ``[S, max_blocks]`` int32; seq_lens: ``[S]`` int32; q_rows: ``[S]`` int64;
        scales: a cache of codes' K and V scales (``supports``). Writes those rows of ``out``
        (``[T, Hq, D]``, new when None) and returns it; other rows are left as they were. The
        caller checks ``supports`` first.
        """
        num_seqs = seq_lens.shape[0]
        _, block_size, kv_heads, head_dim = k_cache.shape
        block_tables = block_tables.to(torch.int32).contiguous()
        seq_lens = seq_lens.to(torch.int32).contiguous()
        if q_rows is not None:
            q_rows = q_rows.to(torch.int64).contiguous()
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype)
        self._kernels[q.dtype, _holds(k_cache, scales)](
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
            attention_chunk or 0,
            out.data_ptr(),
            torch.get_num_threads(),
            None if scales is None else scales[0].data_ptr(),
            None if scales is None else scales[1].data_ptr(),
            int(k_cache.dtype == torch.float8_e5m2),
        )
        return out


def _holds(cache: torch.Tensor, scales: tuple | None) -> str:
    """What ``cache`` holds, as ``SYMBOLS`` names it: values, or int8 or fp8 codes."""
    if scales is None:
        return "values"
    return "int8" if cache.dtype == torch.int8 else "fp8"


def _scales_fit(
    k_cache: torch.Tensor, v_cache: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor]
) -> bool:
    """Codes of one byte whose scales are laid out as they are without their ``D`` lanes."""
    head_dim = k_cache.shape[3]
    return k_cache.element_size() == 1 and all(
        s.dtype == torch.float32
        and s.device.type == "cpu"
        and s.shape == cache.shape[:3]
        and s.stride(2) == 1
        and all(s.stride(i) * head_dim == cache.stride(i) for i in range(3))
        for s, cache in zip(scales, (k_cache, v_cache))
    )


_loaded: dict[Path, CpuDecodeAttention | None] = {}


def load(cache_dir: Path) -> CpuDecodeAttention | None:
    """The kernel, built into ``cache_dir/native`` at first use (or, where that folder is not
    private to this user, into a temporary one; see ``kernels/cpu/native_cache.py``); None (and a
    log line, once) where it cannot be built or loaded here."""
    target = _library_path(cache_dir)
    if target in _loaded:
        return _loaded[target]
    kernel, reason = open_kernel(
        cache_dir, target, source=SOURCE, flags=FLAGS, wrap=CpuDecodeAttention
    )
    if reason is not None:
        logger.warning("CPU decode attention kernel unavailable (%s): torch's path is used", reason)
    _loaded[target] = kernel
    return kernel
