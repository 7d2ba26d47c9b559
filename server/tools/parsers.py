"""Tool calls out of generated text: one parser per model family, whole or while streaming.

A parser reads the text generated so far and returns ``Parsed``: the ``content`` (text for the
user), the tool ``calls`` whose JSON is complete, the ``rest`` (text that is not a call: one the
model left malformed), and the ``pending`` text at the end that is not whole yet (a call still
being written; at the end, one that ``max_tokens`` cut off). Once the pending text is sure to be
a call (its name is whole and its arguments object has opened), ``partial`` has its name and the
text of its arguments so far, of which a stream sends the part that fixes the final arguments
(``paged_serve.server.tools.json_prefix``) as fragments. A call is only ever in ``calls`` once
its JSON has closed, so its ``arguments`` are the JSON text of a whole object by construction,
re-serialized (``json_prefix.dump``) so that the fragments a stream sent are a prefix of them.

The parser is called with ``final=False`` on every prefix of a stream and with ``final=True`` on
the whole text, and keeps one promise that makes a stream agree with the whole reply: the
content and calls of a non-final parse are prefixes of the final ones (and a partial call's
arguments text only grows until the call is whole). At the
end (``ToolParser.ended``), the rest and the pending text join the content, so a cut off or
malformed call reaches the client as text, never as a call with broken arguments; a forced
reply's (``named``, ``required``: the grammar makes it all calls) never does, its content is
empty.

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
prefix of its JSON string (``json_prefix.string_prefix``), and a ``response``
that is not a string (which the grammar forbids, but a ``--tool-call-parser`` override may not)
with ``partial-json-parser`` (what vLLM's tool parsers use).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from json.decoder import scanstring
from typing import Any

from partial_json_parser import Allow
from partial_json_parser import loads as partial_loads

from paged_serve.server.tools.json_prefix import DECODER, dump, skip_space, string_prefix

_SPACE = " \t\r\n"


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One whole tool call: ``arguments`` is the JSON text of an object."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class PartialCall:
    """A call still being written, once it is sure to be one (its name is whole, its arguments
    object has opened): ``arguments`` is the text of that object so far, from its ``{`` (text
    after the object may follow); ``json_prefix.GrowingDump`` reads what of the final
    ``arguments`` it fixes."""

    name: str
    arguments: str


@dataclass(slots=True)
class Parsed:
    """content: text for the user; calls: the whole calls; rest: text that is not a call;
    pending: the text at the end that is not whole yet; partial: ``pending`` read as a call
    so far (None while it is not sure to be one). Rest and pending join the content at the end
    (``ToolParser.ended``)."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    rest: str = ""
    pending: str = ""
    partial: PartialCall | None = None


def call_from(obj: Any, args_key: str = "arguments") -> ParsedCall | None:
    """A call from a whole ``{"name", args_key}`` object (``parameters`` is accepted too);
    None unless the name is a string and the arguments an object (or its JSON text)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("parameters", {}))
    if isinstance(args, str):  # some models send the arguments as a JSON string
        try:
            args = DECODER.decode(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], dump(args))


def partial_call(text: str, args_key: str = "arguments") -> PartialCall | None:
    """The call that ``text`` (a ``{"name", args_key}`` object, ``parameters`` accepted too)
    starts, once its name is whole and its arguments object has opened; else None. The members
    before the arguments are read whole; the arguments are not read here (a stream reads
    them, ``json_prefix.GrowingDump``): a call is in ``partial`` for as long as it is written,
    and reading a long argument again here would cost every token a pass over it."""
    pos = skip_space(text, 0)
    if not text.startswith("{", pos):
        return None
    name, pos = None, skip_space(text, pos + 1)
    while text.startswith('"', pos):
        try:
            key, pos = scanstring(text, pos + 1)
        except ValueError:  # the key is still being written
            return None
        pos = skip_space(text, pos)
        if not text.startswith(":", pos):
            return None
        pos = skip_space(text, pos + 1)
        if key in (args_key, "parameters"):
            opened = name is not None and text.startswith("{", pos)
            return PartialCall(name, text[pos:]) if opened else None
        try:
            value, pos = DECODER.raw_decode(text, pos)
        except ValueError:  # still being written
            return None
        if key == "name" and name is None and isinstance(value, str) and value:
            name = value
        pos = skip_space(text, pos)
        if not text.startswith(",", pos):
            return None
        pos = skip_space(text, pos + 1)
    return None


def hold_back(text: str, tag: str) -> str:
    """``text`` without a trailing prefix of ``tag`` and without trailing whitespace."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            text = text[:-n]
            break
    return text.rstrip()


def json_values(text: str, separators: str = _SPACE + ";") -> tuple[list[tuple[Any, str]], str]:
    """The whole JSON values at the start of ``text``, separated by ``separators``, each with
    its own text; and the text from the first value that is not whole yet."""
    values, pos = [], skip_space(text, 0, separators)
    while pos < len(text):
        try:
            value, end = DECODER.raw_decode(text, pos)
        except ValueError:
            return values, text[pos:]
        values.append((value, text[pos:end]))
        pos = skip_space(text, end, separators)
    return values, ""


def json_array_items(text: str) -> tuple[list[tuple[Any, str]], str]:
    """The whole elements of a JSON array that ``text`` starts (and may not yet finish), each
    with its own text; and the text from the first element that is not whole yet ("" once
    the array has closed or while nothing is pending). Text that is no array is all rest."""
    pos = skip_space(text, 0)
    if pos == len(text):
        return [], ""
    if text[pos] != "[":
        return [], text[pos:]
    items: list[tuple[Any, str]] = []
    pos = skip_space(text, pos + 1)
    while pos < len(text) and text[pos] != "]":
        if items:
            if text[pos] != ",":
                return items, text[pos:]
            pos = skip_space(text, pos + 1)
            if pos == len(text):
                break
        try:
            value, end = DECODER.raw_decode(text, pos)
        except ValueError:
            return items, text[pos:]
        items.append((value, text[pos:end]))
        pos = skip_space(text, end)
    return items, ""


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


def pending_call(parsed: Parsed, pending: str, args_key: str = "arguments") -> Parsed:
    """``parsed`` with ``pending``, the unfinished text after its values, read as a call."""
    parsed.pending = pending
    parsed.partial = partial_call(pending, args_key) if pending else None
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
    # The grammar forces the reply to be calls (tool_choice required or named): what is not a
    # whole call is never content.
    forced: bool = False

    def parse(self, text: str, *, final: bool) -> Parsed:
        """The content and whole calls of ``text``; ``final``: it is the whole reply, which
        ``ended`` closes."""
        parsed = self.read(text, final=final)
        return self.ended(parsed) if final else parsed

    def read(self, text: str, *, final: bool) -> Parsed:
        """The content, whole calls, rest, pending text and partial call of ``text``;
        ``final``: no more text comes (a tag's first characters are then text)."""
        return self._parse(text, final=final)

    def ended(self, parsed: Parsed, *, with_pending: bool = True) -> Parsed:
        """A whole reply's parse: the rest and the pending text join the content (a forced
        reply's are dropped); ``with_pending`` false leaves the pending text out, where a
        stream has already sent it as a call's fragments."""
        if self.forced:
            return Parsed("", parsed.calls)
        rest = _joined(parsed.rest, parsed.pending if with_pending else "").strip()
        return Parsed(_joined(parsed.content, rest), parsed.calls)

    @abstractmethod
    def _parse(self, text: str, *, final: bool) -> Parsed:
        """The content, the whole calls, the rest, the pending text and its partial call."""


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
                parsed.pending = text[pos:]
                parsed.partial = partial_call(text[start:])
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
        values, pending = json_values(body)
        return pending_call(calls_of(values, "parameters"), pending, "parameters")


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
            items, pending = json_array_items(body)
            parsed = pending_call(calls_of(items), pending)
            parsed.content = content
            return parsed
        parsed, rest = Parsed(content), []  # name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
        parts = body.split(self.TAG)
        for i, part in enumerate(parts):
            name, sep, args = part.partition(self.ARGS)
            last = i == len(parts) - 1
            if not final and last:  # the next call's tag may be on its way
                args = hold_back(args, self.TAG)
            values, tail = json_values(args) if sep else ([], "")
            call = None
            if len(values) == 1 and not tail:
                call = call_from({"name": name.strip(), "arguments": values[0][0]})
            if call is not None:
                parsed.calls.append(call)
            elif last and not values:  # the last call's arguments are still being written
                parsed.pending = self.TAG + part
                if sep and name.strip() and args.lstrip().startswith("{"):
                    parsed.partial = PartialCall(name.strip(), args.lstrip())
            else:
                rest.append(self.TAG + part)
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
            items, pending = json_array_items(body)
            return pending_call(calls_of(items), pending)
        if key == "tool_call":
            items, _ = json_values(body, _SPACE)
            if not items:
                return pending_call(Parsed(), body)
            return calls_of(items[:1])
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
    forced = True

    def __init__(self, function: str):
        self.function = function

    def _parse(self, text: str, *, final: bool) -> Parsed:
        values, pending = json_values(text, _SPACE)
        if not values:
            opened = pending.startswith("{")  # json_values skipped the space before it
            partial = PartialCall(self.function, pending) if opened else None
            return Parsed(pending=pending, partial=partial)
        parsed = calls_of([({"name": self.function, "arguments": values[0][0]}, values[0][1])])
        parsed.rest = _joined(parsed.rest, *(t for _, t in values[1:]))
        parsed.pending = pending
        return parsed


class RequiredParser(ToolParser):
    """``tool_choice: "required"``: the reply is a JSON list of ``{"name", "arguments"}``."""

    name = "required"
    forced = True

    def _parse(self, text: str, *, final: bool) -> Parsed:
        items, pending = json_array_items(text)
        return pending_call(calls_of(items), pending)


class FirstCallOnly(ToolParser):
    """Another parser's result cut to its first call (``parallel_tool_calls: false`` with a
    model's own format, which the grammar does not hold); what follows it is dropped."""

    def __init__(self, inner: ToolParser):
        self.inner = inner
        self.name = inner.name
        self.skip_special_tokens = inner.skip_special_tokens
        self.call_format = inner.call_format
        self.forced = inner.forced

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
