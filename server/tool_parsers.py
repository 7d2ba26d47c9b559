"""Tool calls out of generated text: one parser per model family, whole or while streaming.

A parser reads the text generated so far and returns ``Parsed``: the ``content`` (text for the
user) and the tool ``calls``. It is called with ``final=False`` on every prefix of a stream and
with ``final=True`` on the whole text, and keeps one promise that makes a stream agree with the
whole reply: what a non-final parse returns is a prefix of what the final parse returns (the
content, each call's name once given, each call's arguments text). So it holds back text that
could still turn into a call (a partial ``<tool_call>`` tag, trailing whitespace) and gives
arguments as the stable prefix of their final JSON text.

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

Incomplete JSON is read with ``partial-json-parser`` (what vLLM's tool parsers use) rather than
by hand; complete JSON with the standard library.
"""

from __future__ import annotations

import itertools
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from partial_json_parser import Allow
from partial_json_parser import loads as partial_loads

# Incomplete strings, numbers and literals are left out of a partial parse: only values that
# can no longer change are kept, so their JSON text is a prefix of the final one.
_STABLE = Allow.OBJ | Allow.ARR


@dataclass(slots=True)
class ParsedCall:
    """One tool call: ``name`` None until it is whole; ``arguments`` JSON text (a prefix of
    the final text until the call is complete)."""

    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class Parsed:
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


def partial_json(text: str, allow: Allow = _STABLE) -> Any:
    """The complete part of a JSON prefix; None when nothing is complete yet."""
    if not text.strip():
        return None
    try:
        return partial_loads(text, allow)
    except Exception:  # the library raises several kinds for text that is not a JSON prefix
        return None


def arguments_text(value: Any, *, final: bool) -> str:
    """The JSON text of a call's arguments; while not final, only the part that cannot change
    (the closing brackets of a partial value are cut)."""
    if value is None:
        return "{}" if final else ""
    if isinstance(value, str):  # some models send the arguments as a JSON string
        if not final:
            return ""
        try:
            value = json.loads(value)
        except ValueError:
            return value
    text = json.dumps(value, ensure_ascii=False)
    return text if final else text.rstrip("}]")


def call_from(obj: Any, *, final: bool, args_key: str = "arguments") -> ParsedCall | None:
    """A call from a ``{"name", args_key}`` object (``parameters`` is accepted too)."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    name = name if isinstance(name, str) else None
    args = obj.get(args_key, obj.get("parameters"))
    if name is None:
        return ParsedCall()
    return ParsedCall(name, arguments_text(args, final=final))


def hold_back(text: str, tag: str) -> str:
    """``text`` without a trailing prefix of ``tag`` and without trailing whitespace."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            text = text[:-n]
            break
    return text.rstrip()


def complete_calls(objs: list[Any], args_key: str = "arguments") -> list[ParsedCall] | None:
    """Calls from whole objects; None if any is not a well-formed call."""
    calls = [call_from(o, final=True, args_key=args_key) for o in objs]
    if any(c is None or c.name is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


class ToolParser(ABC):
    """Reads tool calls out of generated text (see the module docstring for the promise)."""

    name: str = ""
    skip_special_tokens: bool = True  # False where the call marker is a special token
    # How a model is told to call a tool when its template cannot render tools (the
    # --tool-call-parser override on such a model); None: the generic envelope.
    call_format: str | None = None

    def parse(self, text: str, *, final: bool) -> Parsed:
        """The content and calls of ``text``; ``final``: it is the whole reply.

        A whole reply whose calls are malformed or cut off (``max_tokens``) keeps what its last
        partial parse had, so the calls a stream already sent stay; with none, the whole text
        is the content."""
        parsed = self._parse(text, final=final)
        if parsed is not None:
            return parsed
        partial = self._parse(text, final=False) or Parsed()
        calls = list(itertools.takewhile(lambda c: c.name is not None, partial.calls))
        return Parsed(partial.content, calls) if calls else Parsed(text)

    @abstractmethod
    def _parse(self, text: str, *, final: bool) -> Parsed | None:
        """None for a final text whose calls are malformed."""


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    call_format = 'To call a tool, write <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'

    def _parse(self, text: str, *, final: bool) -> Parsed | None:
        first = text.find(self.START)
        if first < 0:
            return Parsed(text if final else hold_back(text, self.START))
        calls, bodies, pos = [], [], first
        while pos >= 0:
            start = pos + len(self.START)
            end = text.find(self.END, start)
            bodies.append((text[start : end if end >= 0 else len(text)], end >= 0))
            pos = text.find(self.START, end + len(self.END)) if end >= 0 else -1
        content = text[:first].rstrip()
        if final:
            try:
                objs = [json.loads(body) for body, _ in bodies]
            except ValueError:
                return None
            calls = complete_calls(objs)
            return None if calls is None else Parsed(content, calls)
        for body, closed in bodies:
            body = body if closed else hold_back(body, self.END)
            call = call_from(partial_json(body), final=False)
            calls.append(call or ParsedCall())
        return Parsed(content, calls)


def json_sequence(text: str) -> tuple[list[Any], str]:
    """Whole JSON values separated by whitespace or ``;``, and the rest of the text."""
    decoder, objs, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
        if pos == len(text):
            return objs, ""
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return objs, text[pos:]
        objs.append(obj)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    skip_special_tokens = False
    call_format = 'To call a tool, reply with only {"name": ..., "parameters": {...}}.'
    TAG = "<|python_tag|>"

    def _parse(self, text: str, *, final: bool) -> Parsed | None:
        body = text.removeprefix(self.TAG).lstrip()
        if not body:
            return Parsed(text if final else "")
        if not body.startswith("{"):
            return Parsed(text if final else hold_back(text, self.TAG))
        objs, rest = json_sequence(body)
        if final:
            calls = complete_calls(objs, "parameters")
            return None if calls is None or rest.strip() else Parsed("", calls)
        calls = [call_from(o, final=True, args_key="parameters") or ParsedCall() for o in objs]
        if rest:
            calls.append(call_from(partial_json(rest), final=False) or ParsedCall())
        return Parsed("", calls)


class MistralParser(ToolParser):
    name = "mistral"
    skip_special_tokens = False
    call_format = 'To call tools, write [TOOL_CALLS][{"name": ..., "arguments": {...}}].'
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def _parse(self, text: str, *, final: bool) -> Parsed | None:
        first = text.find(self.TAG)
        if first < 0:
            return Parsed(text if final else hold_back(text, self.TAG))
        content, body = text[:first].rstrip(), text[first + len(self.TAG) :]
        if body.lstrip().startswith("["):  # [TOOL_CALLS] [{"name", "arguments"}, ...]
            if final:
                try:
                    objs = json.loads(body)
                except ValueError:
                    return None
                calls = complete_calls(objs if isinstance(objs, list) else [objs])
                return None if calls is None else Parsed(content, calls)
            objs = partial_json(body) or []
            return Parsed(content, [call_from(o, final=False) or ParsedCall() for o in objs])
        calls = []  # name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
        for part in body.split(self.TAG):
            name, sep, args = part.partition(self.ARGS)
            if not sep:
                if final:
                    return None
                calls.append(ParsedCall())
                continue
            if final:
                try:
                    value = json.loads(args)
                except ValueError:
                    return None
            else:
                value = partial_json(args)
            calls.append(ParsedCall(name.strip(), arguments_text(value, final=final)))
        return Parsed(content, calls)


class GenericParser(ToolParser):
    """The envelope the server's grammar imposes on a model whose template has no tools."""

    name = "generic"

    def _parse(self, text: str, *, final: bool) -> Parsed | None:
        if final:
            try:
                obj = json.loads(text)
            except ValueError:
                return None
        else:
            obj = partial_json(text, Allow.ALL)
        if not isinstance(obj, dict):
            return Parsed(text if final else "")
        if "response" in obj:
            response = obj["response"]
            return Parsed(response if isinstance(response, str) else json.dumps(response))
        stable = obj if final else partial_json(text)
        if not isinstance(stable, dict):
            return Parsed()
        if "tool_call" in stable:
            items = [stable["tool_call"]]
        else:
            items = stable.get("tool_calls") or []
        if final:
            calls = complete_calls(items if isinstance(items, list) else [items])
            return None if calls is None else Parsed("", calls)
        return Parsed("", [call_from(o, final=False) or ParsedCall() for o in items])


class NamedParser(ToolParser):
    """``tool_choice`` naming a function: the reply is that function's arguments object."""

    name = "named"

    def __init__(self, function: str):
        self.function = function

    def _parse(self, text: str, *, final: bool) -> Parsed | None:
        if final:
            try:
                args = json.loads(text)
            except ValueError:  # cut off by max_tokens
                return None
            return Parsed("", [ParsedCall(self.function, arguments_text(args, final=True))])
        args = partial_json(text)
        return Parsed("", [ParsedCall(self.function, arguments_text(args, final=False))])


class RequiredParser(ToolParser):
    """``tool_choice: "required"``: the reply is a JSON list of ``{"name", "arguments"}``."""

    name = "required"

    def _parse(self, text: str, *, final: bool) -> Parsed | None:
        if final:
            try:
                objs = json.loads(text)
            except ValueError:
                return None
            calls = complete_calls(objs if isinstance(objs, list) else [objs])
            return None if calls is None else Parsed("", calls)
        objs = partial_json(text) or []
        return Parsed("", [call_from(o, final=False) or ParsedCall() for o in objs])


class FirstCallOnly(ToolParser):
    """Another parser's result cut to its first call (``parallel_tool_calls: false`` with a
    model's own format, which the grammar does not hold)."""

    def __init__(self, inner: ToolParser):
        self.inner = inner
        self.name = inner.name
        self.skip_special_tokens = inner.skip_special_tokens
        self.call_format = inner.call_format

    def parse(self, text: str, *, final: bool) -> Parsed:
        parsed = self.inner.parse(text, final=final)
        return Parsed(parsed.content, parsed.calls[:1])

    def _parse(self, text: str, *, final: bool) -> Parsed | None:
        return self.inner._parse(text, final=final)


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
