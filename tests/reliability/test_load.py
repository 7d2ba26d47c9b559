"""100 concurrent streaming clients against a KV pool far too small for them, 30 of which hang
up (right after the headers, after a few tokens, or at a preemption): every client that stayed
gets its whole answer with the right ending, and afterwards nothing is live or leaked.

The same workload, longer, is ``python -m perf.serving.load_test`` (figures in docs/reliability.md).
"""

from __future__ import annotations

import asyncio

from perf.serving.load_test import AbortRecorder, broken_guarantees, make_plans, run_load
from tests.reliability.conftest import LocalServer, assert_pool_clean, check_success, post

NUM_CLIENTS = 100
LOAD_TIMEOUT_S = 240.0  # per client: a bound against a hang, far above the whole run (~60 s)


def test_100_streams_with_disconnects_under_preemption(tight: LocalServer):
    plans = make_plans(NUM_CLIENTS, seed=7, disconnect_fraction=0.3)  # 8-16 tokens each
    recorder = AbortRecorder(tight.engine.engine)
    try:
        result = asyncio.run(
            run_load(tight.url, plans, concurrency=NUM_CLIENTS, timeout_s=LOAD_TIMEOUT_S)
        )
    finally:
        recorder.close()

    assert broken_guarantees(result.outcomes) == []
    left = [o for o in result.outcomes if o.disconnected]
    by_mode = {
        mode: [o for o in left if o.plan.disconnect == mode]
        for mode in ("before_first_token", "after_tokens")
    }
    assert len(by_mode["before_first_token"]) == 10
    assert all(o.token_frames == 0 for o in by_mode["before_first_token"])
    assert len(by_mode["after_tokens"]) >= 5
    assert all(o.token_frames >= 1 for o in by_mode["after_tokens"])
    assert len(left) >= 20
    # The pool was too small: requests were preempted (and recomputed) during the load.
    assert result.delta("paged_serve_preemptions_total") >= 1
    # In the engine, clients hung up on requests still queued and on requests mid-decode.
    assert recorder.states["queued"] >= 1 and recorder.states["decode"] >= 1, recorder.states
    assert sum(recorder.states.values()) <= len(left)

    # Idle (run_load waited for it): nothing running or waiting, no block used, pool intact.
    for name in ("requests_running", "requests_waiting", "kv_blocks_used"):
        assert result.after[f"paged_serve_{name}"] == 0
    assert_pool_clean(tight.engine)
    body = {"prompt": "Still there?", "max_tokens": 2}
    check_success("completions", body, post(tight.url, "completions", body))
