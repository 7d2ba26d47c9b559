"""The pooling endpoints' inputs and list replies: ``POST /v1/embeddings`` (OpenAI), vLLM's
``POST /pooling`` and ``POST /classify``; scores and rerank are ``protocol.scoring``.

Every request takes ``input`` as completions takes ``prompt``: a string, a list of strings, a
list of token ids, or a list of token-id lists, at most ``MAX_POOLING_INPUTS`` of them
(OpenAI's limit), none empty. vLLM's extras: ``truncate_prompt_tokens`` (keep an input's last
N tokens; -1: the model's context), ``add_special_tokens`` (default true), ``cache_salt``.
Every reply is one envelope::

    {"id", "object": "list", "created", "model", "data": [...], "usage"}

with ``usage`` ``{"prompt_tokens", "total_tokens"}`` (the two are equal: nothing is generated).
"""

from __future__ import annotations

from typing import Annotated, Generic, Literal, TypeVar

import msgspec

from paged_serve.server.protocol.common import prompt_list
from paged_serve.server.protocol.errors import bad_request
from paged_serve.server.protocol.field_types import CacheSalt, PositiveInt, TokenId

# OpenAI's limit on /v1/embeddings inputs; the server applies it to every pooling endpoint
# (inputs, score pairs, rerank documents)
MAX_POOLING_INPUTS = 2048

# vLLM's truncate_prompt_tokens: N >= 1 keeps an input's last N tokens, -1 the model's context
TruncatePromptTokens = Annotated[int, msgspec.Meta(ge=-1)]
PoolingInput = str | list[str | TokenId | list[TokenId]]
DataT = TypeVar("DataT")


def check_input_count(count: int, param: str) -> None:
    """400 naming ``param`` beyond ``MAX_POOLING_INPUTS``."""
    if count > MAX_POOLING_INPUTS:
        raise bad_request(
            f"{param} has {count} items; this server takes at most {MAX_POOLING_INPUTS} per "
            "request",
            param,
        )


def check_truncation(value: int | None) -> None:
    """``truncate_prompt_tokens`` is -1 (the context) or at least 1 token."""
    if value == 0:
        raise bad_request(
            "truncate_prompt_tokens must be -1 (the model's context) or at least 1",
            "truncate_prompt_tokens",
        )


class PoolingRequestFields(msgspec.Struct, kw_only=True):
    """What every pooling request shares: the model, the ``user`` OpenAI accepts, vLLM's
    truncation, special-token switch and ``cache_salt`` (a prefix-cache partition within the
    API key's), and ``input``."""

    input: PoolingInput
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    add_special_tokens: bool = True
    cache_salt: CacheSalt | None = None

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list; 400 for an empty list or string, a mixed list, too many."""
        items = prompt_list(self.input, "input")
        check_input_count(len(items), "input")
        for i, item in enumerate(items):
            if item == "":
                param = "input" if isinstance(self.input, str) else f"input[{i}]"
                raise bad_request(f"{param} must not be an empty string", param)
        return items

    def check(self) -> None:
        check_truncation(self.truncate_prompt_tokens)


class EmbeddingRequest(PoolingRequestFields, kw_only=True):
    """``POST /v1/embeddings`` and vLLM's ``POST /pooling``. ``normalize`` (and vLLM's newer
    name for it, ``use_activation``): None follows the model."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    prompt_name: str | None = None  # sentence-transformers' prompt of that name before texts

    @property
    def normalized(self) -> bool | None:
        """Whether to L2-normalize (None: as the model does); 400 when the two names differ."""
        a, b = self.normalize, self.use_activation
        if a is not None and b is not None and a != b:
            raise bad_request(
                "normalize and use_activation name the same switch; they disagree", "normalize"
            )
        return a if a is not None else b


class ClassifyRequest(PoolingRequestFields, kw_only=True):
    """vLLM's ``POST /classify``: ``use_activation`` false returns the raw logits."""

    use_activation: bool | None = None


class PoolingUsage(msgspec.Struct, kw_only=True):
    """Tokens the inputs ran, once per input run (a text a score compares twice runs once)."""

    prompt_tokens: int
    total_tokens: int


class DataList(msgspec.Struct, Generic[DataT], kw_only=True):
    """The envelope of every pooling reply but rerank's."""

    id: str
    object: str = "list"
    created: int  # Unix seconds
    model: str
    data: list[DataT]
    usage: PoolingUsage


class EmbeddingData(msgspec.Struct, kw_only=True):
    index: int
    object: str = "embedding"
    embedding: list[float] | str  # floats, or base64 of little-endian float32


class PoolingData(msgspec.Struct, kw_only=True):
    index: int
    object: str = "pooling"
    data: list[float] | str  # the embedding or the label scores, as ``encoding_format`` says


class ClassificationData(msgspec.Struct, kw_only=True):
    index: int
    label: str  # the label with the highest score
    probs: list[float]  # per label; the logits with use_activation false
    num_classes: int
