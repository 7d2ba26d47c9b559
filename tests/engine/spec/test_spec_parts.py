"""The pieces of speculative decoding on their own: the config, prompt lookup, pacing, the
verification's accepted runs and the block trim."""

from __future__ import annotations

import pytest

from paged_serve.engine.sampling_params import SamplingParams
from paged_serve.engine.sched.block_manager import BlockManager
from paged_serve.engine.sched.request import Request
from paged_serve.engine.sched.scheduler import accepted_lengths
from paged_serve.engine.spec.config import SpeculativeConfig
from paged_serve.engine.spec.ngram import NgramDrafter
from paged_serve.engine.spec.speculator import MAX_PAUSE_STEPS, Speculator


def request(tokens: list[int], output: list[int] = (), rid: str = "r", **params) -> Request:
    params.setdefault("max_tokens", 100)
    return Request(
        rid, list(tokens), SamplingParams(**params), seed=0, output_token_ids=list(output)
    )


# ----------------------------------------------------------------------------- config
def test_vllm_json_parses():
    spec = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, '
        '"prompt_lookup_min": 1}'
    )
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 3, 5)
    assert SpeculativeConfig.parse("off") is None and SpeculativeConfig.parse("null") is None
    old = SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 2})
    assert old.method == "ngram"
    draft = SpeculativeConfig.from_dict({"model": "/m", "num_speculative_tokens": 2})
    assert (draft.method, draft.model) == ("draft_model", "/m")


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "not JSON"),
        ('{"method": "eagle", "model": "x"}', "not supported"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "1..16"),
        ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup"),
        ('{"method": "draft_model"}', "needs"),
        ('{"method": "ngram", "acceptance_method": "typical"}', "acceptance_method"),
        ('{"model": "x", "draft_tensor_parallel_size": 2}', "rank 0"),
        ("[1]", "JSON object"),
    ],
)
def test_bad_configs_are_refused_by_name(text, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(text)


# ----------------------------------------------------------------------------- prompt lookup
def test_lookup_takes_the_latest_occurrence_of_the_longest_suffix():
    drafter = NgramDrafter(min_n=1, max_n=3)
    # suffix [7, 8]: once after 1 (-> 9 9), later after 2 (-> 5 6); the 3-gram [3, 7, 8] once
    tokens = [1, 7, 8, 9, 9, 3, 7, 8, 5, 6, 2, 7, 8]
    assert drafter.propose([request(tokens)], [2]) == [[5, 6]]
    drafter = NgramDrafter(min_n=1, max_n=3)
    tokens = [3, 7, 8, 4, 4, 1, 7, 8, 5, 5, 3, 7, 8]
    assert drafter.propose([request(tokens)], [3]) == [[4, 4, 1]]  # the 3-gram wins


def test_lookup_grows_with_the_output_and_stops_at_min_n():
    drafter = NgramDrafter(min_n=2, max_n=2)
    r = request([1, 2, 3, 4], [])
    assert drafter.propose([r], [4]) == [[]]  # [3, 4] never occurred before
    r.output_token_ids += [9, 1, 2]
    assert drafter.propose([r], [4]) == [[3, 4, 9, 1]]  # indexed incrementally
    r.output_token_ids += [3]
    assert drafter.propose([r], [1]) == [[4]]
    drafter.release("r")
    assert drafter.propose([r], [1]) == [[4]]  # a new index, the same answer


def test_lookup_may_run_into_the_suffix():
    drafter = NgramDrafter(min_n=1, max_n=1)
    assert drafter.propose([request([5, 5, 5])], [4]) == [[5]]


# ----------------------------------------------------------------------------- pacing
class Fixed:
    def __init__(self, draft):
        self.draft = draft

    def propose(self, requests, limits):
        return [self.draft[:k] for k in limits]

    def release(self, request_id):
        pass


def speculator(k: int = 4, **fields) -> Speculator:
    config = SpeculativeConfig(num_speculative_tokens=k, **fields)
    return Speculator(config, Fixed(list(range(10, 30))), max_model_len=1000)


def test_a_sequence_that_misses_pauses_longer_each_time():
    spec = speculator()
    r = request([1, 2, 3])
    pauses = []
    for _ in range(40):
        drafts = spec.drafts([r], num_running=1)
        if drafts:
            spec.observe("r", len(drafts["r"]), 0)
            pauses.append(spec._pace["r"].skip)
    assert pauses[:2] == [0, 1]  # the first miss halves the rate, the second pauses a step
    assert pauses[2:5] == [2, 4, 8]  # doubling
    assert max(pauses) <= MAX_PAUSE_STEPS


def test_k_follows_the_accepted_runs():
    spec = speculator(k=4)
    r = request([1, 2, 3])
    assert spec.drafts([r], 1)["r"] == [10, 11, 12, 13]
    spec.observe("r", 4, 1)
    assert len(spec.drafts([r], 1)["r"]) == 2  # one past the accepted run
    spec.observe("r", 2, 2)
    assert len(spec.drafts([r], 1)["r"]) == 4  # doubled after a full run, capped at k
    assert spec.stats.accepted_per_position[:2] == [2, 1]
    assert spec.stats.mean_accepted_length == pytest.approx(1 + 3 / 2)


def test_limits_max_tokens_model_length_and_batch():
    spec = speculator(k=4, disable_by_batch_size=2)
    assert spec.drafts([request([1], [5] * 7, max_tokens=10)], 1)["r"] == [10, 11]
    assert spec.drafts([request([1], [5] * 9, max_tokens=10)], 1) == {}  # one token left
    spec.max_model_len = 4
    assert spec.drafts([request([1, 2], [])], 1)["r"] == [10]
    spec.max_model_len = 1000
    assert spec.drafts([request([1, 2])], num_running=3) == {}


# ----------------------------------------------------------------------------- verification
def test_accepted_runs_stop_at_the_first_disagreement():
    drafts = {"a": [5, 6, 7], "c": [1]}
    rows = ["a", "a", "a", "a", "b", "c", "c"]
    tokens = [5, 6, 9, 4, 3, 1, 8]
    assert accepted_lengths(drafts, rows, tokens) == {"a": 2, "c": 1}
    assert accepted_lengths({"a": [5, 6, 7]}, ["a"] * 4, [5, 6, 7, 1]) == {"a": 3}
    assert accepted_lengths({"a": [5]}, ["a", "a"], [4, 5]) == {"a": 0}


# ----------------------------------------------------------------------------- trim
def test_trim_gives_back_the_blocks_of_rejected_positions():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    bm.allocate("r", 6)
    bm.commit("r", list(range(6)), 6)
    bm.append_slots("r", 6 + 1 + 5)  # a decode with 5 drafts: 12 tokens, 3 blocks
    assert len(bm.block_table("r")) == 3
    bm.trim("r", 7)  # two drafts held
    assert len(bm.block_table("r")) == 2 and bm.num_free_blocks == 6
    bm.check_integrity()
    with pytest.raises(ValueError, match="up to"):
        bm.trim("r", 9)
    with pytest.raises(ValueError, match="cached blocks"):
        bm.trim("r", 3)  # the first block is keyed in the prefix cache
    bm.free("r")
    bm.check_integrity()
