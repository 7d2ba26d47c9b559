"""Grammar-constrained decoding: what a request may generate, compiled once, matched per sequence.

The grammar engine is xgrammar (vLLM's and SGLang's default): it compiles JSON schemas, regular
expressions and EBNF grammars against the tokenizer's vocabulary and, per sequence, a matcher
fills a packed bitmask of the tokens allowed next (``int32 [ceil(V / 32)]`` per row, bit
``t % 32`` of word ``t // 32`` for token ``t``). The sampler applies that mask; the engine feeds
each sampled token back to the matcher.

    StructuredOutput  --compile (cached, off the engine thread)-->  CompiledGrammar
    CompiledGrammar   --one per sample-->  GrammarMatcher  --each step-->  bitmask row

A JSON schema that xgrammar would silently weaken (a keyword it ignores, such as ``uniqueItems``
or ``pattern`` beside ``maxLength``) is refused, and one it would misread (a ``required`` key
missing from ``properties``, ``format: date``) is rewritten into a form it holds, so an accepted
constraint always holds: ``engine/grammar/json_schema_rules.py`` says which, and
tests/engine/grammar/test_schema_soundness.py checks each verdict against a JSON-schema validator.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paged_serve.engine.errors import InvalidRequestError
from paged_serve.engine.grammar.json_schema_rules import enforceable_schema
from paged_serve.engine.grammar.json_schema_rules import (
    subschemas as subschemas,  # re-exported for server/tools
)

if TYPE_CHECKING:
    import xgrammar

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # schema, regex or grammar text; choices counted together
MAX_CHOICES = 1024
GRAMMAR_CACHE_SIZE = 256
# xgrammar's compile threads: one, so a compile never takes more than one core from the engine
# (it defaults to 8, which on a 2-core machine starved the engine thread).
COMPILE_THREADS = 1


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on a request's output.

    kind: ``json_schema`` (spec: the schema as JSON text), ``json_object`` (any JSON object; no
    spec), ``regex`` (spec: the pattern), ``choice`` (choices: the allowed outputs) or
    ``grammar`` (spec: an EBNF grammar in xgrammar's dialect, GBNF-like, rule ``root``).
    """

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")
        size = len(self.spec) + sum(len(c) for c in self.choices)
        if size > MAX_SPEC_CHARS:
            raise ValueError(
                f"the {self.kind} constraint has {size} characters; at most {MAX_SPEC_CHARS}"
            )
        if self.kind == "choice":
            if not 1 <= len(self.choices) <= MAX_CHOICES:
                raise ValueError(f"choice needs 1 to {MAX_CHOICES} strings")
            if any(not isinstance(c, str) or c == "" for c in self.choices):
                raise ValueError("choices must be non-empty strings")
        elif self.kind != "json_object" and not self.spec:
            raise ValueError(f"the {self.kind} constraint is empty")

    @classmethod
    def json_schema(cls, schema: Any) -> StructuredOutput:
        """A schema given as a dict (or JSON text), checked for keywords we cannot enforce."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        # The schema compiled is the rewritten one. Keys keep the caller's order: xgrammar
        # writes an object's properties in the order the schema lists them, which is the order
        # a pydantic model declares its fields.
        return cls("json_schema", json.dumps(enforceable_schema(schema), ensure_ascii=False))


# xgrammar 0.2.9 writes a length-bounded string's characters as this class, which lets raw
# control characters (a tab, U+0000-U+001F but CR and LF) into the string: invalid JSON. The
# class of its unbounded strings excludes them.
_LAX_STRING_CHARACTERS = r"[^\"\\\r\n]"
_STRING_CHARACTERS = r"[^\0-\x1f\"\\\r\n]"


def json_schema_grammar(spec: str) -> xgrammar.Grammar:
    """The grammar of the JSON schema text ``spec`` (one line, ``", "`` and ``": "`` between
    items), its strings kept to valid JSON."""
    import xgrammar

    grammar = xgrammar.Grammar.from_json_schema(spec, any_whitespace=False)
    text = str(grammar)
    patched = text.replace(_LAX_STRING_CHARACTERS, _STRING_CHARACTERS)
    return grammar if patched == text else xgrammar.Grammar.from_ebnf(patched)


def _ebnf_literal(text: str) -> str:
    """``text`` as an EBNF string literal (JSON string escapes are xgrammar's too)."""
    return json.dumps(text, ensure_ascii=True)


_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _clean_error(exc: Exception) -> str:
    """xgrammar's message without its timestamp and C++ source location."""
    lines = [_XGRAMMAR_PREFIX.sub("", line).strip() for line in str(exc).splitlines()]
    return " ".join(line for line in lines if line) or type(exc).__name__


class GrammarCompiler:
    """Compiles constraints for one tokenizer; an LRU cache of compiled grammars.

    Thread-safe: the server compiles in a worker thread before queueing a request, so the
    engine thread only meets cache hits. The tokenizer's vocabulary is indexed once, on the
    first compile (about 0.2 s for a 49k vocabulary).
    """

    def __init__(self, tokenizer: object, *, vocab_size: int, stop_token_ids: list[int]):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._info: xgrammar.TokenizerInfo | None = None
        self._cache: OrderedDict[StructuredOutput, xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def _xgrammar(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar  # imported on first use: it takes ~1.5 s

                self._info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer,
                    vocab_size=self._vocab_size,
                    stop_token_ids=self._stop_token_ids,
                )
                self._compiler = xgrammar.GrammarCompiler(
                    self._info, max_threads=COMPILE_THREADS, cache_enabled=False
                )
            return self._compiler

    def is_cached(self, constraint: StructuredOutput) -> bool:
        """Whether ``compile(constraint)`` would return at once."""
        with self._lock:
            return constraint in self._cache

    def tokenizer_info_json(self) -> str:
        """The tokenizer's vocabulary as xgrammar indexes it, serialized (about 1.6 MB for a
        49k vocabulary): what a compiler in another process starts from."""
        self._xgrammar()
        assert self._info is not None
        return self._info.serialize_json()

    def compile(self, constraint: StructuredOutput) -> xgrammar.CompiledGrammar:
        """The compiled grammar (cached). Raises InvalidRequestError when it does not compile
        or admits no output at all."""
        with self._lock:
            compiled = self._cache.get(constraint)
            if compiled is not None:
                self._cache.move_to_end(constraint)
                return compiled
        compiled = compile_constraint(self._xgrammar(), constraint)
        if not _admits_something(compiled, self._vocab_size):
            raise InvalidRequestError(f"the {constraint.kind} constraint admits no output")
        with self._lock:
            self._cache[constraint] = compiled
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, compiled: xgrammar.CompiledGrammar) -> xgrammar.GrammarMatcher:
        """A fresh matcher for one sequence."""
        import xgrammar

        return xgrammar.GrammarMatcher(compiled)


def compile_constraint(
    compiler: xgrammar.GrammarCompiler, constraint: StructuredOutput
) -> xgrammar.CompiledGrammar:
    """``constraint`` compiled by ``compiler``; InvalidRequestError when it does not compile."""
    kind = constraint.kind
    try:
        if kind == "json_schema":
            return compiler.compile_grammar(json_schema_grammar(constraint.spec))
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(constraint.spec)
        if kind == "choice":
            alternatives = " | ".join(_ebnf_literal(c) for c in constraint.choices)
            return compiler.compile_grammar(f"root ::= {alternatives}")
        return compiler.compile_grammar(constraint.spec)
    except (RuntimeError, ValueError) as exc:
        message = f"the {kind} constraint is invalid: {_clean_error(exc)}"
        raise InvalidRequestError(message) from None


def _admits_something(compiled: xgrammar.CompiledGrammar, vocab_size: int) -> bool:
    """Whether a fresh matcher allows any first token."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(compiled)
    mask = xgrammar.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(mask)
    return bool((mask != 0).any())
