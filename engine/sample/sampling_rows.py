"""The rows a step samples, and how a drafted sequence's rows verify its drafts.

``sampling_rows(batch)`` lists, in scheduled order, one row per sampled token: a request whose
chunk reaches its last token, followed by its pending forks (``n > 1``: they draw their first
token from the parent's logits row, engine/sched/forks.py), and a drafted request's ``k + 1``
verification rows (``verify_rows``). The runner's ``logit_rows`` (engine/runner/step_inputs.py)
list the same rows in the same order.

Verification: the target scores a drafted sequence's ``k + 1`` positions in one forward and
its own draw decides every token. A sequence whose last token is ``t`` (position ``p``) and
whose draft is ``d1 .. dk`` runs ``t d1 .. dk`` at positions ``p .. p + k`` as ``k + 1``
one-token decode rows over its paged KV (engine/runner/step_inputs.py ``flatten_step``: causal
over the draft, as a prefill chunk would compute it), and its LM head runs at all of them.
Row ``j`` is sampled as the sequence's ordinary next row would be after ``d1 .. dj``: its
step (the seed's position), its penalties and ``min_tokens`` see ``d1 .. dj`` as output, its
grammar mask is the matcher's after them (``DraftedMatcher``, engine/sample/token_mask.py).
Row ``j``'s draw ``x_j`` is then exactly the token plain decoding would draw there whenever
``d1 .. dj`` are the tokens plain decoding drew, so:

    emit x_0 .. x_a, where a = the first j with x_j != d_(j+1) (or k when every draft held)

and the output is token for token the output without speculation, greedy or sampled with the
same seed, which is a stronger promise than rejection sampling's (the same distribution):
each token is a function of the target's logits and ``(seed, position)`` alone, so batching,
pacing and the drafter change the speed, never the text. For a point-mass draft (prompt
lookup) the chance a draft holds, ``p(d)``, is also rejection sampling's chance of accepting it.

The scheduler counts ``a`` for each drafted sequence after the step (``accepted_lengths``,
``Scheduler.update`` in engine/sched/scheduler.py): the KV of ``t d1 .. da`` stays; the
rejected positions past it are freed or overwritten by the next step (``BlockManager.trim``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from paged_serve.engine.sample.token_mask import DraftedMatcher, DraftWalk
from paged_serve.engine.sched.batch import ScheduledBatch
from paged_serve.engine.sched.request import Request


def verify_rows(request: Request, draft: Sequence[int]) -> list[Request]:
    """The ``len(draft) + 1`` sampling rows of a drafted sequence: row ``j`` is the request as
    it would be with ``draft[:j]`` appended (same id, seed and parameters)."""
    walk = None if request.matcher is None else DraftWalk(request.matcher, draft, request)
    rows = []
    for j in range(len(draft) + 1):
        matcher = None if walk is None else DraftedMatcher(walk, j)
        rows.append(
            dataclasses.replace(
                request,
                output_token_ids=request.output_token_ids + list(draft[:j]),
                matcher=matcher,
                pending_forks=[],
            )
        )
    return rows


def sampling_rows(batch: ScheduledBatch) -> list[Request]:
    """The requests that sample this step, each followed by its pending forks (they sample
    their first token from their parent's logits row); a drafted request's rows are its
    verification rows (``verify_rows``)."""
    rows: list[Request] = []
    for s in batch.requests:
        if s.draft:
            rows += verify_rows(s.request, s.draft)
        elif s.samples:
            rows += (s.request, *s.request.pending_forks)
    return rows
