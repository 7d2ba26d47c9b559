"""Reasoning out of a reply: ``--reasoning-parser qwen3`` moves ``<think>…</think>`` out of
``content`` into ``reasoning_content`` (vLLM's field), whole or while streaming.

A reply is in reasoning from its start when it opens with ``<think>``, or when the prompt
already ends with ``<think>`` (templates that open the block themselves, as Qwen3's thinking
models do); reasoning ends at ``</think>``. A reply that never opens a block is all content.
As with the tool parsers, a non-final split is a prefix of the final one in both fields (a
partial tag is held back), so streamed deltas add up to the whole reply. The content part is
what the tool parser, if any, then reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paged_serve.server.tools.parsers import hold_back


@dataclass(frozen=True, slots=True)
class Split:
    reasoning: str
    content: str


class Qwen3ReasoningParser:
    name = "qwen3"
    START, END = "<think>", "</think>"

    def __init__(self, prompt_text: str):
        self.opened_by_prompt = prompt_text.rstrip().endswith(self.START)
        self.closed_by_prompt = prompt_text.rstrip().endswith(self.END)

    def grammar_after(self, tokenizer: Any) -> int | None:
        """The token after which an output constraint applies: ``</think>`` where it is one
        token and the prompt has not already closed the block (Qwen3's ``enable_thinking:
        false``); None: the constraint applies from the first token."""
        if self.closed_by_prompt:
            return None
        ids = tokenizer(self.END, add_special_tokens=False).input_ids
        return ids[0] if len(ids) == 1 else None

    def split(self, text: str, *, final: bool) -> Split:
        body = text
        if not self.opened_by_prompt:
            stripped = text.lstrip()
            if not stripped.startswith(self.START):
                if not final and self.START.startswith(stripped):
                    return Split("", "")  # may still open a block
                return Split("", text)
            body = stripped[len(self.START) :]
        end = body.find(self.END)
        if end < 0:
            reasoning = body if final else hold_back(body, self.END)
            return Split(reasoning.strip() if final else reasoning.lstrip(), "")
        reasoning = body[:end].strip()
        content = body[end + len(self.END) :].lstrip()
        return Split(reasoning, content)


REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser}


class ReasoningStream:
    """One choice's stream: the reasoning and content deltas each new piece of text adds."""

    def __init__(self, parser: Qwen3ReasoningParser):
        self.parser = parser
        self.text = ""
        self.sent = Split("", "")

    def feed(self, new_text: str, *, final: bool) -> Split:
        self.text += new_text
        now = self.parser.split(self.text, final=final)
        delta = Split(
            _extension(self.sent.reasoning, now.reasoning),
            _extension(self.sent.content, now.content),
        )
        self.sent = Split(self.sent.reasoning + delta.reasoning, self.sent.content + delta.content)
        return delta


def _extension(sent: str, now: str) -> str:
    return now[len(sent) :] if now.startswith(sent) else ""
