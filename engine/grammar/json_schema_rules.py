"""Which JSON-schema keywords the grammar library (xgrammar 0.2.9) enforces exactly, and what
becomes of the rest: rewritten into a form it does enforce, or refused with the keyword's path.

``enforceable_schema(schema)`` returns the schema to compile: a copy, rewritten where a keyword can
be enforced through another one, or raises ValueError naming the first keyword (and its path) whose
constraint the grammar would silently weaken. Every verdict below is decided by
tests/engine/grammar/test_schema_soundness.py, which compiles each case, checks with a JSON-schema
validator (``jsonschema``) that every string the grammar admits validates, and shows for each
refusal a string that the unguarded grammar admits although the validator rejects it.

Rewritten (so that they hold):

* ``required`` naming a property missing from ``properties``: xgrammar never writes such a key,
  so ``{}`` came out. The property is added with the value schema the object allows for unlisted
  keys (``additionalProperties`` when it is a schema, else ``{}``);
* ``format`` ``date``, ``date-time``, ``time``, ``ipv4``: xgrammar admits April 31 and leading
  zeros, so each becomes the exact ``pattern`` of ``FORMAT_PATTERNS``;
* a length, number, array or object keyword on a schema without ``type`` (xgrammar ignores it
  there): the schema gets the ``type`` the keyword is about;
* ``enum`` beside ``type``: xgrammar writes every listed value, so values of another type go.

Refused (see ``_problem``): the keywords of ``REFUSED_KEYWORDS``; validation keywords beside
``$ref``/``anyOf``/``oneOf``/``allOf`` or beside ``enum``/``const`` (xgrammar applies only the
combinator or the listed values); ``pattern`` or ``format`` with ``minLength``/``maxLength``, or
``pattern`` with ``format`` (xgrammar keeps one); ``multipleOf`` unless on integers, at most
``MAX_MULTIPLE_OF``, without a range; ``oneOf`` whose branches may overlap (it is applied as
``anyOf``); ``uniqueItems: true``; unlisted keys (``additionalProperties`` open) beside listed
or pattern keys, since an escaped key (``"\\u0061"``) repeats a listed one; ``minProperties``
where keys may repeat; ``propertyNames`` beside listed keys (xgrammar checks only unlisted ones);
``patternProperties`` whose pattern matches a listed key; formats not in ``ENFORCED_FORMATS``
or ``FORMAT_PATTERNS`` (unknown format names are annotations, as the standard says); regular
expressions outside the dialect xgrammar and the validator read alike
(engine/grammar/schema_patterns.py, which also rewrites the patterns xgrammar would misread).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from typing import Any

from paged_serve.engine.grammar.schema_patterns import enforceable_pattern

MAX_SCHEMA_DEPTH = 64
MAX_MULTIPLE_OF = 1024  # xgrammar ignores a larger multipleOf
# Properties one object may list: xgrammar compiles an object in about N^2.3 time in its
# properties (1,000: about 3 CPU-seconds on a 2-core x86 box); beyond this the schema is
# refused before compiling. The compile budget (engine/grammar/probe.py) bounds the rest.
MAX_OBJECT_PROPERTIES = 1024

# Validation keywords xgrammar ignores or cannot honour, refused wherever they appear.
REFUSED_KEYWORDS = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "contains",
        "minContains",
        "maxContains",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "unevaluatedProperties",
        "unevaluatedItems",
        "additionalItems",
        "$dynamicRef",
        "$recursiveRef",
    }
)
# The keywords that only mean something for one JSON type.
TYPE_KEYWORDS = {
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "array": ("items", "prefixItems", "minItems", "maxItems", "uniqueItems"),
    "object": (
        "properties",
        "required",
        "additionalProperties",
        "patternProperties",
        "propertyNames",
        "minProperties",
        "maxProperties",
    ),
}
COMBINATORS = ("$ref", "anyOf", "oneOf", "allOf")
# Validation keywords enforced (some under the conditions of the module docstring).
ENFORCED_KEYWORDS = frozenset(
    {"type", "enum", "const", *COMBINATORS, *(k for keys in TYPE_KEYWORDS.values() for k in keys)}
)

_YEAR = r"(?:[0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})"  # 0001-9999
_MONTH_DAY = (
    r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
    r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    r"|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = f"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
# RFC 3339 full-time, without the leap second 60 (valid only at a few instants).
_TIME = (
    r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+){0,1}"
    r"(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
)
_IPV4_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
# Formats xgrammar gets wrong, as the exact pattern that replaces them.
FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "time": f"^{_TIME}$",
    "ipv4": rf"^(?:{_IPV4_OCTET}\.){{3}}{_IPV4_OCTET}$",
}
# Formats xgrammar enforces as the validator checks them.
ENFORCED_FORMATS = frozenset({"email", "ipv6", "uuid", "json-pointer"})
# The standard's other formats: xgrammar admits strings they reject, or nothing can check it.
REFUSED_FORMATS = frozenset(
    {
        "duration",
        "hostname",
        "idn-email",
        "idn-hostname",
        "iri",
        "iri-reference",
        "regex",
        "relative-json-pointer",
        "uri",
        "uri-reference",
        "uri-template",
    }
)

# Keywords whose values are schemas (or maps / lists of schemas) that the check descends into.
_SUBSCHEMA_KEYWORDS = ("items", "additionalProperties", "propertyNames", "additionalItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")

_VALIDATION_KEYWORDS = ENFORCED_KEYWORDS | REFUSED_KEYWORDS


def subschemas(node: Any, path: str = "schema", depth: int = 0) -> Iterator[tuple[str, dict]]:
    """Every schema object in ``node`` with its path (``schema.properties.a.items``), the
    objects themselves (not copies), outermost first."""
    if not isinstance(node, dict):
        return
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    yield path, node
    for key in _SUBSCHEMA_KEYWORDS:
        yield from subschemas(node.get(key), f"{path}.{key}", depth + 1)
    for key in _SUBSCHEMA_MAPS:
        children = node.get(key)
        if isinstance(children, dict):
            for name, child in children.items():
                yield from subschemas(child, f"{path}.{key}.{name}", depth + 1)
    for key in _SUBSCHEMA_LISTS:
        children = node.get(key)
        if isinstance(children, list):
            for i, child in enumerate(children):
                yield from subschemas(child, f"{path}.{key}[{i}]", depth + 1)


def enforceable_schema(schema: Any) -> Any:
    """The schema to compile: a rewritten copy of ``schema`` whose every constraint the grammar
    holds exactly. Raises ValueError naming the first keyword it cannot hold, with its path."""
    if not isinstance(schema, dict | bool):
        raise ValueError("a JSON schema must be an object (or true/false)")
    schema = copy.deepcopy(schema)
    # Innermost first: a parent that copies a child schema (required -> additionalProperties)
    # copies it already rewritten.
    for path, node in reversed(list(subschemas(schema))):
        _rewrite(node)
        problem = _problem(node, schema)
        if problem is not None:
            keyword, reason = problem
            raise ValueError(f"unsupported JSON schema keyword {keyword!r} at {path}: {reason}")
    return schema


def _types(node: dict) -> set[str]:
    kind = node.get("type")
    return {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()


def _rewrite(node: dict) -> None:
    """Rewrite ``node`` in place into a form xgrammar enforces (the module docstring's list)."""
    if "type" not in node and not any(k in node for k in ("enum", "const", *COMBINATORS)):
        implied = [
            t for t, keys in TYPE_KEYWORDS.items() if any(_constrains(node, k) for k in keys)
        ]
        if implied:
            node["type"] = implied[0] if len(implied) == 1 else implied
    if isinstance(node.get("enum"), list) and "type" in node:
        node["enum"] = [v for v in node["enum"] if _json_types(v) & _types(node)]
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt in FORMAT_PATTERNS and "string" in _types(node):
        if "pattern" not in node and not ({"minLength", "maxLength"} & node.keys()):
            node["pattern"] = FORMAT_PATTERNS[fmt]
            del node["format"]
    if isinstance(node.get("pattern"), str):
        node["pattern"] = _rewritten_pattern(node["pattern"])
    if isinstance(node.get("patternProperties"), dict):
        patterned = node["patternProperties"]
        node["patternProperties"] = {_rewritten_pattern(k): v for k, v in patterned.items()}
    required, listed = node.get("required"), node.get("properties", {})
    if isinstance(required, list) and isinstance(listed, dict) and "patternProperties" not in node:
        missing = [name for name in required if isinstance(name, str) and name not in listed]
        extra = node.get("additionalProperties", {})
        if missing and extra is not False:
            value = extra if isinstance(extra, dict) else {}
            node["properties"] = {**listed, **{name: copy.deepcopy(value) for name in missing}}


def _rewritten_pattern(pattern: str) -> str:
    """``pattern`` as xgrammar must get it; as it is when refused (``_problem`` says why)."""
    try:
        return enforceable_pattern(pattern)
    except ValueError:
        return pattern


def _pattern_problem(pattern: str) -> str | None:
    try:
        enforceable_pattern(pattern)
    except ValueError as exc:
        return str(exc)
    return None


def _constrains(node: dict, keyword: str) -> bool:
    """Whether ``keyword`` constrains ``node``'s values (a format name outside the standard's
    list is an annotation and implies no type)."""
    if keyword != "format":
        return keyword in node
    return node.get("format") in ENFORCED_FORMATS | REFUSED_FORMATS | FORMAT_PATTERNS.keys()


def _json_types(value: Any) -> set[str]:
    """The JSON-schema types ``value`` (parsed JSON) is an instance of."""
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"}


def _problem(node: dict, root: dict) -> tuple[str, str] | None:
    """(keyword, why) for the first constraint of the (rewritten) ``node`` xgrammar would not
    hold, or None."""
    for keyword in node:
        if keyword in REFUSED_KEYWORDS:
            return keyword, "the output could not be guaranteed to satisfy it"
    validating = [k for k in node if k in _VALIDATION_KEYWORDS]
    for keyword in COMBINATORS:
        if keyword in node:
            others = [k for k in validating if k != keyword]
            if others:
                return others[0], f"the grammar library applies only {keyword!r} beside it"
    for keyword in ("enum", "const"):
        if keyword in node:
            others = [k for k in validating if k not in (keyword, "type")]
            if others:
                return others[0], f"the grammar library applies only {keyword!r} beside it"
    if node.get("enum") == []:
        return "enum", "no listed value has the schema's type, so nothing can satisfy it"
    if "const" in node and "type" in node and not _json_types(node["const"]) & _types(node):
        return "const", "the value does not have the schema's type, so nothing can satisfy it"
    all_of = node.get("allOf")
    if all_of is not None and not (isinstance(all_of, list) and len(all_of) == 1):
        return "allOf", "only a single-schema allOf is supported"
    if "oneOf" in node and not _disjoint(node["oneOf"], root):
        return "oneOf", (
            "its branches may overlap and the grammar library applies it as anyOf; use anyOf, "
            "branches of different types, or a const property that tells them apart"
        )
    if node.get("uniqueItems") not in (None, False):
        return "uniqueItems", "the output could not be guaranteed to satisfy it"
    if isinstance(node.get("items"), list):
        return "items", "a list of item schemas is the old tuple form; use prefixItems"
    return _string_problem(node) or _number_problem(node) or _object_problem(node)


def _string_problem(node: dict) -> tuple[str, str] | None:
    lengths = [k for k in ("minLength", "maxLength") if k in node]
    if "pattern" in node:
        if lengths:
            return lengths[0], "the grammar library ignores it beside 'pattern'"
        if "format" in node:
            return "format", "the grammar library ignores it beside 'pattern'"
        why = _pattern_problem(node["pattern"]) if isinstance(node["pattern"], str) else None
        if why:
            return "pattern", why
    fmt = node.get("format")
    if fmt is None or "string" not in _types(node):
        return None
    if lengths:
        return lengths[0], "the grammar library ignores it beside 'format'"
    if fmt in REFUSED_FORMATS:
        return "format", f"the grammar library does not enforce format {fmt!r} exactly"
    return None


def _number_problem(node: dict) -> tuple[str, str] | None:
    if "multipleOf" not in node:
        return None
    step, types = node["multipleOf"], _types(node)
    if "number" in types or "integer" not in types:
        return "multipleOf", "the grammar library enforces it on integers only"
    if not (isinstance(step, int) and not isinstance(step, bool) and 1 <= step <= MAX_MULTIPLE_OF):
        return "multipleOf", f"only whole multiples from 1 to {MAX_MULTIPLE_OF} are enforced"
    ranged = TYPE_KEYWORDS["number"][:4]
    if any(k in node for k in ranged):
        return "multipleOf", "the grammar library ignores it beside a minimum or maximum"
    return None


def _object_problem(node: dict) -> tuple[str, str] | None:
    listed = node.get("properties") or {}
    if isinstance(listed, dict) and len(listed) > MAX_OBJECT_PROPERTIES:
        return "properties", (
            f"{len(listed)} properties in one object; at most {MAX_OBJECT_PROPERTIES} (its "
            "grammar's compile time grows faster than the square of that number)"
        )
    patterned = node.get("patternProperties") or {}
    extra = node.get("additionalProperties")
    open_extra = extra is True or isinstance(extra, dict)  # absent is closed (strict mode)
    required = node.get("required")
    if isinstance(required, list) and isinstance(listed, dict):
        missing = [n for n in required if n not in listed]
        if missing:
            why = (
                "it names a key the schema never allows"
                if extra is False
                else ("it names a key that only patternProperties could allow")
            )
            return "required", f"{missing[0]!r}: {why}"
    if open_extra and (listed or patterned):
        return "additionalProperties", (
            "an unlisted key may repeat a listed one (an escaped name) beside 'properties' or "
            "'patternProperties'; set additionalProperties to false or list every key"
        )
    if "minProperties" in node and (open_extra or patterned):
        return "minProperties", "keys that may repeat are counted twice by the grammar library"
    if "propertyNames" in node and (listed or patterned or required):
        return "propertyNames", "the grammar library checks it on unlisted keys only"
    if isinstance(patterned, dict):
        for pattern in patterned:
            why = _pattern_problem(pattern)
            if why:
                return "patternProperties", why
            if isinstance(listed, dict) and any(re.search(pattern, name) for name in listed):
                return "patternProperties", (
                    f"{pattern!r} matches a listed property, whose value must then satisfy both "
                    "schemas; the grammar library applies only the listed one"
                )
    return None


def _resolve(node: Any, root: dict) -> Any:
    """``node`` with its local ``$ref`` chain followed (a few steps; unresolved: ``node``)."""
    for _ in range(8):
        ref = node.get("$ref") if isinstance(node, dict) else None
        if not isinstance(ref, str) or not ref.startswith("#"):
            return node
        target: Any = root
        for token in ref[1:].split("/")[1:]:
            token = token.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or token not in target:
                return node
            target = target[token]
        node = target
    return node


def _disjoint(branches: Any, root: dict) -> bool:
    """Whether no value can satisfy two of the ``oneOf`` branches: their types are disjoint, or
    their listed values are, or each requires one property whose const values differ."""
    if not isinstance(branches, list):
        return False
    resolved = [_resolve(b, root) for b in branches]
    if not all(isinstance(b, dict) for b in resolved):
        return False
    type_sets = [_types(b) | ({"number"} if "integer" in _types(b) else set()) for b in resolved]
    if all(type_sets) and _pairwise_disjoint([frozenset(t) for t in type_sets]):
        return True
    values = [_listed_values(b) for b in resolved]
    if all(v is not None for v in values) and _pairwise_disjoint(values):
        return True
    return _discriminated(resolved)


def _listed_values(node: dict) -> frozenset[str] | None:
    """The values ``node`` allows, as canonical JSON text, when it lists them."""
    listed = [node["const"]] if "const" in node else node.get("enum")
    if not isinstance(listed, list):
        return None
    return frozenset(json.dumps(v, sort_keys=True) for v in listed)


def _discriminated(branches: list[dict]) -> bool:
    """Each branch requires one common property whose listed values differ between them."""
    first = branches[0].get("properties")
    if not isinstance(first, dict):
        return False
    for name in first:
        tags = []
        for branch in branches:
            props, required = branch.get("properties"), branch.get("required")
            if not (isinstance(props, dict) and isinstance(required, list) and name in required):
                break
            tag = props.get(name)
            tags.append(_listed_values(tag) if isinstance(tag, dict) else None)
        if len(tags) == len(branches) and all(t is not None for t in tags):
            if _pairwise_disjoint(tags):
                return True
    return False


def _pairwise_disjoint(sets: list[frozenset[str]]) -> bool:
    seen: set[str] = set()
    for s in sets:
        if seen & s:
            return False
        seen |= s
    return True
