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

A drafted sequence's ``k + 1`` verification rows (engine/sample/sampling_rows.py) are one walk
on one thread, over a fork of its matcher: fill row 0, accept ``d1``, fill row 1, ... Each row
has the budget a row has without drafts: ``fill_timeout_s`` of its own fill, counted from when
that fill began or the forward ended, whichever is later, so drafting changes how long a step
waits, never which request fails or where. The first late row ends the walk, and is the only
one of its rows reported: the request emits the rows before it (when their drafts hold) and
ends there, having emitted what it would have without drafts (engine/step_outputs.py).

``allows_only`` answers, for ``min_tokens`` (engine/sample/logit_adjustments.py), whether a filled
row leaves nothing but the tokens that rule would hold back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
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
class DraftWalk:
    """A drafted sequence's grammar state for one verification step: its matcher (which the
    step never changes) and its draft ``d1 .. dk``; row ``j`` is filled after ``d1 .. dj``."""

    matcher: object
    draft: Sequence[int]
    request: Request  # the sequence, told how long its fills took (``mask_fill_share``)


class DraftedMatcher:
    """Row ``position`` of a drafted sequence: the sequence's matcher ``position`` drafts ahead.
    ``MaskFiller`` fills all of a sequence's rows in one walk over a fork of the matcher; filled
    alone, a row forks the matcher, accepts its drafts and fills."""

    __slots__ = ("walk", "position")

    def __init__(self, walk: DraftWalk, position: int):
        self.walk = walk
        self.position = position

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        matcher = self.walk.matcher.fork()
        for token in self.walk.draft[: self.position]:
            if not matcher.accept_token(token):
                raise RuntimeError("the grammar refused a draft it had accepted")
        matcher.fill_next_token_bitmask(bitmask, index)


def can_walk_drafts(matcher: object) -> bool:
    """Whether drafted rows can be filled for ``matcher``: the walk needs ``fork`` (recent
    xgrammar releases only), so that a late walk never touches the sequence's own matcher."""
    return callable(getattr(matcher, "fork", None))


@dataclass(slots=True)
class _RowFill:
    """One row's fill, into its own buffer ``int32 [1, W]``."""

    row: int  # its index in the step's rows
    buffer: torch.Tensor
    cpu_s: float | None = None  # the fill's thread CPU time, set when it ends


@dataclass(slots=True)
class _Walk:
    """One sequence's rows of a step (one row, or a drafted sequence's ``k + 1``), filled in
    order on one thread: row ``j`` after accepting ``draft[j - 1]`` on ``matcher`` (a fork for
    a drafted sequence, so the walk leaves the sequence's matcher alone)."""

    matcher: object
    draft: Sequence[int]
    request: Request
    fills: list[_RowFill]
    future: Future | None = None
    changed: threading.Condition = field(default_factory=threading.Condition)
    filling: int = 0  # the row being filled (its position in ``fills``)
    filling_since: float | None = None  # time.monotonic() when that fill began
    done: bool = False
    stop: bool = False  # set by the waiter once a row is late: the rows after it never matter

    def run(self, timeout_s: float) -> None:
        """Fill the rows in order until one takes longer than ``timeout_s`` (thread CPU time)
        or the waiter stops the walk."""
        try:
            for j, fill in enumerate(self.fills):
                if j and not self.matcher.accept_token(self.draft[j - 1]):
                    raise RuntimeError("the grammar refused a draft it had accepted")
                with self.changed:
                    if self.stop:
                        return
                    self.filling, self.filling_since = j, time.monotonic()
                start = time.thread_time()
                self.matcher.fill_next_token_bitmask(fill.buffer, 0)
                fill.cpu_s = time.thread_time() - start
                with self.changed:
                    self.filling_since = None
                    self.changed.notify_all()
                if fill.cpu_s > timeout_s:
                    return
        finally:
            with self.changed:
                self.done = True
                self.changed.notify_all()

    def wait(self, forward_end: float, timeout_s: float) -> tuple[int, float] | None:
        """Wait until the walk is done or its current row late: still filling ``timeout_s``
        after it began or the forward ended, whichever is later (the budget a row has without
        drafts; the drafts' accepts between rows are not timed, as the engine thread's accepts
        are not). Returns the late row's position and how long it has been filling (seconds),
        else None."""
        with self.changed:
            while not self.done:
                if self.filling_since is None:  # between rows: accepting the next draft
                    self.changed.wait()
                    continue
                began = max(self.filling_since, forward_end)
                remaining = began + timeout_s - time.monotonic()
                if remaining <= 0:
                    self.stop = True
                    return self.filling, time.monotonic() - self.filling_since
                self.changed.wait(remaining)
        return None


@dataclass(slots=True)
class PendingMask:
    """A step's mask being filled; ``wait`` returns it once every row is filled or late."""

    rows: list[Request]
    vocab_size: int
    timeout_s: float
    walks: list[_Walk] = field(default_factory=list)

    def wait(self) -> tuple[torch.Tensor | None, dict[int, str]]:
        """The mask ``int32 [len(rows), W]`` (None when no row is constrained) and, per late
        row index, the error its request fails with (its mask row is left all ones). Of a
        drafted sequence's rows only the first late one is named: the rows after it are left
        all ones too, and never emitted (the request ends at its late row, or earlier where a
        draft failed)."""
        if not self.walks:
            return None, {}
        forward_end = time.monotonic()
        # walk index -> (its row still filling when it became late, seconds it had filled)
        running: dict[int, tuple[int, float]] = {}
        for w, walk in enumerate(self.walks):
            if walk.future is not None and walk.future.cancel():  # never started: fill it here
                walk.future = None
                walk.run(self.timeout_s)
            elif walk.future is not None:
                late_row = walk.wait(forward_end, self.timeout_s)
                if late_row is not None:
                    running[w] = late_row
                elif walk.future.done():
                    walk.future.result()  # a fill that raised raises here, as it would inline
        mask = torch.full((len(self.rows), bitmask_words(self.vocab_size)), -1, dtype=torch.int32)
        late: dict[int, str] = {}
        for w, walk in enumerate(self.walks):
            slowest = 0.0
            stopped_at, stopped_s = running.get(w, (len(walk.fills), 0.0))
            for j, fill in enumerate(walk.fills):
                # read once: a late fill may still end on its thread meanwhile
                seconds = stopped_s if j == stopped_at else fill.cpu_s
                if seconds is None or seconds > self.timeout_s or j == stopped_at:
                    seconds = max(seconds or 0.0, self.timeout_s)
                    late[fill.row] = self._late(fill.row, seconds)
                    slowest = max(slowest, seconds)
                    break
                mask[fill.row] = fill.buffer[0]
                slowest = max(slowest, seconds)
            walk.request.mask_fill_share = slowest / self.timeout_s
        return mask, late

    def _late(self, i: int, seconds: float) -> str:
        # a drafted row's outputs include the drafts before it: the request ends there having
        # emitted exactly those
        tokens = len(self.rows[i].output_token_ids)
        return fill_timeout_message(seconds, self.timeout_s, tokens)


class MaskFiller:
    """Fills grammar masks on ``MASK_FILL_THREADS`` threads, one walk per sequence (all of a
    drafted sequence's rows in order), each row within ``fill_timeout_s`` seconds (the budget
    ``PendingMask.wait`` enforces)."""

    def __init__(self, fill_timeout_s: float):
        self.fill_timeout_s = fill_timeout_s
        self._pool: ThreadPoolExecutor | None = None

    def start(self, rows: list[Request], vocab_size: int) -> PendingMask:
        """Start filling every constrained row of ``rows`` (call before the forward)."""
        pending = PendingMask(rows, vocab_size, self.fill_timeout_s)
        words = bitmask_words(vocab_size)
        drafted: dict[int, _Walk] = {}  # id(DraftWalk) -> its walk
        for i, row in enumerate(rows):
            if row.matcher is None:
                continue
            fill = _RowFill(i, torch.empty((1, words), dtype=torch.int32))
            if isinstance(row.matcher, DraftedMatcher):
                draft = row.matcher.walk
                walk = drafted.get(id(draft))
                if walk is None:
                    walk = _Walk(draft.matcher.fork(), draft.draft, draft.request, [])
                    drafted[id(draft)] = walk
                    pending.walks.append(walk)
                walk.fills.append(fill)
            else:
                pending.walks.append(_Walk(row.matcher, (), row, [fill]))
        for walk in pending.walks:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(MASK_FILL_THREADS, thread_name_prefix="mask-fill")
            walk.future = self._pool.submit(walk.run, self.fill_timeout_s)
        return pending

    def shutdown(self) -> None:
        """Stop the threads (a fill still running finishes first, unwaited)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
