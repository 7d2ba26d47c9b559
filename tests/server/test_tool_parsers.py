"""The tool-call parsers against text fixtures of each family: the whole reply, and the same
text streamed one character at a time (so every token boundary is a split point), which must
add up to the whole reply, never leak part of a call marker into the content, and never send a
call whose arguments are not a whole JSON object (a cut-off call stays text)."""

from __future__ import annotations

import json

import pytest

from paged_serve.server.tool_parsers import (
    GenericParser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedParser,
    RequiredParser,
    ToolParser,
    parser_for_template,
)
from paged_serve.server.tools import ToolCallStream, reply_message

WEATHER = {"city": "Paris", "days": [1, 2], "unit": {"c": True}, "note": 'a "q" }] é'}

# (parser, text, content, [(name, arguments)])
FIXTURES = [
    (
        HermesParser(),
        'Let me check.\n<tool_call>\n{"name": "weather", "arguments": '
        + json.dumps(WEATHER)
        + "}\n</tool_call>",
        "Let me check.",
        [("weather", WEATHER)],
    ),
    (
        HermesParser(),
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"x": 1.5e3}}\n</tool_call>',
        None,
        [("a", {}), ("b", {"x": 1500.0})],
    ),
    (
        HermesParser(),
        "Plain answer with a < sign and <tool",
        "Plain answer with a < sign and <tool",
        [],
    ),
    (HermesParser(), "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    (
        Llama3JsonParser(),
        '<|python_tag|>{"name": "weather", "parameters": ' + json.dumps(WEATHER) + "}",
        None,
        [("weather", WEATHER)],
    ),
    (
        Llama3JsonParser(),
        '{"name": "a", "parameters": {"k": "v"}}; {"name": "b", "parameters": {}}',
        None,
        [("a", {"k": "v"}), ("b", {})],
    ),
    (Llama3JsonParser(), "The weather is fine.", "The weather is fine.", []),
    (
        MistralParser(),
        'Sure. [TOOL_CALLS] [{"name": "weather", "arguments": ' + json.dumps(WEATHER) + "}]",
        "Sure.",
        [("weather", WEATHER)],
    ),
    (
        MistralParser(),
        '[TOOL_CALLS]weather[ARGS]{"city": "Rome"}[TOOL_CALLS]time[ARGS]{}',
        None,
        [("weather", {"city": "Rome"}), ("time", {})],
    ),
    (MistralParser(), "No calls [TOOL here", "No calls [TOOL here", []),
    (
        GenericParser(),
        '{"tool_calls": [{"name": "weather", "arguments": ' + json.dumps(WEATHER) + "}]}",
        None,
        [("weather", WEATHER)],
    ),
    (
        GenericParser(),
        '{"tool_call": {"name": "a", "arguments": {"n": -2}}}',
        None,
        [("a", {"n": -2})],
    ),
    (GenericParser(), '{"response": "It is \\"sunny\\" \\u00e9 {}"}', 'It is "sunny" é {}', []),
    (NamedParser("weather"), json.dumps(WEATHER), None, [("weather", WEATHER)]),
    (
        RequiredParser(),
        '[{"name": "a", "arguments": {"x": [1, {"y": null}]}}, {"name": "b", "arguments": {}}]',
        None,
        [("a", {"x": [1, {"y": None}]}), ("b", {})],
    ),
]


def stream(parser: ToolParser, text: str) -> tuple[str, dict[int, dict]]:
    """Feed ``text`` one character at a time; the content and calls the deltas add up to.
    Each call comes as one delta with its id, name and arguments, a whole JSON object."""
    state = ToolCallStream(parser)
    content, calls = "", {}
    for i, char in enumerate(text):
        piece, deltas = state.feed(char, final=i == len(text) - 1)
        content += piece
        for d in deltas:
            assert d.index == len(calls) and d.id and d.function.name
            assert isinstance(json.loads(d.function.arguments), dict)
            calls[d.index] = {
                "id": d.id,
                "name": d.function.name,
                "arguments": d.function.arguments,
            }
    return content, calls


@pytest.mark.parametrize(("parser", "text", "content", "calls"), FIXTURES)
def test_whole_reply(parser: ToolParser, text: str, content: str | None, calls: list):
    got_content, got_calls = reply_message(parser, text)
    assert got_content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got_calls] == calls
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), FIXTURES)
def test_streamed_reply_adds_up_to_the_whole(parser, text, content, calls):
    whole_content, whole_calls = reply_message(parser, text)
    got_content, got_calls = stream(parser, text)
    assert got_content == (whole_content or "")
    assert [(c["name"], c["arguments"]) for c in got_calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole_calls
    ]


def test_no_partial_tag_reaches_the_content():
    text = "Checking <tool_call>\n" + '{"name": "a", "arguments": {}}</tool_call>'
    state = ToolCallStream(HermesParser())
    for i in range(len(text)):
        piece, _ = state.feed(text[i], final=False)
        assert "<" not in piece


def test_a_call_is_sent_the_moment_its_json_closes():
    text = '<tool_call>{"name": "w", "arguments": {"a": [1, 2]}}</tool_call> trailing'
    state = ToolCallStream(HermesParser())
    sent_at = [i for i, ch in enumerate(text) if state.feed(ch, final=False)[1]]
    assert sent_at == [text.index("</tool_call>") + len("</tool_call>") - 1]


@pytest.mark.parametrize(
    ("template", "family"),
    [
        ("{% for tool in tools %}<tool_call>{% endfor %}", "hermes"),
        ("{{ '<|python_tag|>' }}{% if tools %}ipython{% endif %}", "llama3_json"),
        ("{% if tools %}[AVAILABLE_TOOLS][TOOL_CALLS]{% endif %}", "mistral"),
        ("{{ messages }}", "generic"),
    ],
)
def test_parser_from_template(template: str, family: str):
    assert parser_for_template(template).name == family


CUT_OFF = [
    # (parser, text cut off by max_tokens, whole calls before the cut, content)
    (
        HermesParser(),
        'Hm <tool_call>{"name": "w", "arguments": {"city": "Par',
        [],
        'Hm\n<tool_call>{"name": "w", "arguments": {"city": "Par',
    ),
    (
        GenericParser(),
        '{"tool_calls": [{"name": "w", "arguments": {"a": 1}}, {"name": "v", "ar',
        [("w", {"a": 1})],
        '{"name": "v", "ar',
    ),
    (
        RequiredParser(),
        '[{"name": "w", "arguments": {"a": [1, 2',
        [],
        '{"name": "w", "arguments": {"a": [1, 2',
    ),
    (
        RequiredParser(),
        '[{"name": "ping", "arguments": {}}, {"name": "ping", "arguments": {}}, {"na',
        [("ping", {}), ("ping", {})],
        '{"na',
    ),
    (NamedParser("w"), '{"city": "Berl', [], '{"city": "Berl'),
    (
        MistralParser(),
        '[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{"x',
        [("a", {})],
        '[TOOL_CALLS]b[ARGS]{"x',
    ),
    (
        Llama3JsonParser(),
        '{"name": "a", "parameters": {}}; {"name": "b", "para',
        [("a", {})],
        '{"name": "b", "para',
    ),
]


@pytest.mark.parametrize(("parser", "text", "calls", "content"), CUT_OFF)
def test_a_cut_off_call_is_text_never_a_call(parser: ToolParser, text: str, calls, content):
    got_content, got_calls = reply_message(parser, text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got_calls] == calls
    assert got_content == content
    streamed_content, streamed_calls = stream(parser, text)
    assert streamed_content == content
    assert [(c["name"], c["arguments"]) for c in streamed_calls.values()] == [
        (c.function.name, c.function.arguments) for c in got_calls
    ]


def test_cli_flags_name_the_parsers():
    from paged_serve.server.cli import build_parser

    args = build_parser().parse_args(
        ["--tool-call-parser", "mistral", "--reasoning-parser", "qwen3"]
    )
    assert (args.tool_call_parser, args.reasoning_parser) == ("mistral", "qwen3")
    assert build_parser().parse_args([]).tool_call_parser is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--tool-call-parser", "nope"])


def test_first_call_only_without_parallel_calls():
    from paged_serve.server.tool_parsers import FirstCallOnly

    parser = FirstCallOnly(HermesParser())
    text = FIXTURES[1][1]  # two hermes calls
    content, calls = reply_message(parser, text)
    assert [c.function.name for c in calls] == ["a"]
    got_content, got_calls = stream(parser, text)
    assert [c["name"] for c in got_calls.values()] == ["a"]


@pytest.mark.parametrize("ascii_only", [True, False])
@pytest.mark.parametrize(
    "text", ['héllo "w" \\ / \n\t end', "emoji 😀 x", "a\\b", "\\\\", 'q"', ""]
)
def test_a_growing_json_string_decodes_as_prefixes(text: str, ascii_only: bool):
    """The generic envelope's ``response`` streams as the decoded prefix of its JSON string:
    each cut (inside an escape, between a surrogate pair's halves) gives a prefix of the next."""
    from paged_serve.server.tool_parsers import string_prefix

    encoded, decoded = json.dumps(text, ensure_ascii=ascii_only), ""
    for end in range(1, len(encoded) + 1):
        now = string_prefix(encoded[:end])
        assert now.startswith(decoded) and text.startswith(now), encoded[:end]
        decoded = now
    assert decoded == text
