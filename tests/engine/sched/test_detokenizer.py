"""Incremental detokenization: multi-byte safe, equal to a full decode; stop strings cut."""

from __future__ import annotations

import pytest

from paged_serve.engine.sched.detokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer

TEXTS = [
    "Hello, world! Plain ASCII with  double spaces.",
    "Emoji 🚀🔥 and accents: café, naïve, Ångström.",
    "中文字符和日本語のテキスト, mixed with English.",
    "Code:\n    def f(x):\n        return x ** 2\n",
]


def stream(tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], object]:
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], stop=stop)
    deltas = []
    for i, t in enumerate(ids):
        stopped = detok.add_token(t)
        last = stopped or i == len(ids) - 1
        if last:
            detok.flush()
        deltas.append(detok.take_delta(finished=last))
        if stopped:
            break
    return deltas, detok


@pytest.mark.parametrize("text", TEXTS)
def test_concatenated_deltas_equal_a_full_decode(default_tokenizer, text):
    ids = default_tokenizer(text, add_special_tokens=False).input_ids
    deltas, _ = stream(default_tokenizer, ids)
    assert "".join(deltas) == default_tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in deltas)


def test_split_multibyte_character_is_held_until_complete(default_tokenizer):
    ids = default_tokenizer("🚀", add_special_tokens=False).input_ids
    assert len(ids) > 1, "the rocket should span several byte tokens"
    deltas, _ = stream(default_tokenizer, ids)
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "🚀"


def test_stop_string_is_cut_exactly_and_never_leaks(default_tokenizer):
    text = "The answer is 42. END of the story, and more text."
    ids = default_tokenizer(text, add_special_tokens=False).input_ids
    deltas, detok = stream(default_tokenizer, ids, stop=("END", "never"))
    assert "".join(deltas) == "The answer is 42. "
    assert detok.stopped_on == "END"


def test_earliest_stop_string_wins(default_tokenizer):
    ids = default_tokenizer("alpha beta gamma", add_special_tokens=False).input_ids
    deltas, detok = stream(default_tokenizer, ids, stop=("gamma", "beta"))
    assert "".join(deltas) == "alpha "
    assert detok.stopped_on == "beta"


class CountingTokenizer:
    """Wraps a tokenizer and counts the token ids it was asked to decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoded = 0

    def decode(self, ids: list[int], **kwargs) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def _decode_work(tokenizer, token: int, n: int) -> tuple[int, str]:
    counting = CountingTokenizer(tokenizer)
    _, detok = stream(counting, [token] * n)
    return counting.decoded, detok.text


def test_a_never_completing_character_costs_bounded_work_per_token(default_tokenizer):
    lead_byte = default_tokenizer.convert_tokens_to_ids("ä")  # byte 0xE4 alone: never completes
    small, text_small = _decode_work(default_tokenizer, lead_byte, 200)
    large, text_large = _decode_work(default_tokenizer, lead_byte, 1600)
    # Linear work: 8x the tokens costs about 8x the decoding (quadratic would be 64x).
    assert large / small < 9
    # The pending run is emitted as replacement characters once it reaches the bound.
    assert text_large.count("\ufffd") >= 1600 - MAX_PENDING_TOKENS


def test_emitted_replacements_still_let_a_stop_string_fire(default_tokenizer):
    lead_byte = default_tokenizer.convert_tokens_to_ids("ä")
    ids = [lead_byte] * (3 * MAX_PENDING_TOKENS)
    deltas, detok = stream(default_tokenizer, ids, stop=("\ufffd" * 4,))
    assert detok.stopped_on == "\ufffd" * 4
    assert len(deltas) <= MAX_PENDING_TOKENS + 1
