"""The pooling endpoints on bidirectional encoders: a BERT embedder against
sentence-transformers' ``SentenceTransformer``, and BERT and XLM-RoBERTa cross-encoders against
Hugging Face's forward of the tokenizer's pair encoding (the sigmoid of the one label's logit,
as sentence-transformers' ``CrossEncoder`` scores; BERT's segment ids reach the model)."""

from __future__ import annotations

import cohere
import numpy as np
import pytest
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer
from transformers import AutoModelForSequenceClassification

from tests.server.conftest import http
from tests.server.pooling.conftest import Served

QUERY = "w1 w2 w3"
DOCUMENTS = ["w4 w5", "w1 w2", "yes w7 w8 w9", "no", "w10 w3 w1", "w11 w12 w13 w14 w15"]
TEXTS = ["w1 w2 w3", "w4", "yes no w5 w6 w7 w8 w9 w10 w11", "w1 w2 w3 w12"]
ATOL = 1e-5


def post(served: Served, path: str, body: dict) -> dict:
    reply = http("POST", f"{served.url}{path}", json=body)
    assert reply.status == 200, reply.body
    return reply.json()


def test_a_bert_embedder_equals_sentence_transformers(bert: Served):
    reply = post(bert, "/v1/embeddings", {"input": TEXTS})
    got = np.array([d["embedding"] for d in reply["data"]])
    model = SentenceTransformer(str(bert.folder), device="cpu")
    reference = model.encode(TEXTS, convert_to_numpy=True, batch_size=len(TEXTS))
    assert np.abs(got - reference).max() <= ATOL
    tokens = sum(len(bert.engine.tokenizer(t).input_ids) for t in TEXTS)  # [CLS] ... [SEP]
    assert reply["usage"]["prompt_tokens"] == tokens
    scores = post(bert, "/score", {"text_1": TEXTS[0], "text_2": TEXTS[1:]})
    cosine = torch.nn.functional.cosine_similarity(
        torch.tensor(reference[:1]), torch.tensor(reference[1:])
    )
    assert [d["score"] for d in scores["data"]] == pytest.approx(cosine.tolist(), abs=ATOL)


@pytest.fixture(params=["bert_reranker", "roberta_reranker"])
def encoder_reranker(request: pytest.FixtureRequest) -> Served:
    return request.getfixturevalue(request.param)


@torch.no_grad()
def hf_pair_scores(served: Served, pairs: list[tuple[str, str]]) -> np.ndarray:
    """Each pair alone through HF's classifier, with the pair's segment ids where the model
    has segment types (XLM-RoBERTa's one type takes none: this word tokenizer would give the
    second text type 1, which its embeddings do not have)."""
    model = AutoModelForSequenceClassification.from_pretrained(served.folder).eval()
    reads_types = model.config.type_vocab_size > 1
    scores = []
    for first, second in pairs:
        pair = served.engine.tokenizer(first, second, return_tensors="pt")
        types = {"token_type_ids": pair.token_type_ids} if reads_types else {}
        scores.append(torch.sigmoid(model(pair.input_ids, **types).logits[0, 0]).item())
    return np.array(scores)


def test_a_bert_cross_encoder_equals_sentence_transformers(bert_reranker: Served):
    reference = CrossEncoder(str(bert_reranker.folder), device="cpu").predict(
        [(QUERY, d) for d in DOCUMENTS], batch_size=len(DOCUMENTS)
    )
    scores = post(bert_reranker, "/score", {"text_1": QUERY, "text_2": DOCUMENTS})
    assert [d["score"] for d in scores["data"]] == pytest.approx(reference.tolist(), abs=ATOL)


def test_cross_encoders_score_and_rerank_as_hugging_face(encoder_reranker: Served):
    reference = hf_pair_scores(encoder_reranker, [(QUERY, d) for d in DOCUMENTS])
    scores = post(encoder_reranker, "/score", {"text_1": QUERY, "text_2": DOCUMENTS})
    got = [d["score"] for d in scores["data"]]
    assert got == pytest.approx(reference.tolist(), abs=ATOL)
    assert np.diff(np.sort(reference)).min() > 10 * ATOL  # the order below is the scores'
    order = np.argsort(-reference, kind="stable").tolist()
    reranked = post(encoder_reranker, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
    assert [r["index"] for r in reranked["results"]] == order
    co = cohere.ClientV2(base_url=encoder_reranker.url, api_key="unused")
    top = co.rerank(model=encoder_reranker.name, query=QUERY, documents=DOCUMENTS, top_n=2)
    assert [r.index for r in top.results] == order[:2]


@torch.no_grad()
def test_a_bert_cross_encoder_reads_the_pairs_segment_ids(bert_reranker: Served):
    """The pair's second text has segment id 1: scoring it as one text of segment 0 gives
    another score, so equality with the pair's HF score shows the ids reached the model."""
    tokenizer = bert_reranker.engine.tokenizer
    model = AutoModelForSequenceClassification.from_pretrained(bert_reranker.folder).eval()
    pair = tokenizer(QUERY, DOCUMENTS[2], return_tensors="pt")
    assert pair.token_type_ids.sum() > 0
    with_types = torch.sigmoid(model(pair.input_ids, token_type_ids=pair.token_type_ids).logits)
    no_types = torch.sigmoid(model(pair.input_ids).logits)
    with_types, no_types = with_types.item(), no_types.item()
    assert abs(with_types - no_types) > 100 * ATOL
    scored = post(bert_reranker, "/score", {"text_1": QUERY, "text_2": DOCUMENTS[2]})
    assert scored["data"][0]["score"] == pytest.approx(with_types, abs=ATOL)
    as_ids = post(bert_reranker, "/classify", {"input": [pair.input_ids[0].tolist()]})
    assert as_ids["data"][0]["probs"][0] == pytest.approx(no_types, abs=ATOL)  # ids: segment 0


def test_truncation_keeps_an_encoders_special_tokens(bert: Served):
    """``truncate_prompt_tokens`` keeps the last words between ``[CLS]`` and ``[SEP]``, as a
    tokenizer truncating from the left does (CLS pooling reads the first token)."""
    words = [f"w{i}" for i in range(40)]

    def embed(body: dict) -> tuple[list[float], int]:
        out = post(bert, "/v1/embeddings", body)
        return out["data"][0]["embedding"], out["usage"]["prompt_tokens"]

    cut, tokens = embed({"input": " ".join(words), "truncate_prompt_tokens": 8})
    assert tokens == 8
    last_six, _ = embed({"input": " ".join(words[-6:])})
    assert cut == pytest.approx(last_six, abs=ATOL)
    reply = http(
        "POST", f"{bert.url}/v1/embeddings", json={"input": "w1 w2 w3", "truncate_prompt_tokens": 2}
    )
    assert reply.status == 400 and "2 special tokens" in reply.json()["error"]["message"]
