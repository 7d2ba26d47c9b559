"""Tool calls out of generated text: one parser per model family, whole or while streaming.

A parser reads the text generated so far and returns ``Parsed``: the ``content`` (text for the
user), the tool ``calls`` whose JSON is complete, and the ``rest``: text that is not a call,
or not yet one (a call still being written; at the end, one that ``max_tokens`` cut off or that
the model left malformed). A call is only ever a call once its JSON has closed, so its
``arguments`` are the JSON text of a whole object by construction. The parser is called with
``final=False`` on every prefix of a stream and with ``final=True`` on the whole text, and keeps
one promise that makes a stream agree with the whole reply: the content and calls of a
non-final parse are prefixes of the final ones. At the end, ``rest`` joins the content, so a cut
off or malformed call reaches the client as text, never as a call with broken arguments.

Families (``PARSERS``; ``parser_for_template`` picks one from the chat template):

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes,
  Qwen2.5, Qwen3); text before the first block is the content;
* ``llama3_json``: a reply that is JSON ``{"name": ..., "parameters": {...}}`` (optionally after
  ``<|python_tag|>``, several separated by ``;``), as Llama 3.1-3.3 call custom tools;
* ``mistral``: ``[TOOL_CALLS]`` then a JSON list of calls, or ``name[ARGS]{...}`` (newer
  tokenizers); text before it is the content;
* ``generic``: the JSON envelope the server constrains a model without tool support to
  (``{"tool_call": {...}}``, ``{"tool_calls": [...]}`` or ``{"response": "..."}``), after
  llama.cpp's server;
* ``named`` / ``required``: the grammar-forced replies of ``tool_choice`` (the arguments object
  of one named tool; a JSON list of ``{"name", "arguments"}``).

Whole JSON values are read with the standard library's ``raw_decode``, which tells where a
value ends; the growing ``{"response": "..."}`` text of the generic envelope as the decoded
prefix of its JSON string (``string_prefix``), and a ``response`` that is not a string (which
the grammar forbids, but a ``--tool-call-parser`` override may not) with
``partial-json-parser`` (what vLLM's tool parsers use).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from partial_json_parser import Allow
from partial_json_parser import loads as partial_loads

_DECODER = json.JSONDecoder()
_SPACE = " \t\r\n"


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One whole tool call: ``arguments`` is the JSON text of an object."""

    name: str
    arguments: str


@dataclass(slots=True)
class Parsed:
    """content: text for the user; calls: the whole calls; rest: the text that is not (yet) a
    call, which joins the content at the end."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    rest: str = ""


def call_from(obj: Any, args_key: str = "arguments") -> ParsedCall | None:
    """A call from a whole ``{"name", args_key}`` object (``parameters`` is accepted too);
    None unless the name is a string and the arguments an object (or its JSON text)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("parameters", {}))
    if isinstance(args, str):  # some models send the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def hold_back(text: str, tag: str) -> str:
    """``text`` without a trailing prefix of ``tag`` and without trailing whitespace."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            text = text[:-n]
            break
    return text.rstrip()


def _skip(text: str, pos: int, chars: str = _SPACE) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def json_values(text: str, separators: str = _SPACE + ";") -> tuple[list[tuple[Any, str]], str]:
    """The whole JSON values at the start of ``text``, separated by ``separators``, each with
    its own text; and the text from the first value that is not whole yet."""
    values, pos = [], _skip(text, 0, separators)
    while pos < len(text):
        try:
            value, end = _DECODER.raw_decode(text, pos)
        except ValueError:
            return values, text[pos:]
        values.append((value, text[pos:end]))
        pos = _skip(text, end, separators)
    return values, ""


def json_array_items(text: str) -> tuple[list[tuple[Any, str]], str]:
    """The whole elements of a JSON array that ``text`` starts (and may not yet finish), each
    with its own text; and the text from the first element that is not whole yet ("" once
    the array has closed or while nothing is pending). Text that is no array is all rest."""
    pos = _skip(text, 0)
    if pos == len(text):
        return [], ""
    if text[pos] != "[":
        return [], text[pos:]
    items: list[tuple[Any, str]] = []
    pos = _skip(text, pos + 1)
    while pos < len(text) and text[pos] != "]":
        if items:
            if text[pos] != ",":
                return items, text[pos:]
            pos = _skip(text, pos + 1)
            if pos == len(text):
                break
        try:
            value, end = _DECODER.raw_decode(text, pos)
        except ValueError:
            return items, text[pos:]
        items.append((value, text[pos:end]))
        pos = _skip(text, end)
    return items, ""


def string_prefix(text: str) -> str:
    """The decoded part of a JSON string that ``text`` opens (``"ab\\u00`` -> ``ab``): the
    whole string once it has closed, else all of it but an escape still being written (or a
    surrogate half still waiting for its pair). The standard library's C decoder does the work,
    so each call costs one pass over the text in C, not a Python parse."""
    try:
        value, _ = _DECODER.raw_decode(text)
        return value if isinstance(value, str) else ""
    except ValueError:
        pass
    body = text[1:]
    while (start := _open_escape(body)) is not None:
        body = body[:start]
    try:
        return json.loads(f'"{body}"')
    except ValueError:  # not a JSON string after all
        return ""


def _open_escape(body: str) -> int | None:
    """Where an escape that cannot be decoded yet starts at the end of ``body``: a ``\\``
    or ``\\u`` with fewer than 4 hex digits, or a whole high surrogate ``\\udXXX`` whose low
    half has not come; None if the end is decodable."""
    start = body.rfind("\\")
    if start < 0:
        return None
    run = start - len(body[:start].rstrip("\\"))  # backslashes just before this one
    if run % 2:  # this one is the second half of an escaped backslash
        return None
    escape = body[start + 1 :]
    if not escape or (escape[0] == "u" and len(escape) < 5):
        return start
    if escape[0] == "u" and len(escape) == 5 and escape[1:3].lower() in ("d8", "d9", "da", "db"):
        return start
    return None


def calls_of(values: list[tuple[Any, str]], args_key: str = "arguments") -> Parsed:
    """Whole JSON values as calls; a value that is no call goes to the rest as its text."""
    parsed = Parsed()
    bad = []
    for value, text in values:
        call = call_from(value, args_key)
        if call is None:
            bad.append(text)
        else:
            parsed.calls.append(call)
    parsed.rest = "\n".join(bad)
    return parsed


def _joined(*parts: str) -> str:
    return "\n".join(p for p in parts if p)


class ToolParser(ABC):
    """Reads tool calls out of generated text (see the module docstring for the promise)."""

    name: str = ""
    skip_special_tokens: bool = True  # False where the call marker is a special token
    # How a model is told to call a tool when its template cannot render tools (the
    # --tool-call-parser override on such a model); None: the generic envelope.
    call_format: str | None = None

    def parse(self, text: str, *, final: bool) -> Parsed:
        """The content and whole calls of ``text``; ``final``: it is the whole reply, and the
        rest then joins the content (``rest`` is left empty)."""
        parsed = self._parse(text, final=final)
        if final and parsed.rest:
            return Parsed(_joined(parsed.content, parsed.rest.strip()), parsed.calls)
        return parsed

    @abstractmethod
    def _parse(self, text: str, *, final: bool) -> Parsed:
        """The content, the whole calls and the rest of ``text``."""


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    call_format = 'To call a tool, write <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'

    def _parse(self, text: str, *, final: bool) -> Parsed:
        first = text.find(self.START)
        if first < 0:
            return Parsed(text if final else hold_back(text, self.START))
        parsed, rest, pos = Parsed(text[:first].rstrip()), [], first
        while pos >= 0:
            start = pos + len(self.START)
            end = text.find(self.END, start)
            if end < 0:  # still being written (or cut off)
                rest.append(text[pos:])
                break
            values, tail = json_values(text[start:end])
            call = call_from(values[0][0]) if len(values) == 1 and not tail else None
            if call is None:
                rest.append(text[pos : end + len(self.END)])
            else:
                parsed.calls.append(call)
            pos = text.find(self.START, end + len(self.END))
        parsed.rest = _joined(*rest)
        return parsed


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    skip_special_tokens = False
    call_format = 'To call a tool, reply with only {"name": ..., "parameters": {...}}.'
    TAG = "<|python_tag|>"

    def _parse(self, text: str, *, final: bool) -> Parsed:
        body = text.removeprefix(self.TAG).lstrip()
        if not body:
            return Parsed(text if final else "")
        if not body.startswith("{"):
            return Parsed(text if final else hold_back(text, self.TAG))
        values, rest = json_values(body)
        parsed = calls_of(values, "parameters")
        parsed.rest = _joined(parsed.rest, rest)
        return parsed


class MistralParser(ToolParser):
    name = "mistral"
    skip_special_tokens = False
    call_format = 'To call tools, write [TOOL_CALLS][{"name": ..., "arguments": {...}}].'
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def _parse(self, text: str, *, final: bool) -> Parsed:
        first = text.find(self.TAG)
        if first < 0:
            return Parsed(text if final else hold_back(text, self.TAG))
        content, body = text[:first].rstrip(), text[first + len(self.TAG) :]
        if body.lstrip().startswith("["):  # [TOOL_CALLS] [{"name", "arguments"}, ...]
            items, rest = json_array_items(body)
            parsed = calls_of(items)
            return Parsed(content, parsed.calls, _joined(parsed.rest, rest))
        parsed, rest = Parsed(content), []  # name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
        parts = body.split(self.TAG)
        for i, part in enumerate(parts):
            name, sep, args = part.partition(self.ARGS)
            if not final and i == len(parts) - 1:  # the next call's tag may be on its way
                args = hold_back(args, self.TAG)
            values, tail = json_values(args) if sep else ([], "")
            call = None
            if len(values) == 1 and not tail:
                call = call_from({"name": name.strip(), "arguments": values[0][0]})
            if call is None:
                rest.append(self.TAG + part)
            else:
                parsed.calls.append(call)
        parsed.rest = _joined(*rest)
        return parsed


class GenericParser(ToolParser):
    """The envelope the server's grammar imposes on a model whose template has no tools."""

    name = "generic"
    _KEY = re.compile(r'\s*\{\s*"(tool_calls|tool_call|response)"\s*:\s*')

    def _parse(self, text: str, *, final: bool) -> Parsed:
        match = self._KEY.match(text)
        if match is None:  # not the envelope (yet): held until the end, then text
            return Parsed(text if final else "")
        key, body = match.group(1), text[match.end() :]
        if key == "tool_calls":
            items, rest = json_array_items(body)
        else:
            items, rest = json_values(body, _SPACE)
            items, rest = items[:1], ""
            if not items:
                rest = body
        if key != "response":
            parsed = calls_of(items)
            parsed.rest = _joined(parsed.rest, rest)
            return parsed
        if body.startswith('"'):  # the reply's text grows inside the JSON string
            return Parsed(string_prefix(body))
        try:  # not a string (the grammar forbids it; a --tool-call-parser override may not)
            envelope = partial_loads(text, Allow.ALL)
        except Exception:  # the library raises several kinds for text that is not JSON
            envelope = None
        response = envelope.get("response") if isinstance(envelope, dict) else None
        return Parsed(json.dumps(response) if response is not None else "")


class NamedParser(ToolParser):
    """``tool_choice`` naming a function: the reply is that function's arguments object."""

    name = "named"

    def __init__(self, function: str):
        self.function = function

    def _parse(self, text: str, *, final: bool) -> Parsed:
        values, rest = json_values(text, _SPACE)
        if not values:
            return Parsed(rest=rest)
        parsed = calls_of([({"name": self.function, "arguments": values[0][0]}, values[0][1])])
        parsed.rest = _joined(parsed.rest, *(t for _, t in values[1:]), rest)
        return parsed


class RequiredParser(ToolParser):
    """``tool_choice: "required"``: the reply is a JSON list of ``{"name", "arguments"}``."""

    name = "required"

    def _parse(self, text: str, *, final: bool) -> Parsed:
        items, rest = json_array_items(text)
        parsed = calls_of(items)
        parsed.rest = _joined(parsed.rest, rest)
        return parsed


class FirstCallOnly(ToolParser):
    """Another parser's result cut to its first call (``parallel_tool_calls: false`` with a
    model's own format, which the grammar does not hold); what follows it is dropped."""

    def __init__(self, inner: ToolParser):
        self.inner = inner
        self.name = inner.name
        self.skip_special_tokens = inner.skip_special_tokens
        self.call_format = inner.call_format

    def _parse(self, text: str, *, final: bool) -> Parsed:
        parsed = self.inner._parse(text, final=final)
        if parsed.calls:
            return Parsed(parsed.content, parsed.calls[:1])
        return parsed


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, GenericParser)
}


def parser_for_template(template: str) -> ToolParser:
    """The family of a chat template that renders tools; ``generic`` for one that does not."""
    if "[TOOL_CALLS]" in template:
        return MistralParser()
    if "<|python_tag|>" in template or "ipython" in template:
        return Llama3JsonParser()
    if "tools" in template:  # <tool_call> (Hermes, Qwen) and the format most templates use
        return HermesParser()
    return GenericParser()
