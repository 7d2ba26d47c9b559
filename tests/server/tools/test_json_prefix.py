"""``json_prefix.fixed_dump``'s promise, the one a streamed call's fragments rest on: for every
prefix of a JSON object's text, the fixed dump is a prefix of the whole object's ``dump`` and
only grows; ``GrowingDump``, which resumes inside an open string, says the same at every step.
A property test over generated objects written every way JSON allows (escapes, ``\\u``
surrogate pairs, whitespace, exponents), then the cases each hold-back is for."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_serve.server.tools.json_prefix import DECODER, GrowingDump, dump, fixed_dump

KEYS = st.text(alphabet='ab"\\é😀 ', max_size=3)
LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=12),
    st.text(alphabet='"\\/\n\t\x01é😀{}[],: ', max_size=12),
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
    max_leaves=8,
)
OBJECTS = st.dictionaries(KEYS, VALUES, min_size=1, max_size=4)
STYLES = [
    {},
    {"ensure_ascii": False},
    {"separators": (",", ":")},
    {"indent": 1, "ensure_ascii": False},
]


def check_every_prefix(text: str, seed: int) -> None:
    """fixed_dump of each prefix of ``text``: a prefix of the whole dump, never shrinking;
    GrowingDump fed the prefixes in random steps agrees with it."""
    final = dump(DECODER.decode(text))
    sent, growing, end = "", GrowingDump(), 0
    steps = random.Random(seed)
    for cut in range(1, len(text) + 1):
        fixed = fixed_dump(text[:cut])
        assert fixed is not None, text[:cut]
        assert final.startswith(fixed) and fixed.startswith(sent), (text[:cut], fixed)
        sent = fixed
        if cut >= end:
            assert growing.read(text[:cut]) == fixed, text[:cut]
            end = cut + steps.randrange(1, 6)
    assert sent == final


@settings(max_examples=300, deadline=None)
@given(obj=OBJECTS, style=st.sampled_from(STYLES), seed=st.integers(0, 99))
def test_every_prefix_fixes_a_prefix_of_the_dump(obj: dict, style: dict, seed: int):
    check_every_prefix(json.dumps(obj, **style), seed)


@pytest.mark.parametrize(
    ("text", "fixed"),
    [
        ('{"path": "a.t', '{"path": "a.t'),  # an open string goes out as it comes
        ('{"n": 12', "{"),  # 12 may become 123
        ('{"n": 12,', '{"n": 12'),
        ('{"n": 1.50}', '{"n": 1.5}'),  # the final text is the dump, not the model's
        ('{"n": 1e', "{"),
        ('{"b": tr', "{"),
        ('{"b": true', '{"b": true'),
        ('{"k', "{"),  # a key waits for its value
        ('{"k": ', "{"),
        ('{"k": "', '{"k": "'),
        ('{"s": "x\\u00', '{"s": "x'),  # an escape still being written
        ('{"s": "x\\', '{"s": "x'),
        ('{"s": "\\ud83d', '{"s": "'),  # a surrogate pair dumps as one character
        ('{"s": "\\ud83d\\ude00', '{"s": "😀'),
        ('{"s": "x"', '{"s": "x"'),
        ('{"a": [1, 2', '{"a": [1'),
        ('{"a": {"b": []}', '{"a": {"b": []}'),
        ('{"a": {"b": []}}', '{"a": {"b": []}}'),  # the closing brace once it is written
        ('{"a": 1, "a": "second', '{"a": 1'),  # a repeated key keeps its first value
        ('{"a": 1, "a": 2}', '{"a": 1}'),
        ("[", None),  # arguments are an object
        ("", None),
    ],
)
def test_what_each_prefix_holds_back(text: str, fixed: str | None):
    assert fixed_dump(text) == fixed
    if fixed is not None:
        assert GrowingDump().read(text) == fixed


def test_a_long_string_is_read_on_where_it_stopped(monkeypatch: pytest.MonkeyPatch):
    """Fed a character at a time, a long argument (a file's content) is read again only where
    its string opens or closes: the rest of the way each step decodes its own characters."""
    from paged_serve.server.tools import json_prefix

    text = json.dumps({"path": "a.py", "content": 'print("é\\n")\n' * 200})
    check_every_prefix(text, seed=0)
    full_reads = []
    whole_read = json_prefix.value_prefix
    monkeypatch.setattr(
        json_prefix, "value_prefix", lambda t: full_reads.append(t) or whole_read(t)
    )
    growing = GrowingDump()
    for cut in range(1, len(text) + 1):
        growing.read(text[:cut])
    assert growing.fixed == dump(json.loads(text))
    assert len(text) > 2000 and len(full_reads) < 40
