"""JSON-schema regular expressions (``pattern``, ``patternProperties``) as xgrammar must get them.

A schema's pattern is an ECMA-262 expression matched anywhere in the string; the validator
(``jsonschema``) reads it with Python's ``re``; xgrammar matches the whole string with its own
reader, so it admits a subset of what the pattern allows where the three readers agree.
:func:`enforceable_pattern` keeps to that common dialect and refuses the rest:

* lookaround, named groups, inline flags and backreferences (xgrammar drops a lookahead
  silently and admits what it excluded);
* ``\\s \\S \\D \\W``, and ``\\d`` or ``\\w`` in a negated class: Unicode sets on which ECMA-262
  and Python differ (``\\s`` and U+FEFF, ``\\D`` and U+0663);
* ``^`` or ``$`` other than at the ends of the pattern or of a top-level alternative (xgrammar
  ignores such an anchor: ``a$b`` would admit ``ab``);
* ``{`` other than as a quantifier, possessive quantifiers, nested classes.

It also works around a bug of xgrammar 0.2.9: an optional group that holds a quantifier loses
its other parts (``(?:xb+)?`` admits ``b``), while the same group with ``{0,1}`` is exact, so
``)?`` becomes ``){0,1}`` there. tests/engine/grammar/test_schema_soundness.py checks each rule.
"""

from __future__ import annotations

import re

_PLAIN_ESCAPES = set("dwtnrfv") | set("\\.*+?()[]{}|^$/-\"'")
_QUANTIFIER = re.compile(r"[*+?]|\{\d+(?:,\d*)?\}")


def enforceable_pattern(pattern: str) -> str:
    """``pattern`` rewritten for xgrammar (same language). Raises ValueError saying why it
    cannot be held exactly."""
    out: list[str] = []
    groups: list[bool] = []  # per open group: whether it holds a quantifier
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        start = i
        if c == "\\":
            _check_escape(pattern, i)
            i += _escape_length(pattern, i)
        elif c == "[":
            i = _class_end(pattern, i)
        elif c == "(":
            if pattern.startswith("(?", i) and not pattern.startswith("(?:", i):
                raise ValueError(
                    f"the group {pattern[i : i + 4]!r}... is not supported (only '(?:')"
                )
            groups.append(False)
            i += 3 if pattern.startswith("(?:", i) else 1
            out.append(pattern[start:i])
            continue
        elif c == ")":
            if not groups:
                raise ValueError("an unopened ')'")
            held = groups.pop()
            i += 1
            if held and pattern[i : i + 1] == "?":
                out.append("){0,1}")  # xgrammar's optional group with a quantifier inside
                i += 1
                if pattern[i : i + 1] == "+":
                    raise ValueError("possessive quantifiers are not supported")
                if pattern[i : i + 1] == "?":
                    out.append("?")  # lazy: the same strings match
                    i += 1
                if groups:
                    groups[-1] = True
            else:
                out.append(")")
                if groups and held:
                    groups[-1] = True
                i = _quantifier(pattern, i, out, groups)
            continue
        elif c == "^" and not (i == 0 or (not groups and out[-1] == "|")):  # "\\|" is literal
            raise ValueError(
                "'^' is only supported at the start of the pattern or of an alternative"
            )
        elif c == "$" and not (i == n - 1 or (not groups and pattern[i + 1] == "|")):
            raise ValueError("'$' is only supported at the end of the pattern or of an alternative")
        elif c == "{":
            raise ValueError("'{' is only supported as a quantifier ({n}, {n,}, {n,m}); escape it")
        elif c in "*+?":
            raise ValueError(f"{c!r} follows nothing it could repeat")
        else:
            i += 1
        out.append(pattern[start:i])
        i = _quantifier(pattern, i, out, groups)
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"not a regular expression the validator can read: {exc}") from None
    return "".join(out)


def _quantifier(pattern: str, i: int, out: list[str], groups: list[bool]) -> int:
    """Copy the quantifier (and its lazy ``?``) at ``i``, if any; the index after it."""
    match = _QUANTIFIER.match(pattern, i)
    if match is None:
        return i
    end = match.end()
    if pattern[end : end + 1] == "+":
        raise ValueError("possessive quantifiers are not supported")
    if pattern[end : end + 1] == "?":
        end += 1  # lazy: the same strings match
    if groups:
        groups[-1] = True
    out.append(pattern[i:end])
    return end


def _escape_length(pattern: str, i: int) -> int:
    return {"x": 4, "u": 6}.get(pattern[i + 1 : i + 2], 2)


def _check_escape(pattern: str, i: int, *, negated: bool = False) -> None:
    kind = pattern[i + 1 : i + 2]
    if kind == "x" and re.fullmatch(r"[0-9A-Fa-f]{2}", pattern[i + 2 : i + 4]):
        return
    if kind == "u" and re.fullmatch(r"[0-9A-Fa-f]{4}", pattern[i + 2 : i + 6]):
        return
    if kind in ("d", "w") and negated:
        raise ValueError(
            f"'\\{kind}' in a negated class is read differently by ECMA-262 and Python"
        )
    if kind in ("s", "S", "D", "W"):
        raise ValueError(
            f"'\\{kind}' is read differently by ECMA-262 and Python (Unicode spaces and digits);"
            " write the characters as a class, e.g. [ \\t]"
        )
    if kind not in _PLAIN_ESCAPES:
        raise ValueError(f"the escape '\\{kind}' is not supported")


def _class_end(pattern: str, start: int) -> int:
    """The index after the character class opening at ``start``; raises ValueError if refused."""
    i = start + 1
    negated = pattern[i : i + 1] == "^"
    i += negated
    if pattern[i : i + 1] == "]":
        i += 1  # a leading ']' is literal
    while i < len(pattern):
        c = pattern[i]
        if c == "]":
            return i + 1
        if c == "[":
            raise ValueError("'[' inside a character class is not supported; escape it")
        if c == "\\":
            _check_escape(pattern, i, negated=negated)
            i += _escape_length(pattern, i)
            continue
        i += 1
    raise ValueError("the character class is not closed")
