"""The life of a request's ``n`` samples: one prefill, then ``n`` sequences sharing its blocks.

::

    add_request(n=3)              prompt computed                 a sample ends
    r  pending: [r.1, r.2]   ->   r, r.1, r.2 running        ->   the others go on
    (1 request, 3 seats)          (blocks shared, ref 3;          (its blocks freed)
                                   copy-on-write on divergence)

* The first sample carries the others as *pending forks* until its prompt is computed. It
  holds a running seat for each of them (``group_size``), and the step that computes its last
  prompt token samples a row for each of them from the same logits
  (``sampling_rows``, engine/sample/sampling_rows.py).
* After that step each pending fork gets the parent's block table, shared by reference count
  (``join_forks``), and the scheduler runs it as a request of its own.
* A sample that ends while forks still wait on it (an abort mid-prefill) hands them to the
  first of them, the *heir* (``detach``), which the scheduler puts at the front of the waiting
  queue.

The scheduler calls these functions; they never reach into its queues.

Sample ``i`` of a request ``r`` has id ``r.i`` (``r`` for sample 0) and seed ``seed + i``, so it
equals a single request with that seed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from paged_serve.engine.sampling_params import SamplingParams
from paged_serve.engine.sched.batch import ScheduledBatch
from paged_serve.engine.sched.block_manager import BlockManager
from paged_serve.engine.sched.request import Request


def sample_ids(request_id: str, n: int) -> list[str]:
    """The ids of the ``n`` samples of a request: its own id, then ``id.1`` ... ``id.(n-1)``."""
    return [request_id] + [f"{request_id}.{i}" for i in range(1, n)]


def make_samples(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    draw_seed: Callable[[], int],
    cache_salt: str | None = None,
) -> list[Request]:
    """The ``params.n`` samples of a request, the first holding the others as pending forks.

    ``draw_seed`` gives the seed of each sample when ``params.seed`` is None; every sample
    carries ``cache_salt`` (an heir re-admitted after its parent's abort looks its prefix up in
    the same chain).
    """
    samples = [
        Request(
            rid,
            prompt_token_ids,
            params,
            seed=params.seed + index if params.seed is not None else draw_seed(),
            index=index,
            cache_salt=cache_salt,
        )
        for index, rid in enumerate(sample_ids(request_id, params.n))
    ]
    if params.prompt_logprobs is not None:
        samples[0].prompt_logprobs = [None]  # the forks copy the parent's when they join
    parent, *forks = samples
    parent.pending_forks = forks
    for child in forks:
        child.fork_parent = parent
    return samples


def group_size(request: Request) -> int:
    """The request and the forks waiting on it: its running seats and its sampled rows."""
    return 1 + len(request.pending_forks)


def with_pending_forks(requests: Iterable[Request]) -> list[Request]:
    """Each request followed by its pending forks."""
    return [r for request in requests for r in (request, *request.pending_forks)]


def join_forks(batch: ScheduledBatch, block_manager: BlockManager) -> list[Request]:
    """After a step: the pending forks of every request whose prompt it completed share the
    parent's blocks; returns them, in order, for the scheduler's running set."""
    joined: list[Request] = []
    for sched in batch.requests:
        parent = sched.request
        if not (sched.samples and parent.pending_forks):
            continue
        for child in parent.pending_forks:
            block_manager.fork(parent.request_id, child.request_id)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.first_scheduled_time = parent.first_scheduled_time  # admitted together
            if parent.prompt_logprobs is not None:
                child.prompt_logprobs = list(parent.prompt_logprobs)
            joined.append(child)
        parent.pending_forks = []
    return joined


def detach(request: Request) -> Request | None:
    """Take an ending sample out of its group: leave its parent's pending forks, or hand its
    own pending forks to an heir, returned for the scheduler to queue first (None: no heir)."""
    parent = request.fork_parent
    if parent is not None and request in parent.pending_forks:
        parent.pending_forks.remove(request)
    if not request.pending_forks:
        return None
    heir, *rest = request.pending_forks
    heir.pending_forks, heir.fork_parent = rest, None
    for child in rest:
        child.fork_parent = heir
    request.pending_forks = []
    return heir
