"""The CPU's product of activations by 4- or 8-bit integer weights (``PackedInt``,
``engine/quant/weights.py``), reading the codes: the one-stream decode path of a checkpoint
stored quantized.

Decoding a few rows is bound by the weight bytes read per step; a 4-bit weight has 1/8 of fp32's
bytes, but torch can only dequantize it (all of it, per call) and multiply. ``int_gemm_f32``
(``int_gemm.c``) multiplies the codes in place instead, over OpenMP threads, for ``M`` rows::

    for each tile of 16 output columns (one thread's share of the tiles), group g, row m:
        dot     = x[m, g's inputs] . q[g's inputs, tile]          (fp32, 16 columns at once)
        y[m, tile] += scale[g, tile] * (dot - zero[g, tile] * sum(x[m, g's inputs]))

``repack`` lays the weight out for it once, at load. ``PackedInt.qweight [K / pack, N]`` holds, in
word ``(r, n)``, inputs ``r*pack .. r*pack+pack-1`` of column ``n`` (pack = 32 / bits), so a tile
of 16 columns at word row ``r`` is 64 contiguous bytes but the next row lies ``4N`` bytes on; the
tiled copy puts each tile's rows one after another, so each thread reads one contiguous stream::

    qweight [K/pack, N]          tiles [T, K/pack, 16]   (T = ceil(N / 16), N padded with code 0)
    ┌──────┬──────┬─ ─ ─┐         tile 0: ██ row 0 │ ██ row 1 │ ... │ ██ row K/pack-1
    │ t0 r0│ t1 r0│     │ ──►     tile 1: ██ row 0 │ ██ row 1 │ ...
    │ t0 r1│ t1 r1│     │         ...
    scales [G, N] ──► [T, G, 16] fp32     zeros [G, N] uint8 ──► [T, G, 16] (None stays None)

The words themselves are unchanged (the codes of a word stay 8 or 4 consecutive inputs of one
column), and ``unpack_tiles`` gives the ``PackedInt`` tensors back exactly. The padding costs at
most 15 columns.

Every output is an fp32 sum over K of exact integer codes times fp32 inputs, the zero and scale
applied once per group, so it equals the float64 product of the dequantized weight up to fp32
rounding (tests); bf16 inputs are widened by the caller. Measured speeds:
docs/measurements/cpu-kernels.md ("The 4- and 8-bit CPU product"). Built at first use as
``decode_attention.c`` is (``native_build.py``); where it cannot be, ``load`` returns None and the
caller keeps torch's dequantizing path.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from paged_serve.kernels.cpu.native_build import library_path, open_kernel

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int_gemm.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11")
LANES = 16  # output columns per tile (int_gemm.c's LANES)
BITS = (4, 8)

_I64, _I32, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_GEMM_ARGTYPES = [
    _PTR,  # x [M, K] fp32
    _I64,  # x's row stride (elements)
    _I32,  # M
    _I32,  # K
    _PTR,  # tiles [T, K / pack, LANES] int32
    _PTR,  # scales [T, G, LANES] fp32
    _PTR,  # zeros [T, G, LANES] uint8, or NULL
    _I32,  # N
    _I32,  # bits
    _I32,  # group_size (K for one group)
    _PTR,  # bias [N] fp32, or NULL
    _PTR,  # y [M, N] fp32
    _I64,  # y's row stride (elements)
    _I32,  # num_threads
]


@dataclass(frozen=True, slots=True)
class TiledInt:
    """A ``PackedInt``'s codes, scales and zeros in the kernel's tiles (module docstring) for a
    projection of ``in_features`` inputs and ``out_features`` outputs."""

    tiles: torch.Tensor  # [T, K / pack, LANES] int32
    scales: torch.Tensor  # [T, G, LANES] fp32
    zeros: torch.Tensor | None  # [T, G, LANES] uint8; None: 2^(bits-1)
    bits: int
    group_size: int  # inputs per group, resolved (one group: K)
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        parts = (self.tiles, self.scales, self.zeros)
        return sum(p.numel() * p.element_size() for p in parts if p is not None)


def _to_tiles(t: torch.Tensor) -> torch.Tensor:
    """``[R, N]`` -> ``[ceil(N / LANES), R, LANES]``, N padded with zeros."""
    rows, n = t.shape
    pad = -n % LANES
    if pad:
        t = torch.cat([t, t.new_zeros(rows, pad)], dim=1)
    return t.view(rows, -1, LANES).transpose(0, 1).contiguous()


def _from_tiles(t: torch.Tensor, n: int) -> torch.Tensor:
    """``_to_tiles`` undone: ``[T, R, LANES]`` -> ``[R, n]``."""
    return t.transpose(0, 1).reshape(t.shape[1], -1)[:, :n].contiguous()


def repack(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    *,
    bits: int,
    group_size: int,
) -> TiledInt:
    """The tiles of ``PackedInt``'s ``qweight [K / pack, N]`` int32, ``scales [G, N]`` and
    ``zeros [G, N]`` uint8 (or None) with ``group_size`` inputs a group (-1: one group).
    ValueError for bits other than 4 and 8, or groups that do not split K into whole words."""
    if bits not in BITS:
        raise ValueError(f"bits={bits}: the CPU kernel reads {BITS}-bit codes")
    pack = 32 // bits
    words, n = qweight.shape
    k = words * pack
    size = k if group_size == -1 else group_size
    if size <= 0 or k % size or size % pack:
        raise ValueError(
            f"group_size={group_size} does not split K={k} into groups of whole {pack}-code words"
        )
    if scales.shape != (k // size, n) or (zeros is not None and zeros.shape != scales.shape):
        raise ValueError(
            f"scales {tuple(scales.shape)} / zeros {None if zeros is None else tuple(zeros.shape)}"
            f" do not match [{k // size}, {n}]"
        )
    return TiledInt(
        tiles=_to_tiles(qweight.to(torch.int32)),
        scales=_to_tiles(scales.to(torch.float32)),
        zeros=None if zeros is None else _to_tiles(zeros.to(torch.uint8)),
        bits=bits,
        group_size=size,
        out_features=n,
        in_features=k,
    )


def unpack_tiles(tiled: TiledInt) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(qweight, scales, zeros)`` in ``PackedInt``'s layout: ``repack`` undone, exactly."""
    n = tiled.out_features
    zeros = None if tiled.zeros is None else _from_tiles(tiled.zeros, n)
    return _from_tiles(tiled.tiles, n), _from_tiles(tiled.scales, n), zeros


class CpuIntGemm:
    """The loaded kernel: ``matmul`` by a ``TiledInt``."""

    def __init__(self, library: ctypes.CDLL):
        self._gemm = library.int_gemm_f32
        self._gemm.argtypes, self._gemm.restype = _GEMM_ARGTYPES, ctypes.c_int

    def matmul(
        self, x: torch.Tensor, weight: TiledInt, *, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ W^T + bias`` in fp32: x ``[M, in_features]`` fp32 or bf16 (widened) on the CPU,
        bias ``[out_features]`` or None; returns ``[M, out_features]`` fp32. ValueError for other
        shapes, dtypes or devices; MemoryError when the kernel's scratch cannot be allocated."""
        if x.dim() != 2 or x.shape[1] != weight.in_features or x.device.type != "cpu":
            raise ValueError(
                f"x {tuple(x.shape)} on {x.device}: expected [M, {weight.in_features}] on the CPU"
            )
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"x is {x.dtype}: the kernel reads fp32 (or bf16, widened)")
        if bias is not None and bias.shape != (weight.out_features,):
            raise ValueError(f"bias {tuple(bias.shape)}: expected [{weight.out_features}]")
        x = x.float()
        if x.stride(1) != 1:
            x = x.contiguous()
        if bias is not None:
            bias = bias.float().contiguous()
        y = torch.empty(x.shape[0], weight.out_features)
        if x.shape[0] == 0:
            return y if bias is None else y + bias
        failed = self._gemm(
            x.data_ptr(),
            x.stride(0),
            x.shape[0],
            weight.in_features,
            weight.tiles.data_ptr(),
            weight.scales.data_ptr(),
            None if weight.zeros is None else weight.zeros.data_ptr(),
            weight.out_features,
            weight.bits,
            weight.group_size,
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            y.stride(0),
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("int_gemm_f32 could not allocate its scratch")
        return y


_loaded: dict[Path, CpuIntGemm | None] = {}


def load(cache_dir: Path) -> CpuIntGemm | None:
    """The kernel, built into ``cache_dir/native`` at first use (``native_build.py``); None (and a
    log line, once) where it cannot be built or loaded here."""
    target = library_path(cache_dir, "cpu_int_gemm", SOURCE, FLAGS)
    if target in _loaded:
        return _loaded[target]
    kernel, reason = open_kernel(cache_dir, target, source=SOURCE, flags=FLAGS, wrap=CpuIntGemm)
    if reason is not None:
        logger.warning("CPU integer GEMM kernel unavailable (%s): torch's path is used", reason)
    _loaded[target] = kernel
    return kernel
