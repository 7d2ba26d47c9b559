"""Scores of text pairs on the wire: vLLM's ``POST /score`` and the rerank endpoints
(``/rerank`` and ``/v1/rerank`` in Jina's shape, ``/v2/rerank`` in Cohere's v2 shape).

``/score`` pairs ``text_1`` with ``text_2``: one with one, one with each of N, or N with N
(element by element), and answers the ``protocol.pooling`` envelope with one ``score`` object
per pair. Rerank scores a ``query`` against each of ``documents`` and answers the results
sorted by ``relevance_score``, best first::

    {"id", "model", "usage": {"prompt_tokens", "total_tokens"},
     "results": [{"index", "document": {"text"}, "relevance_score"}, ...]}

``document`` is there with ``return_documents`` (default: true on ``/rerank`` and
``/v1/rerank`` as in vLLM and Jina, false on ``/v2/rerank``, whose Cohere v2 results carry
none).
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType

from paged_serve.server.protocol.errors import bad_request
from paged_serve.server.protocol.field_types import CacheSalt, NonNegativeInt
from paged_serve.server.protocol.pooling import (
    PoolingUsage,
    TruncatePromptTokens,
    check_input_count,
    check_truncation,
)


class ScoreRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``POST /score``. ``use_activation`` false: a classifier's raw logit."""

    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    use_activation: bool | None = None
    cache_salt: CacheSalt | None = None

    def pairs(self) -> list[tuple[str, str]]:
        """The pairs to score, in reply order; 400 for an empty side, a mismatch, too many."""
        left = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        right = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        for name, side in (("text_1", left), ("text_2", right)):
            if not side:
                raise bad_request(f"{name} must not be empty", name)
        if len(left) == 1:
            left = left * len(right)
        elif len(left) != len(right):
            raise bad_request(
                f"text_1 has {len(left)} texts and text_2 {len(right)}: give one text_1 to score "
                "against every text_2, or as many as text_2 to score pair by pair",
                "text_2",
            )
        check_input_count(len(right), "text_2")
        return list(zip(left, right))

    def check(self) -> None:
        check_truncation(self.truncate_prompt_tokens)


class ScoreData(msgspec.Struct, kw_only=True):
    index: int
    object: str = "score"
    score: float


class RerankDocument(msgspec.Struct, kw_only=True):
    """A document as Jina and vLLM take it, and as a result carries it back."""

    text: str


class RerankRequest(msgspec.Struct, kw_only=True):
    """Jina's and Cohere's rerank request (vLLM's fields). ``top_n`` 0 or absent: every
    document. Cohere's ``max_tokens_per_doc`` and ``priority`` are not read (unknown fields
    are ignored, as everywhere): a pair longer than the context is a 400 unless
    ``truncate_prompt_tokens`` cuts it."""

    query: str
    documents: list[str | RerankDocument]
    model: str | None = None
    user: str | None = None
    top_n: NonNegativeInt | None = None
    return_documents: bool | None = None  # None: the endpoint's default
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    use_activation: bool | None = None
    cache_salt: CacheSalt | None = None

    def texts(self) -> list[str]:
        """The documents' texts; 400 for none or too many."""
        if not self.documents:
            raise bad_request("documents must not be empty", "documents")
        check_input_count(len(self.documents), "documents")
        return [d if isinstance(d, str) else d.text for d in self.documents]

    def check(self) -> None:
        check_truncation(self.truncate_prompt_tokens)


class RerankResult(msgspec.Struct, kw_only=True):
    index: int  # the document's place in the request
    document: RerankDocument | UnsetType = UNSET  # with return_documents
    relevance_score: float


class RerankResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    usage: PoolingUsage
    results: list[RerankResult]
