"""Event-loop cost of parsing a streamed reply for tool calls
(``paged_serve.server.tools.streaming.ToolCallStream``).

    python -m perf.serving.bench_tool_stream [--words 5000] [--piece 5]

Each case is one long reply of a parser family (a call whose arguments hold ``--words`` words,
or the generic envelope's text answer), fed ``--piece`` characters at a time as tokens arrive.
Prints the seconds the whole stream's parsing takes: every piece re-reads the text so far, so
the cost grows with the square of the reply's length.
"""

from __future__ import annotations

import argparse
import json
import time

from paged_serve.server.tools.parsers import (
    GenericParser,
    HermesParser,
    NamedParser,
    RequiredParser,
    ToolParser,
)
from paged_serve.server.tools.streaming import ToolCallStream


def cases(words: int) -> dict[str, tuple[ToolParser, str]]:
    """The replies, by name: (parser, text)."""
    text = " ".join(["alpha", "beta", "gamma\u00e9", "delta"][i % 4] for i in range(words))
    args = json.dumps({"text": text})
    return {
        "hermes call": (
            HermesParser(),
            f'<tool_call>{{"name": "w", "arguments": {args}}}</tool_call>',
        ),
        "generic text answer": (GenericParser(), json.dumps({"response": text})),
        "generic call": (
            GenericParser(),
            f'{{"tool_calls": [{{"name": "w", "arguments": {args}}}]}}',
        ),
        "required list": (RequiredParser(), f'[{{"name": "w", "arguments": {args}}}]'),
        "named call": (NamedParser("w"), args),
    }


def stream_seconds(parser: ToolParser, text: str, piece: int) -> float:
    """Seconds to feed ``text`` to a ToolCallStream ``piece`` characters at a time."""
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)]
    stream = ToolCallStream(parser)
    start = time.perf_counter()
    for i, part in enumerate(pieces):
        stream.feed(part, final=i == len(pieces) - 1)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--words", type=int, default=5000)
    parser.add_argument("--piece", type=int, default=5, help="characters per token")
    args = parser.parse_args()
    for name, (family, text) in cases(args.words).items():
        pieces = -(-len(text) // args.piece)
        seconds = stream_seconds(family, text, args.piece)
        print(f"{name:20s} {pieces:6d} pieces  {seconds:7.3f} s")


if __name__ == "__main__":
    main()
