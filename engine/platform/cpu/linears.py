"""The projections' CPU kernels: what ``F.linear`` leaves on the table, taken back.

Decoding reads every weight once per step, so at a few rows a projection is a matrix-vector
product bounded by memory bandwidth, and the kernel that multiplies decides the step time. The
swaps compute what ``F.linear`` computes (bf16 bit for bit to 32 rows, otherwise up to the
order of the sums):

**fp32: the few-row kernel measured faster on this CPU, a packed copy for more rows**
(``Fp32Linear``). torch's fp32 ``F.linear`` (MKL) runs a few-row product on one core on some
CPUs (2.3-4.2x slower than either kernel below at 1 row on this project's AMD box). Two
kernels use every core, and which of them streams an fp32 weight faster at 1 to ``FEW_ROWS``
rows depends on the CPU (docs/measurements/cpu-kernels.md, "The CPU projections"):

* ``columns``: the weight's output rows split into one contiguous block per thread of torch's
  CPU ``bmm``, each block multiplying the inputs as columns::

      W [N, K] ──view──► [W₀ ; W₁]                 core 0: W₀ @ xᵀ ─┐
      (no copy: a view of the contiguous weight)   core 1: W₁ @ xᵀ ─┴─► [M, N]

  laid out densely as ``[M, N]`` afterwards (the Triton kernels and the row-parallel
  all-reduce read rows in memory order);
* ``packed``: oneDNN on a copy of the weight packed once at load into its blocked layout.

So ``choose_few_row_kernels`` times both at 1, 2 and 3 rows over the model's own projections
at load (weights read from memory, not cache: a pass covers at least ``CALIBRATION_BYTES`` of
them; each kernel's best of 5 passes, taken in turn) and keeps the faster per row count,
``packed`` unless ``columns`` is 10 % faster; it is logged at start. (Models with less than
``CALIBRATION_BYTES`` of fp32 projections, such as the tests' tiny ones, keep ``packed``: their
weights stay in cache, so no timing of them says anything. ``F.linear`` is not a candidate: a
load-time pass of it, on one core, timed up to 1.9x faster than it then ran, and picking it
made a decode step 2.9x slower.) From ``FEW_ROWS + 1`` rows (decode batches, prefill chunks)
the packed copy multiplies, which beat the column split from 4 rows on every box measured. The
cost is memory: fp32 projections are held twice (the plain weight, which a tied LM head shares
with the embedding, and the packed copy).

Every output element is still an fp32 dot product over the same ``K`` inputs; only the order of
its partial sums differs from ``F.linear``'s, as it already differs in ``F.linear`` between row
counts. So the outputs stay within fp32's rounding bound of the exact product, as
``F.linear``'s do (tests, for each kernel), and the greedy tokens still equal Hugging Face's
(tests, and the benchmarks' checks on the default model).

**bf16: weights packed once for oneDNN** (``PackedLinear``). bf16 ``F.linear`` goes to oneDNN,
which reorders the weight into its blocked layout on every call: a second pass over the weight
bytes. ``torch.ops.mkldnn._reorder_linear_weight`` does it once at load and
``_linear_pointwise`` multiplies by the packed weight; the result equals ``F.linear`` bit for
bit to 32 rows (tests). Past them oneDNN may run the unpacked product through another kernel
(AMX tiles on an Intel box with ``amx_bf16``) that sums in another order, so outputs can differ
by one bf16 rounding, each within the rounding bound of the exact product (tests). The packed
copy replaces the weight (a tied LM head's packed copy sits beside the embedding, which the
lookup still reads). Where oneDNN has no bf16 path (an AVX2-only CPU: ``packable``,
engine/model/packed_weights.py) bf16 projections stay ``nn.Linear``.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from paged_serve.engine.model.fused_projections import linear_from
from paged_serve.engine.model.linear_swap import swap_linears
from paged_serve.engine.model.packed_weights import PackedWeights, pack, packable, packed_linear

logger = logging.getLogger(__name__)

FEW_ROWS = 3  # up to this many rows, the kernel chosen at load; more: the packed copy
FEW_ROW_KERNELS = ("columns", "packed")
PACKED_ROWS_HINT = 8  # the row count oneDNN lays the fp32 copy out for (best of 1, 8, 64)
CALIBRATION_BYTES = 256 << 20  # weights one timed pass reads: well past any CPU cache
CALIBRATION_PASSES = 5  # timed passes per (kernel, rows), after one warm-up; the best counts
CALIBRATION_MARGIN = 0.1  # how much faster than ``packed`` another kernel must be to be chosen


class Fp32Linear(nn.Module):
    """``y = x @ weight.T + bias`` for fp32 ``x [..., in_features]``: ``rows`` rows through
    ``few_row_kernels[rows - 1]`` (one of ``FEW_ROW_KERNELS``; ``FEW_ROWS`` of them), more
    through oneDNN on a packed copy.

    Holds the original ``weight [out, in]`` and ``bias [out]`` Parameters themselves (a tied LM
    head stays tied) and an opaque packed copy; ``columns`` splits the outputs into ``blocks``
    (the thread count at load) and needs them to divide ``out_features``.
    """

    DERIVED = ("_blocks", "_bias_blocks", "_packed")  # from the Parameters: not copied

    def __init__(self, linear: nn.Linear, blocks: int):
        super().__init__()
        if not linear.weight.is_contiguous():
            raise ValueError("the weight must be contiguous to be viewed as row blocks")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.blocks = blocks if blocks > 1 and linear.out_features % blocks == 0 else 0
        self.weight = linear.weight
        self.bias = linear.bias
        self.few_row_kernels: tuple[str, ...] = ("packed",) * FEW_ROWS
        self._derive()

    @property
    def kernels(self) -> tuple[str, ...]:
        """The few-row kernels this module can run (``columns`` only with ``blocks``)."""
        return tuple(k for k in FEW_ROW_KERNELS if k != "columns" or self.blocks)

    def _derive(self) -> None:
        """Views of the Parameters themselves (plain attributes, so state_dict and the tie see
        only the Parameters): [blocks, N/blocks, K], the bias [blocks, N/blocks, 1]; and the
        packed copy."""
        weight, bias = self.weight.detach(), self.bias
        self._blocks = weight.view(self.blocks, -1, self.in_features) if self.blocks else None
        if bias is None or not self.blocks:
            self._bias_blocks = None
        else:
            self._bias_blocks = bias.detach().view(self.blocks, -1, 1)
        self._packed = pack(self.weight, PACKED_ROWS_HINT)

    def __getstate__(self) -> dict[str, object]:
        """Deep copies and pickles carry the Parameters only (the packed copy is opaque to
        both, and a copied view would no longer view the copied weight)."""
        return {k: v for k, v in self.__dict__.items() if k not in self.DERIVED}

    def __setstate__(self, state: dict[str, object]) -> None:
        super().__setstate__(state)
        self._derive()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        count = rows.shape[0]
        kernels = self.few_row_kernels
        kernel = kernels[count - 1] if 0 < count <= len(kernels) else "packed"
        if kernel == "packed":
            y = torch.ops.mkldnn._linear_pointwise(rows, self._packed, self.bias, "none", [], "")
            return y.view(*x.shape[:-1], self.out_features)
        columns = rows.expand(self.blocks, *rows.shape).mT  # [blocks, K, M], no copy
        if self._bias_blocks is None:
            y = torch.bmm(self._blocks, columns)
        else:
            y = torch.baddbmm(self._bias_blocks, self._blocks, columns)
        # [blocks, N/blocks, M] -> [M, N], laid out densely: consumers (the Triton kernels, an
        # all-reduce) read rows in memory order.
        return y.permute(2, 0, 1).reshape(*x.shape[:-1], self.out_features).contiguous()


class PackedLinear(PackedWeights, nn.Module):
    """``y = x @ weight.T + bias`` for ``x [..., in_features]`` through oneDNN, with the weight
    packed once (bf16 on the CPU). Equal to ``F.linear`` bit for bit to 32 rows, to one bf16
    rounding past them."""

    PACKED = ("packed",)
    PACKED_ROWS = 1

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # An opaque oneDNN tensor, not a Parameter: nothing but this module can read it.
        self.packed = pack(linear.weight, self.PACKED_ROWS)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


@torch.inference_mode()
def pass_ms(modules: list[Fp32Linear], kernel: str, inputs: dict[int, torch.Tensor]) -> float:
    """ms of one product of ``inputs[in_features]`` (``[rows, in_features]``) through every
    module with ``kernel``, which the modules keep afterwards for every row count up to
    ``rows`` (or ``FEW_ROWS``)."""
    rows = next(iter(inputs.values())).shape[0]
    for m in modules:
        m.few_row_kernels = (kernel,) * max(rows, FEW_ROWS)
    start = time.perf_counter()
    for m in modules:
        m(inputs[m.in_features])
    return 1e3 * (time.perf_counter() - start)


def choose_few_row_kernels(modules: list[Fp32Linear]) -> dict[int, dict[str, float]]:
    """Give every module, per row count 1..``FEW_ROWS``, the kernel of ``FEW_ROW_KERNELS``
    (that all of them can run) with the fastest pass over the first modules holding
    ``CALIBRATION_BYTES`` of weights (all of them if fewer); ``packed`` unless another is
    ``CALIBRATION_MARGIN`` faster (and no timing where only one kernel is possible). Each
    kernel's time is its best of ``CALIBRATION_PASSES`` passes taken in turn with the others'
    after a warm-up, since a busy machine only ever slows a pass. Returns the timings, ms per
    kernel per row count (empty where nothing was timed)."""
    sample, held = [], 0
    for m in modules:
        sample.append(m)
        held += m.weight.numel() * m.weight.element_size()
        if held >= CALIBRATION_BYTES:
            break
    candidates = [k for k in FEW_ROW_KERNELS if all(k in m.kernels for m in sample)]
    timings: dict[int, dict[str, float]] = {}
    if len(candidates) == 1:  # nothing to choose between (one thread: no column split)
        for m in modules:
            m.few_row_kernels = (candidates[0],) * FEW_ROWS
        return timings
    for rows in range(1, FEW_ROWS + 1):
        inputs = {m.in_features: torch.randn(rows, m.in_features) for m in sample}
        for kernel in candidates:
            pass_ms(sample, kernel, inputs)  # warm-up
        best = dict.fromkeys(candidates, float("inf"))
        for _ in range(CALIBRATION_PASSES):
            for kernel in candidates:
                best[kernel] = min(best[kernel], pass_ms(sample, kernel, inputs))
        timings[rows] = best
    chosen = tuple(pick(timings[rows]) for rows in range(1, FEW_ROWS + 1))
    for m in modules:
        m.few_row_kernels = chosen
    return timings


def pick(best: dict[str, float]) -> str:
    """The fastest kernel of ``best`` (ms each); ``packed`` unless that one is
    ``CALIBRATION_MARGIN`` faster."""
    fastest = min(best, key=best.__getitem__)
    if "packed" in best and best[fastest] > (1 - CALIBRATION_MARGIN) * best["packed"]:
        return "packed"
    return fastest


def _swap_for(linear: nn.Linear, blocks: int) -> nn.Module | None:
    """The faster module computing what ``linear`` does, or None to keep it."""
    if linear.weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if linear.weight.dtype == torch.float32 and linear.weight.is_contiguous():
        return Fp32Linear(linear, blocks)
    if linear.weight.dtype == torch.bfloat16 and packable(torch.bfloat16):
        return PackedLinear(linear)
    return None


@torch.no_grad()
def speed_up_cpu_linears(model: nn.Module) -> int:
    """Swap the decoder layers' and the LM head's CPU ``nn.Linear``s for their faster equals,
    in place: fp32 ones for ``Fp32Linear`` (``columns`` over ``torch.get_num_threads()``
    blocks), their few-row kernels chosen by ``choose_few_row_kernels`` and logged (``packed``
    where they hold less than ``CALIBRATION_BYTES``: in cache, no timing tells how they decode
    from memory); bf16 ones for ``PackedLinear``. Returns how many were swapped; other dtypes,
    devices and module types are left alone."""
    count = swap_linears(model, lambda linear: _swap_for(linear, torch.get_num_threads()))
    fp32 = [m for m in model.modules() if isinstance(m, Fp32Linear)]
    held = sum(m.weight.numel() * m.weight.element_size() for m in fp32)
    if held < CALIBRATION_BYTES:  # the weights fit in cache: a timing would say nothing
        return count
    timings = choose_few_row_kernels(fp32)
    if not timings:
        return count
    logger.info(
        "fp32 projections at 1 to %d rows: %s (best ms a pass: %s)",
        FEW_ROWS,
        ", ".join(fp32[0].few_row_kernels),
        "; ".join(
            " ".join(f"{k} {ms:.2f}" for k, ms in per_kernel.items())
            for per_kernel in timings.values()
        ),
    )
    return count


@torch.no_grad()
def restore_plain_linears(model: nn.Module) -> int:
    """Undo ``speed_up_cpu_linears`` in place, each swapped module back to a plain ``nn.Linear``
    with the same weights (tensor parallelism shards plain ones); returns how many."""
    count = 0
    for owner in list(model.modules()):
        for name, child in list(owner.named_children()):
            if isinstance(child, Fp32Linear):
                setattr(owner, name, linear_from(child.weight, child.bias))
            elif isinstance(child, PackedLinear):
                setattr(owner, name, linear_from(child.packed.to_dense(), child.bias))
            else:
                continue
            count += 1
    return count
