"""Tool calls in a stream, as OpenAI streams them: a call's argument fragments go out as the
model writes them.

``ToolCallStream`` re-parses one choice's text at every token (``paged_serve.server.tools.parsers``)
and sends what it adds: content deltas, and for each call an opening delta (``index``, ``id``,
``type``, ``name``, ``arguments: ""``), then fragments (``index`` and ``arguments`` only). A
fragment is the part of the call's final ``arguments`` text that no later token can change
(``paged_serve.server.tools.json_prefix``), so the fragments sent are a prefix of the whole reply's
arguments at every point and join into them exactly once the call is whole. Chat sends the
deltas in chunks that hold each call at most once (``call_delta_batches``); Responses turns
them into ``function_call`` items and ``response.function_call_arguments.delta`` events
(``paged_serve.server.responses.stream``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from paged_serve.server.protocol.tools import FunctionDelta, ToolCallDelta
from paged_serve.server.tools.json_prefix import GrowingDump
from paged_serve.server.tools.parsers import PartialCall, ToolParser


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class StreamedCall:
    """A call as a stream has sent it: its delta ``index``, ``id`` and ``name``, the
    ``arguments`` text sent so far, and ``whole``: those are its final arguments."""

    index: int
    id: str
    name: str
    arguments: str = ""
    whole: bool = False


class ToolCallStream:
    """One choice's stream: the text so far, re-parsed on every token, sent as deltas of its
    content and its calls, as OpenAI streams them.

    A call opens with one delta carrying its ``index``, ``id``, ``type`` and ``name`` (and
    ``arguments: ""``) once the parser is sure it is a call (its name is whole and its arguments
    object has opened, ``Parsed.partial``); then deltas carrying only the ``index`` and an
    argument fragment: what the arguments' final JSON text has gained that no later token can
    change. The fragments therefore join into the whole reply's ``arguments`` byte for byte. A
    call that comes whole at once (its arguments as a JSON string, or all of it in one token)
    opens and sends its whole arguments as one fragment.

    A call that never becomes whole (``max_tokens`` cut it, or the model left it malformed)
    stays unfinished in the stream: the client has its id, name and a prefix of its arguments
    that is never JSON (the arguments' last character waits for the call to close), and a whole
    reply would not hold it. The text of a call cut off while it streamed is not
    sent again as content, as the whole reply (``auto``) would have it."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.content = ""
        self.calls: list[StreamedCall] = []  # every call that has opened, by index
        self.parsed_calls = 0  # the parser's whole calls sent so far
        self.open: StreamedCall | None = None  # the call whose fragments are streaming
        self.arguments = GrowingDump()  # the open call's arguments, read as they grow

    @property
    def has_calls(self) -> bool:
        """Some call has been sent whole (the reply ``finish_reason`` is then ``tool_calls``)."""
        return any(call.whole for call in self.calls)

    def feed(self, new_text: str, *, final: bool) -> tuple[str, list[ToolCallDelta]]:
        """The content delta and call deltas that ``new_text`` (and, if final, the end) adds."""
        self.text += new_text
        parsed = self.parser.read(self.text, final=final)
        deltas: list[ToolCallDelta] = []
        for call in parsed.calls[self.parsed_calls :]:
            deltas += self._close(call.name, call.arguments)
        self.parsed_calls = len(parsed.calls)
        if parsed.partial is not None:
            deltas += self._grow(parsed.partial)
        else:  # the text the open call came from turned out to be no call
            self.open = None
        if final:
            parsed = self.parser.ended(parsed, with_pending=self.open is None)
        content = _extension(self.content, parsed.content)
        self.content += content
        return content, deltas

    def _close(self, name: str, arguments: str) -> list[ToolCallDelta]:
        """The deltas of a whole call: the rest of the open call's arguments if it is that
        call, else the whole call at once (an open call it does not extend stays unfinished)."""
        call, self.open = self.open, None
        if call is None or call.name != name or not arguments.startswith(call.arguments):
            call = self._start(name)
            deltas = [_opening(call)]
        else:
            deltas = []
        fragment = arguments[len(call.arguments) :]
        call.arguments, call.whole = arguments, True
        return deltas + ([_fragment(call.index, fragment)] if fragment else [])

    def _grow(self, partial: PartialCall) -> list[ToolCallDelta]:
        """The deltas of a call still being written: its opening, then what the fixed part
        of its arguments has gained."""
        call, deltas = self.open, []
        if call is None:
            call = self.open = self._start(partial.name)
            self.arguments = GrowingDump()
            deltas.append(_opening(call))
        elif call.name != partial.name:
            return []  # not the open call: wait for that one to close
        fixed = self.arguments.read(partial.arguments)
        if fixed is not None and self.arguments.whole:
            # the arguments' last character waits for the call to close: a call cut off
            # before its end never streams arguments that parse (its whole reply holds no call)
            fixed = fixed[:-1]
        if fixed is None or not fixed.startswith(call.arguments):
            return deltas
        fragment = fixed[len(call.arguments) :]
        call.arguments = fixed
        return deltas + ([_fragment(call.index, fragment)] if fragment else [])

    def _start(self, name: str) -> StreamedCall:
        call = StreamedCall(index=len(self.calls), id=new_call_id(), name=name)
        self.calls.append(call)
        return call


def call_delta_batches(deltas: list[ToolCallDelta]) -> list[list[ToolCallDelta]]:
    """``deltas`` in order, cut into the chunks that carry them, each holding a call's index at
    most once: the openai SDK's stream accumulator files the entries of a call's first chunk
    by position, not by index, so a call's opening and its first fragment in one chunk would
    lose the fragment."""
    batches: list[list[ToolCallDelta]] = []
    for delta in deltas:
        if not batches or any(d.index == delta.index for d in batches[-1]):
            batches.append([])
        batches[-1].append(delta)
    return batches


def _opening(call: StreamedCall) -> ToolCallDelta:
    """A call's first delta: its index, id, type and name; its arguments follow."""
    return ToolCallDelta(
        index=call.index,
        id=call.id,
        type="function",
        function=FunctionDelta(name=call.name, arguments=""),
    )


def _fragment(index: int, arguments: str) -> ToolCallDelta:
    return ToolCallDelta(index=index, function=FunctionDelta(arguments=arguments))


def _extension(sent: str, now: str) -> str:
    return now[len(sent) :] if now.startswith(sent) else ""
