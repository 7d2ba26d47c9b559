"""The tool-call parsers against text fixtures of each family: the whole reply, and the same
text streamed one character at a time (so every token boundary is a split point), which must
add up to the whole reply, never leak part of a call marker into the content, and stream a
call's arguments as fragments that are at every point a prefix of the whole reply's arguments
(a cut-off call is no call in the whole reply, and stays unfinished in the stream)."""

from __future__ import annotations

import json

import pytest
from msgspec import UNSET

from paged_serve.server.tools.parsers import (
    GenericParser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedParser,
    RequiredParser,
    ToolParser,
    parser_for_template,
)
from paged_serve.server.tools.planning import reply_message
from paged_serve.server.tools.streaming import ToolCallStream

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
    A call's first delta has its index (the next one), id, type and name and empty arguments,
    the later ones only its index and an argument fragment; ``fragments`` counts those."""
    state = ToolCallStream(parser)
    content, calls = "", {}
    for i, char in enumerate(text):
        piece, deltas = state.feed(char, final=i == len(text) - 1)
        content += piece
        for d in deltas:
            if d.index not in calls:
                assert d.index == len(calls) and d.id and d.type == "function"
                assert d.function.name and d.function.arguments == ""
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                calls[d.index]["fragments"] = 0
                continue
            assert d.id is UNSET and d.function.name is UNSET and d.function.arguments
            calls[d.index]["arguments"] += d.function.arguments
            calls[d.index]["fragments"] += 1
    return content, calls


def whole_calls(calls: dict[int, dict]) -> list[tuple[str, str]]:
    """The streamed calls whose arguments are whole JSON (an unfinished one's are not)."""
    out = []
    for call in calls.values():
        try:
            json.loads(call["arguments"])
        except ValueError:
            continue
        out.append((call["name"], call["arguments"]))
    return out


@pytest.mark.parametrize(("parser", "text", "content", "calls"), FIXTURES)
def test_whole_reply(parser: ToolParser, text: str, content: str | None, calls: list):
    got_content, got_calls = reply_message(parser, text)
    assert got_content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got_calls] == calls
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), FIXTURES)
def test_streamed_reply_adds_up_to_the_whole(parser, text, content, calls):
    whole_content, whole = reply_message(parser, text)
    got_content, got_calls = stream(parser, text)
    assert got_content == (whole_content or "")
    assert [(c["name"], c["arguments"]) for c in got_calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    for call in got_calls.values():  # WEATHER's arguments arrive in pieces as they are written
        if json.loads(call["arguments"]) == WEATHER:
            assert call["fragments"] > 5


def test_no_partial_tag_reaches_the_content():
    text = "Checking <tool_call>\n" + '{"name": "a", "arguments": {}}</tool_call>'
    state = ToolCallStream(HermesParser())
    for i in range(len(text)):
        piece, _ = state.feed(text[i], final=False)
        assert "<" not in piece


def test_a_call_streams_its_arguments_as_they_are_written():
    """The call opens once its name is whole and its arguments object has opened; each
    fragment is what the arguments gained that no later character can change: ``1`` only
    once the comma shows it whole, a closing quote or bracket only once it is written, and the
    arguments' own closing brace only once the call has closed."""
    text = '<tool_call>{"name": "w", "arguments": {"a": [1, 22], "b": "x"}}</tool_call> end'
    state = ToolCallStream(HermesParser())
    sent: list[tuple[str, str]] = []  # (the text so far, what its deltas carried)
    for i, char in enumerate(text):
        _, deltas = state.feed(char, final=i == len(text) - 1)
        sent += [(text[: i + 1], d.function.arguments) for d in deltas if d.function.arguments]
    assert sent == [
        ('<tool_call>{"name": "w", "arguments": {', "{"),
        ('<tool_call>{"name": "w", "arguments": {"a": [', '"a": ['),
        ('<tool_call>{"name": "w", "arguments": {"a": [1,', "1"),
        ('<tool_call>{"name": "w", "arguments": {"a": [1, 22]', ", 22]"),
        ('<tool_call>{"name": "w", "arguments": {"a": [1, 22], "b": "', ', "b": "'),
        ('<tool_call>{"name": "w", "arguments": {"a": [1, 22], "b": "x', "x"),
        ('<tool_call>{"name": "w", "arguments": {"a": [1, 22], "b": "x"', '"'),
        ('<tool_call>{"name": "w", "arguments": {"a": [1, 22], "b": "x"}}</tool_call>', "}"),
    ]
    [call] = state.calls
    assert call.whole and call.arguments == '{"a": [1, 22], "b": "x"}'


def test_an_open_string_streams_all_but_an_unfinished_escape():
    state = ToolCallStream(NamedParser("write"))
    _, deltas = state.feed('{"path": "a.t', final=False)
    assert [d.function.arguments for d in deltas] == ["", '{"path": "a.t']
    for piece, fragment in [("xt\\u", "xt"), ("00e9\\ud83d", "é"), ("\\ude00", "😀")]:
        _, deltas = state.feed(piece, final=False)
        assert [d.function.arguments for d in deltas] == [fragment]
    _, deltas = state.feed('", "n": 12', final=False)  # 12 may still become 123
    assert [d.function.arguments for d in deltas] == ['"']
    _, deltas = state.feed("3}", final=True)
    assert [d.function.arguments for d in deltas] == [', "n": 123}']
    assert state.calls[0].arguments == json.dumps(
        {"path": "a.txté😀", "n": 123}, ensure_ascii=False
    )


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
    # (parser, text cut off by max_tokens, whole calls before the cut, content, the streamed
    # content, the unfinished call the stream opened: (name, arguments sent) or None)
    (
        HermesParser(),
        'Hm <tool_call>{"name": "w", "arguments": {"city": "Par',
        [],
        'Hm\n<tool_call>{"name": "w", "arguments": {"city": "Par',
        "Hm",
        ("w", '{"city": "Par'),
    ),
    (
        GenericParser(),
        '{"tool_calls": [{"name": "w", "arguments": {"a": 1}}, {"name": "v", "ar',
        [("w", {"a": 1})],
        '{"name": "v", "ar',
        '{"name": "v", "ar',
        None,
    ),
    (
        RequiredParser(),
        '[{"name": "w", "arguments": {"a": [1, 2',
        [],
        "",
        "",
        ("w", '{"a": [1'),
    ),
    (
        RequiredParser(),
        '[{"name": "ping", "arguments": {}}, {"name": "ping", "arguments": {}}, {"na',
        [("ping", {}), ("ping", {})],
        None,
        "",
        None,
    ),
    (NamedParser("w"), '{"city": "Berl', [], "", "", ("w", '{"city": "Berl')),
    (NamedParser("w"), "{", [], "", "", ("w", "{")),
    (NamedParser("w"), "", [], "", "", None),
    (
        MistralParser(),
        '[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{"x',
        [("a", {})],
        '[TOOL_CALLS]b[ARGS]{"x',
        "",
        ("b", "{"),
    ),
    (
        Llama3JsonParser(),
        '{"name": "a", "parameters": {}}; {"name": "b", "para',
        [("a", {})],
        '{"name": "b", "para',
        '{"name": "b", "para',
        None,
    ),
]


@pytest.mark.parametrize(("parser", "text", "calls", "content", "streamed", "unfinished"), CUT_OFF)
def test_a_cut_off_call_is_no_call(
    parser: ToolParser, text: str, calls, content, streamed, unfinished
):
    """Whole, a cut-off call is text under ``auto`` and nothing under a forced choice;
    streamed, it stays the unfinished call it was (not repeated as content) once it opened."""
    got_content, got_calls = reply_message(parser, text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got_calls] == calls
    assert got_content == content
    streamed_content, streamed_calls = stream(parser, text)
    assert streamed_content == streamed
    assert whole_calls(streamed_calls) == [
        (c.function.name, c.function.arguments) for c in got_calls
    ]
    opened = [(c["name"], c["arguments"]) for c in streamed_calls.values()][len(got_calls) :]
    assert opened == ([unfinished] if unfinished else [])


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
    from paged_serve.server.tools.parsers import FirstCallOnly

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
    from paged_serve.server.tools.parsers import string_prefix

    encoded, decoded = json.dumps(text, ensure_ascii=ascii_only), ""
    for end in range(1, len(encoded) + 1):
        now = string_prefix(encoded[:end])
        assert now.startswith(decoded) and text.startswith(now), encoded[:end]
        decoded = now
    assert decoded == text


def test_a_call_cut_off_after_its_arguments_closed_streams_no_json():
    """``max_tokens`` ends the reply between the arguments' ``}`` and the call's: the whole
    reply holds no call, so the stream's unfinished call has arguments that do not parse."""
    state = ToolCallStream(RequiredParser())
    sent = ""
    for char in '[{"name": "ping", "arguments": {}':
        _, deltas = state.feed(char, final=False)
        sent += "".join(d.function.arguments or "" for d in deltas)
    _, deltas = state.feed("", final=True)
    sent += "".join(d.function.arguments or "" for d in deltas)
    assert sent == "{" and not state.has_calls
    state, text, sent = ToolCallStream(RequiredParser()), '[{"name": "ping", "arguments": {}}]', []
    for i, char in enumerate(text):
        _, deltas = state.feed(char, final=i == len(text) - 1)
        sent += [(text[: i + 1], d.function.arguments) for d in deltas if d.function.arguments]
    assert sent == [('[{"name": "ping", "arguments": {', "{"), (text[:-1], "}")]
    assert state.calls[0].whole and state.calls[0].arguments == "{}"
