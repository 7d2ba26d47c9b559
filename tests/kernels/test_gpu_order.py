"""The tree-order mode really changes the interpreter's order, and only the order.

Its scans and reductions must agree with numpy on exact (integer) data, differ from the
sequential order on float data where association matters, and be active inside jitted kernels
(``tl.sum``, ``tl.cumsum``, ``tl.argmax``) for exactly the duration of ``reduction_order``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from tests.kernels.gpu_order import reduction_order, tree_cumsum, tree_reduce

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="emulates a GPU's order under the interpreter"
)


def _add(left, right):
    return (left[0] + right[0],)


def test_tree_orders_are_exact_on_integers():
    data = np.arange(64, dtype=np.int64).reshape(4, 16) ** 2
    assert np.array_equal(tree_cumsum(data, 1), np.cumsum(data, 1))
    assert np.array_equal(tree_cumsum(data, 0), np.cumsum(data, 0))
    assert np.array_equal(tree_reduce((data,), 1, _add)[0], data.sum(1))


def test_tree_orders_associate_differently():
    # 1 + 2^-24 + 2^-24 + ...: sequentially each tiny term is rounded away; the tree pairs the
    # tiny terms first, so their sum survives.
    x = np.full(16, 2.0**-24, dtype=np.float32)
    x[0] = 1.0
    assert np.cumsum(x)[-1] == 1.0
    assert tree_cumsum(x, 0)[-1] > 1.0
    assert tree_reduce((x,), 0, _add)[0] > 1.0
    # Hillis-Steele: step 1 adds neighbours, step 2 pairs of pairs, ...
    assert tree_cumsum(np.arange(8.0), 0).tolist() == np.cumsum(np.arange(8.0)).tolist()


@triton.jit
def _reductions_kernel(x_ptr, sum_ptr, last_cum_ptr, argmax_ptr, N: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N))
    tl.store(sum_ptr, tl.sum(x, 0))
    tl.store(last_cum_ptr, tl.sum(tl.where(tl.arange(0, N) == N - 1, tl.cumsum(x, 0), 0.0), 0))
    tl.store(argmax_ptr, tl.argmax(x, 0, tie_break_left=True))


def _run(x: torch.Tensor) -> tuple[float, float, int]:
    out = torch.empty(2)
    arg = torch.empty(1, dtype=torch.int32)
    _reductions_kernel[(1,)](x, out, out[1:], arg, N=x.numel())
    return out[0].item(), out[1].item(), arg.item()


def test_kernels_see_the_tree_order_only_inside_the_block():
    x = torch.full((16,), 2.0**-24)
    x[0] = 1.0
    with reduction_order("sequential"):  # whatever order the session runs in
        sequential = _run(x)
        assert sequential[1] == 1.0  # np.cumsum: left to right
        with reduction_order("tree"):
            tree = _run(x)
            with reduction_order("sequential"):
                assert _run(x) == sequential  # nested blocks restore what was active
            assert _run(x) == tree
        assert _run(x) == sequential
    assert tree[0] > 1.0 and tree[1] > 1.0
    assert tree[2] == sequential[2] == 0


def test_argmax_with_nan_follows_the_combine_rule():
    """Triton's argmax combine keeps the right operand whenever a NaN is compared, so the index
    a NaN row returns depends on where the NaN meets the tree (the GPU behaviour the sampler
    must not rely on); the interpreter's own argmax skips NaN.
    """
    picks = {}
    for nan_at in (11, 15):
        x = torch.zeros(16)
        x[3] = 5.0
        x[nan_at] = float("nan")
        with reduction_order("sequential"):
            assert _run(x)[2] == 3
        with reduction_order("tree"):
            picks[nan_at] = _run(x)[2]
    assert picks == {11: 0, 15: 15}  # neither the max nor the NaN; the NaN


def test_unknown_order_is_refused():
    with pytest.raises(ValueError, match="reduction order"):
        with reduction_order("reverse"):
            pass
