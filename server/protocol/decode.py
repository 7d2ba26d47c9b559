"""Decoding a request body into its Struct: the first layer of validation.

Unknown fields are ignored, as OpenAI does. Range constraints are the annotated types of
``paged_serve.server.protocol.field_types``, so a bad value is reported with the exact field
name (``errors.from_decode_error``); cross-field rules (``stop`` count, prompt shape) are checked
by the Structs' ``check()`` methods.
"""

from __future__ import annotations

import json
from typing import TypeVar

import msgspec

from paged_serve.server.protocol.errors import bad_request, from_decode_error

T = TypeVar("T")


def decode(body: bytes, type: type[T]) -> T:
    """Decode a JSON body into ``type``; raises APIError (400) naming the bad field."""
    try:
        return msgspec.json.decode(body, type=type)
    except msgspec.ValidationError as exc:
        raise from_decode_error(exc) from None
    except msgspec.DecodeError as exc:
        param = _non_finite_param(body)
        if param is not None:
            raise bad_request(
                f"invalid value for {param}: NaN and Infinity are not valid JSON numbers", param
            ) from None
        raise from_decode_error(exc) from None
    except RecursionError:  # msgspec gives up on ~1000 levels of nesting (a 2 KB body)
        raise bad_request("the request body is nested too deeply") from None


def _non_finite_param(body: bytes) -> str | None:
    """Where a body that is JSON but for a ``NaN``/``Infinity`` literal has one, as a path
    like ``messages[0].content``; None for any other malformed body."""
    if b"NaN" not in body and b"Infinity" not in body:
        return None
    marker = object()
    try:
        data = json.loads(body, parse_constant=lambda _: marker)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[str, object]] = [("", data)]
    while stack:  # depth-first, first field first, without recursion
        path, value = stack.pop()
        if value is marker:
            return path.lstrip(".") or None
        if isinstance(value, dict):
            stack += [(f"{path}.{k}", v) for k, v in reversed(value.items())]
        elif isinstance(value, list):
            stack += [(f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value)))]
    return None
