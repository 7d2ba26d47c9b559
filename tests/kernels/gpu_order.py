"""Run the interpreter's reductions and scans in a GPU's tree order instead of sequentially.

Triton's interpreter evaluates ``tl.sum``/``tl.max``/``tl.argmax`` with numpy (sequential or
numpy's own pairwise order) and ``tl.cumsum`` with ``np.cumsum`` (strictly left to right). A
compiled kernel does neither: a reduction adds each thread's elements, then combines lanes with
butterfly shuffles (``shfl.sync.bfly`` by 16, 8, 4, 2, 1) and warps through shared memory, and a
scan is a warp-shuffle scan (``shfl.sync.up`` by 1, 2, 4, 8, ...: Hillis-Steele). Float sums
then round differently, so kernel logic that silently needs one particular order (``total -
cum[d] == 0`` for the highest non-empty bin, say) passes under the interpreter and fails on a
GPU. ``reduction_order("tree")`` swaps in those orders:

* reductions along an axis of ``n`` elements combine ``x[i]`` with ``x[i + n/2]``, then the
  ``n/2`` results likewise, down to one (each element on its own lane, combined by a butterfly;
  the left operand is the lower index, as on lane 0). Sums add in that tree; ``max``/``min``
  ignore NaN as PTX ``max.f32`` does; ``argmax``/``argmin`` apply Triton's own combine rule
  (``v1 > v2`` or an equal value with a lower index), so a NaN's fate depends on the tree, as
  on a GPU.
* ``cumsum`` is the inclusive Hillis-Steele scan: ``x[i] += x[i - s]`` for ``s = 1, 2, 4, ...``.

This is *a* GPU order, not bit-exact with every layout (a thread holding several elements adds
them sequentially first); its job is to be a second, realistic order, so a test that passes in
both orders does not depend on either. Combine functions other than these keep the
interpreter's order.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import numpy as np
import triton.language as tl
from triton.runtime import interpreter

ORDERS = ("sequential", "tree")

Combine = Callable[[tuple[np.ndarray, ...], tuple[np.ndarray, ...]], tuple[np.ndarray, ...]]


def _argbest(better: Callable[[np.ndarray, np.ndarray], np.ndarray], tie_left: bool) -> Combine:
    """Triton's ``_argmax_combine``/``_argmin_combine`` on arrays (left operand first)."""

    def combine(left, right):
        (v1, i1), (v2, i2) = left, right
        take_left = better(v1, v2)
        if tie_left:
            take_left = take_left | ((v1 == v2) & (i1 < i2))
        return np.where(take_left, v1, v2), np.where(take_left, i1, i2)

    return combine


@functools.cache
def _combines() -> dict:
    """Triton's combine functions this module knows, by identity, as array combines."""
    by_name = {
        "_sum_combine": lambda a, b: (a[0] + b[0],),
        "_elementwise_max": lambda a, b: (np.fmax(a[0], b[0]),),
        "_elementwise_min": lambda a, b: (np.fmin(a[0], b[0]),),
        "_argmax_combine_tie_break_left": _argbest(np.greater, True),
        "_argmax_combine_tie_break_fast": _argbest(np.greater, False),
        "_argmin_combine_tie_break_left": _argbest(np.less, True),
        "_argmin_combine_tie_break_fast": _argbest(np.less, False),
    }
    std = tl.standard
    return {getattr(std, n): f for n, f in by_name.items() if hasattr(std, n)}


def tree_reduce(arrays: tuple[np.ndarray, ...], axis: int, combine: Combine) -> tuple:
    """Reduce ``arrays`` (same shape) along ``axis`` in butterfly order; the axis is dropped."""
    parts = tuple(np.moveaxis(a, axis, 0) for a in arrays)
    while parts[0].shape[0] > 1:
        n = parts[0].shape[0]
        half = n // 2
        merged = combine(tuple(p[:half] for p in parts), tuple(p[half : 2 * half] for p in parts))
        if n % 2:  # not reached for Triton's power-of-two shapes; kept for generality
            merged = tuple(np.concatenate([m, p[2 * half :]]) for m, p in zip(merged, parts))
        parts = tuple(np.asarray(m) for m in merged)
    return tuple(p[0] for p in parts)


def tree_cumsum(data: np.ndarray, axis: int) -> np.ndarray:
    """Inclusive prefix sum along ``axis`` in Hillis-Steele (shuffle-up) order."""
    x = np.moveaxis(np.array(data, copy=True), axis, 0)
    shift = 1
    while shift < x.shape[0]:
        x = np.concatenate([x[:shift], x[shift:] + x[:-shift]])
        shift *= 2
    return np.moveaxis(x, 0, axis)


def _tree_reduce_impl(original):
    def apply_impl(self, input):
        combine = _combines().get(self.combine_fn)
        arity = 2 if self.combine_fn.__name__.startswith("_arg") else 1  # (value, index) pairs
        if combine is None or len(input) != arity:
            return original(self, input)
        datas = [t.handle.data for t in input]
        axis = self.axis
        if axis is None:
            datas, axis = [d.reshape(-1) for d in datas], 0
        out = tree_reduce(tuple(datas), axis, combine)
        ret = []
        for value, t in zip(out, input):
            if self.keep_dims and self.axis is None:
                value = np.reshape(value, (1,) * t.handle.data.ndim)
            elif self.keep_dims:
                value = np.expand_dims(value, axis)
            ret.append(self.to_tensor(value, t.dtype))
        return ret

    return apply_impl


def _tree_scan_impl(original):
    def apply_impl(self, input):
        if self.combine_fn is not tl.standard._sum_combine or len(input) != 1:
            return original(self, input)
        data = input[0].handle.data
        if self.reverse:
            data = np.flip(data, axis=self.axis)
        out = tree_cumsum(data, self.axis)
        if self.reverse:
            out = np.flip(out, axis=self.axis)
        return [self.to_tensor(np.ascontiguousarray(out), input[0].dtype)]

    return apply_impl


@functools.cache
def _implementations() -> dict[str, tuple]:
    """(reduce, scan) implementations per order; the interpreter's own, read on first use."""
    reduce_impl, scan_impl = interpreter.ReduceOps.apply_impl, interpreter.ScanOps.apply_impl
    tree = (_tree_reduce_impl(reduce_impl), _tree_scan_impl(scan_impl))
    return {"sequential": (reduce_impl, scan_impl), "tree": tree}


@contextlib.contextmanager
def reduction_order(order: str) -> Iterator[None]:
    """Inside the block, interpreted kernels reduce and scan in ``order``.

    ``sequential``: the interpreter's own order; ``tree``: the GPU tree order described above.
    Blocks nest: leaving one restores the order that was active before it.
    """
    if order not in ORDERS:
        raise ValueError(f"reduction order must be one of {ORDERS}, got {order!r}")
    reduce_impl, scan_impl = _implementations()[order]
    saved = (interpreter.ReduceOps.apply_impl, interpreter.ScanOps.apply_impl)
    interpreter.ReduceOps.apply_impl = reduce_impl
    interpreter.ScanOps.apply_impl = scan_impl
    try:
        yield
    finally:
        interpreter.ReduceOps.apply_impl, interpreter.ScanOps.apply_impl = saved
