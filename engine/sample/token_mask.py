"""The per-step grammar mask: which tokens each constrained row may sample.

Row ``i`` of the mask is ``int32 [ceil(V / 32)]``: token ``t`` is allowed when bit ``t % 32`` of
word ``t // 32`` is set. Unconstrained rows in a mixed batch are all ones; a batch with no
constrained row gets no mask at all, so it pays nothing.

Filling a row walks the row's grammar state, and some grammars make that walk grow with the
output (``root ::= w w ... w`` with ``w ::= [^"]*``: 8 ms at the first token, 0.8 s by the
twelfth). ``MaskFiller`` therefore fills rows on its own threads while the engine thread runs
the forward (xgrammar releases the GIL while it fills), and gives each row a budget: a row
whose fill is still running ``fill_timeout_s`` after the forward, or whose fill took longer
than that, is handed back as late, and the engine fails that request alone with
``MaskFillTimeout``'s message. A row that never got a thread by then (the threads are busy with
a late row) is filled on the engine thread instead, so one slow grammar never holds the others.

``allows_only`` answers, for ``min_tokens`` (engine/sample/logit_adjustments.py), whether a filled
row leaves nothing but the tokens that rule would hold back.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field

import torch

from paged_serve.engine.sched.request import Request

MASK_FILL_THREADS = 4
_BIT = torch.arange(32, dtype=torch.int32)


def bitmask_words(vocab_size: int) -> int:
    """int32 words per mask row."""
    return (vocab_size + 31) // 32


def fill_token_bitmask(rows: list[Request], vocab_size: int) -> torch.Tensor | None:
    """The step's mask ``int32 [len(rows), ceil(V / 32)]`` on the host, filled on the calling
    thread, or None when no row has a grammar matcher."""
    constrained = [i for i, row in enumerate(rows) if row.matcher is not None]
    if not constrained:
        return None
    mask = torch.full((len(rows), bitmask_words(vocab_size)), -1, dtype=torch.int32)
    for i in constrained:
        rows[i].matcher.fill_next_token_bitmask(mask, i)
    return mask


def allowed_tokens(row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``bool [vocab_size]``: the tokens one mask row ``int32 [ceil(V / 32)]`` allows."""
    return ((row[:, None] >> _BIT) & 1).flatten()[:vocab_size].bool()


def allows_only(row: torch.Tensor, tokens: Sequence[int], vocab_size: int) -> bool:
    """Whether the mask row ``int32 [ceil(V / 32)]`` allows no token but ``tokens``."""
    allowed = allowed_tokens(row, vocab_size)
    held = torch.tensor([t for t in tokens if 0 <= t < vocab_size], dtype=torch.long)
    allowed[held] = False
    return not bool(allowed.any())


def fill_timeout_message(seconds: float, limit_s: float, tokens: int) -> str:
    """The error a request gets when its grammar's mask outran the budget."""
    return (
        f"the output constraint is too expensive to follow: its token mask took "
        f"{seconds * 1000:.0f} ms to compute after {tokens} tokens (the limit is "
        f"{limit_s * 1000:.0f} ms per token; --grammar-fill-timeout)"
    )


@dataclass(slots=True)
class _RowFill:
    """One row's fill on a filler thread, into its own buffer ``int32 [1, W]``."""

    buffer: torch.Tensor
    future: Future | None = None
    cpu_s: float = 0.0  # the fill's thread CPU time, set when it ends


@dataclass(slots=True)
class PendingMask:
    """A step's mask being filled; ``wait`` returns it once every row is filled or late."""

    rows: list[Request]
    vocab_size: int
    timeout_s: float
    fills: dict[int, _RowFill] = field(default_factory=dict)

    def wait(self) -> tuple[torch.Tensor | None, dict[int, str]]:
        """The mask ``int32 [len(rows), W]`` (None when no row is constrained) and, per late
        row index, the error its request fails with (its mask row is left all ones)."""
        if not self.fills:
            return None, {}
        futures = [f.future for f in self.fills.values() if f.future is not None]
        wait_for(futures, timeout=self.timeout_s)
        mask = torch.full((len(self.rows), bitmask_words(self.vocab_size)), -1, dtype=torch.int32)
        late: dict[int, str] = {}
        for i, fill in self.fills.items():
            if fill.future is not None and fill.future.cancel():  # never started: fill it here
                fill.future = None
                _fill_row(self.rows[i], fill)
            if fill.future is not None and not fill.future.done():
                late[i] = self._late(i, self.timeout_s)
                continue
            if fill.future is not None:
                fill.future.result()  # a fill that raised raises here, as it would inline
            if fill.cpu_s > self.timeout_s:
                late[i] = self._late(i, fill.cpu_s)
                continue
            mask[i] = fill.buffer[0]
        return mask, late

    def _late(self, i: int, seconds: float) -> str:
        tokens = len(self.rows[i].output_token_ids)
        return fill_timeout_message(seconds, self.timeout_s, tokens)


def _fill_row(row: Request, fill: _RowFill) -> None:
    start = time.thread_time()
    row.matcher.fill_next_token_bitmask(fill.buffer, 0)
    fill.cpu_s = time.thread_time() - start


class MaskFiller:
    """Fills grammar masks on ``MASK_FILL_THREADS`` threads, each row within
    ``fill_timeout_s`` seconds (the budget ``PendingMask.wait`` enforces)."""

    def __init__(self, fill_timeout_s: float):
        self.fill_timeout_s = fill_timeout_s
        self._pool: ThreadPoolExecutor | None = None

    def start(self, rows: list[Request], vocab_size: int) -> PendingMask:
        """Start filling every constrained row of ``rows`` (call before the forward)."""
        pending = PendingMask(rows, vocab_size, self.fill_timeout_s)
        words = bitmask_words(vocab_size)
        for i, row in enumerate(rows):
            if row.matcher is None:
                continue
            fill = _RowFill(torch.empty((1, words), dtype=torch.int32))
            if self._pool is None:
                self._pool = ThreadPoolExecutor(MASK_FILL_THREADS, thread_name_prefix="mask-fill")
            fill.future = self._pool.submit(_fill_row, row, fill)
            pending.fills[i] = fill
        return pending

    def shutdown(self) -> None:
        """Stop the threads (a fill still running finishes first, unwaited)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
