"""JSON text still being written, read for what is already fixed.

Tool calls are parsed on every token of a stream, so the parsers read unfinished JSON. Two
readings:

* ``string_prefix``: the decoded part of an open JSON string (the generic envelope's growing
  ``{"response": "..."}`` text);
* ``fixed_dump`` (and ``GrowingDump``, the same for a text that grows token by token): the part
  of a value's serialization (``dump``, the text a whole call's ``arguments`` are) that no later
  text can change, which a streamed call sends as argument fragments.

``fixed_dump(t)`` promises, for every JSON text ``t + s`` that starts with ``t``: its result is a
prefix of ``dump(DECODER.decode(t + s))``, and it only grows as ``t`` grows. So it holds back

* a number until a delimiter follows it (``12`` may become ``123``, and ``1.50`` dumps as
  ``1.5``), a literal until it is whole, an object key until its value has started;
* an escape still being written in an open string (``\\u00``), and a high surrogate until its low
  half has come (the pair dumps as one character);
* the quote and brackets that will close what is still open.

The rest of an open string is safe to send: ``dump`` escapes a string character by character,
so a prefix of a string dumps to a prefix of the whole string's dump. Objects keep the *first*
value of a repeated key (``DECODER``), in the stream and in the whole reply alike: a stream that
has sent the first value cannot take it back.

The standard library's C decoder does the scanning (whole values with ``raw_decode``, strings and
keys with ``scanstring``); Python only walks the open containers on the path to the end of the
text. ``GrowingDump`` resumes inside the string open at the end of the text, where a long
argument (a file's content, code) spends its tokens, so each token costs its own characters, not
another pass over the text. partial-json-parser, which the parsers use for the envelope's odd
``response`` values, walks the text in Python character by character (``fix``) or copies it for
every quote (``fix_fast``): too slow to run on every token of a long argument.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from json.decoder import scanstring
from typing import Any

_SPACE = " \t\r\n"
_AFTER_NUMBER = frozenset(_SPACE + ",]}")  # what may follow a number that has ended


def _first_wins(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object from its members, a repeated key keeping its first value (see the module
    docstring); the common case, no repeat, costs one ``dict()``."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        obj = {}
        for key, value in pairs:
            obj.setdefault(key, value)
    return obj


DECODER = json.JSONDecoder(object_pairs_hook=_first_wins)


def dump(value: Any) -> str:
    """The JSON text of a decoded value, as a call's ``arguments`` carry it."""
    return json.dumps(value, ensure_ascii=False)


def skip_space(text: str, pos: int, chars: str = _SPACE) -> int:
    """The first position at or after ``pos`` whose character is not in ``chars``."""
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


@dataclass(frozen=True, slots=True)
class Prefix:
    """What the JSON value at the start of a text holds so far.

    value: the value (an open string: its decoded part; an open object or array: its whole
    members, then the fixed part of its open last member); unclosed: how many characters that
    ``dump(value)`` ends with the text has not written yet (the quote and brackets that will
    close what is open; 0 for a whole value); end: where a whole value's text ends, or where
    the decoded part of the string open at the end of the text ends; in_string: the text ends
    inside a string whose decoded part is the last thing ``value`` dumps before the closers."""

    value: Any
    unclosed: int
    end: int
    in_string: bool = False

    def fixed_text(self) -> str:
        """The part of the final value's ``dump`` that is already fixed."""
        text = dump(self.value)
        return text[: len(text) - self.unclosed]


def string_prefix(text: str) -> str:
    """The decoded part of a JSON string that ``text`` opens (``"ab\\u00`` -> ``ab``): the
    whole string once it has closed, else all of it but an escape still being written (or a
    surrogate half still waiting for its pair); "" for text that opens no string."""
    return _string_prefix(text, 0).value if text.startswith('"') else ""


def _string_prefix(text: str, pos: int) -> Prefix:
    """The string whose opening quote is at ``pos``, whole or open at the end of ``text``.

    One pass of the standard library's C ``scanstring``: a quote put past the end closes an
    open string, so the same call decodes a whole string or the open one's text so far."""
    try:
        value, end = scanstring(text + '"', pos + 1)
    except ValueError:  # an escape still being written at the end (or no JSON string)
        return _open_string(text, pos)
    if end <= len(text):
        return Prefix(value, 0, end)
    if value and "\ud800" <= value[-1] <= "\udbff":  # perhaps an escape waiting for its pair
        return _open_string(text, pos)
    return Prefix(value, 1, len(text), in_string=True)


def _open_string(text: str, pos: int) -> Prefix:
    """The string opened at ``pos`` and not closed, without an escape still being written at
    the end ("" if it is not a JSON string after all)."""
    body = text[pos + 1 :]
    while (start := _open_escape(body)) is not None:
        body = body[:start]
    try:
        return Prefix(json.loads(f'"{body}"'), 1, pos + 1 + len(body), in_string=True)
    except ValueError:
        return Prefix("", 1, pos + 1)


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


def value_prefix(text: str, pos: int = 0) -> Prefix | None:
    """The value whose text starts at ``pos`` (after any whitespace), whole or as far as it
    is fixed; None while nothing of it is (a number or literal still being written), or for
    text that is no JSON. Text after a whole value is not read. An object or array is read
    member by member (its text is usually still open: one scan, not a failed decode first)."""
    pos = skip_space(text, pos)
    first = text[pos : pos + 1]
    if first == "{":
        return _object_prefix(text, pos)
    if first == "[":
        return _array_prefix(text, pos)
    return _member_prefix(text, pos)


def _member_prefix(text: str, pos: int) -> Prefix | None:
    """The value at ``pos`` (no whitespace before it) inside an object or array: a whole one
    in one ``raw_decode``, an open container member by member, a string in one scan."""
    first = text[pos : pos + 1]
    if first == '"':
        return _string_prefix(text, pos)
    try:
        value, end = DECODER.raw_decode(text, pos)
    except ValueError:
        return value_prefix(text, pos) if first in ("{", "[") else None
    growing = end == len(text) or text[end] not in _AFTER_NUMBER
    if isinstance(value, int | float) and not isinstance(value, bool) and growing:
        return None
    return Prefix(value, 0, end)


def _object_prefix(text: str, pos: int) -> Prefix | None:
    """The object whose ``{`` is at ``pos``: its whole members, then its open one."""
    members: dict[str, Any] = {}
    pos = skip_space(text, pos + 1)
    first = True
    while pos < len(text):
        if text[pos] == "}":
            return Prefix(members, 0, pos + 1)
        if not first:
            if text[pos] != ",":
                return None
            pos = skip_space(text, pos + 1)
            if pos == len(text):
                break
        first = False
        if text[pos] != '"':
            return None
        try:
            key, pos = scanstring(text, pos + 1)
        except ValueError:  # the key is still being written
            break
        pos = skip_space(text, pos)
        if pos == len(text):
            break
        if text[pos] != ":":
            return None
        member = _member_prefix(text, skip_space(text, pos + 1))
        if member is None:
            break
        if key in members:  # a repeated key: its value is not the object's (first wins)
            if member.unclosed:
                return Prefix(members, 1, len(text))
        else:
            members[key] = member.value
            if member.unclosed:  # the member is open: it ends the text
                return Prefix(members, 1 + member.unclosed, member.end, member.in_string)
        pos = skip_space(text, member.end)
    return Prefix(members, 1, len(text))


def _array_prefix(text: str, pos: int) -> Prefix | None:
    """The array whose ``[`` is at ``pos``: its whole items, then its open one."""
    items: list[Any] = []
    pos = skip_space(text, pos + 1)
    while pos < len(text):
        if text[pos] == "]":
            return Prefix(items, 0, pos + 1)
        if items:
            if text[pos] != ",":
                return None
            pos = skip_space(text, pos + 1)
            if pos == len(text):
                break
        item = _member_prefix(text, pos)
        if item is None:
            break
        items.append(item.value)
        if item.unclosed:
            return Prefix(items, 1 + item.unclosed, item.end, item.in_string)
        pos = skip_space(text, item.end)
    return Prefix(items, 1, len(text))


def fixed_dump(text: str) -> str | None:
    """The part of ``dump`` of the JSON object that ``text`` starts (and may not finish)
    that no later text can change; None unless ``text`` starts an object."""
    prefix = value_prefix(text)
    if prefix is None or not isinstance(prefix.value, dict):
        return None
    return prefix.fixed_text()


class GrowingDump:
    """``fixed_dump`` of one object's text as it grows, read again at every token.

    While the text grows inside the string that was open at its end, only the new characters
    are decoded and escaped (``dump`` escapes a string character by character), so a long
    argument costs each token its own characters; anything else reads the text again."""

    def __init__(self) -> None:
        self.text = ""  # the text last read
        self.fixed: str | None = None  # its fixed dump
        self.resume: int | None = None  # where its open string's decoded part ends
        self.whole = False  # the text holds the whole object: its fixed dump is the final one

    def read(self, text: str) -> str | None:
        """``fixed_dump(text)``, for a text that starts with the one read last time."""
        if self.resume is not None and self.fixed is not None and text.startswith(self.text):
            grown = _string_prefix('"' + text[self.resume :], 0)
            if grown.in_string:  # still inside the same string
                self.fixed += dump(grown.value)[1:-1]
                self.resume += grown.end - 1
                self.text = text
                return self.fixed
        prefix = value_prefix(text)
        self.text = text
        if prefix is None or not isinstance(prefix.value, dict):
            self.fixed = self.resume = None
            self.whole = False
            return None
        self.fixed = prefix.fixed_text()
        self.resume = prefix.end if prefix.in_string else None
        self.whole = prefix.unclosed == 0
        return self.fixed
