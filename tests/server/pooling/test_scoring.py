"""POST /score, the rerank endpoints (raw Jina-style HTTP and the cohere SDK) and POST /classify,
against Hugging Face's own forward of the same checkpoints: a Qwen3-Reranker-style LM (softmax
over the "no" and "yes" logits at the last token), a one-label Qwen3ForSequenceClassification
(the sigmoid of its logit) and a three-label one (softmax); an embedding model scores by cosine
similarity, as sentence-transformers does."""

from __future__ import annotations

from pathlib import Path

import cohere
import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from tests.server.conftest import assert_error, http, metric_values
from tests.server.pooling.conftest import PROMPTS, Served

QUERY = "w1 w2 w3"
DOCUMENTS = ["w4 w5", "w1 w2", "yes w7 w8 w9", "no", "w10 w3 w1", "w11 w12 w13 w14 w15"]
ATOL = 1e-5


def post(served: Served, path: str, body: dict) -> dict:
    reply = http("POST", f"{served.url}{path}", json=body)
    assert reply.status == 200, reply.body
    return reply.json()


def pair_ids(served: Served, first: str, second: str) -> torch.Tensor:
    return torch.tensor([served.engine.tokenizer(first, second).input_ids])


@torch.no_grad()
def hf_scores(served: Served, pairs: list[tuple[str, str]]) -> list[float]:
    """Each pair's score from Hugging Face's forward of the checkpoint, alone (no padding)."""
    folder = Path(served.folder)
    if served.name == "tiny-reranker":
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        tokenizer = served.engine.tokenizer
        no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
        scores = []
        for a, b in pairs:
            last = model(pair_ids(served, a, b)).logits[0, -1]
            scores.append(torch.softmax(last[[no, yes]], -1)[1].item())
        return scores
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    return [torch.sigmoid(model(pair_ids(served, a, b)).logits[0, 0]).item() for a, b in pairs]


@pytest.fixture(params=["reranker", "cross_encoder"])
def scorer(request: pytest.FixtureRequest) -> Served:
    return request.getfixturevalue(request.param)


def test_score_one_to_one_one_to_n_and_n_to_n(scorer: Served):
    reference = hf_scores(scorer, [(QUERY, d) for d in DOCUMENTS])
    one = post(scorer, "/score", {"model": scorer.name, "text_1": QUERY, "text_2": DOCUMENTS[0]})
    assert set(one) == {"id", "object", "created", "model", "data", "usage"}
    assert one["object"] == "list" and one["model"] == scorer.name
    assert one["data"] == [{"index": 0, "object": "score", "score": pytest.approx(reference[0])}]
    many = post(scorer, "/score", {"text_1": QUERY, "text_2": DOCUMENTS})
    assert [d["index"] for d in many["data"]] == list(range(len(DOCUMENTS)))
    assert np.abs(np.array([d["score"] for d in many["data"]]) - reference).max() <= ATOL
    listed = post(scorer, "/score", {"text_1": [QUERY], "text_2": DOCUMENTS})  # 1 in a list
    assert [d["score"] for d in listed["data"]] == pytest.approx(reference, abs=ATOL)
    tokenizer = scorer.engine.tokenizer
    pair_tokens = sum(len(tokenizer(QUERY, d).input_ids) for d in DOCUMENTS)
    assert many["usage"] == {"prompt_tokens": pair_tokens, "total_tokens": pair_tokens}
    firsts = ["w20 w21", "w22", "w23 w24 w25"]
    pairwise = post(scorer, "/score", {"text_1": firsts, "text_2": DOCUMENTS[:3]})
    expected = hf_scores(scorer, list(zip(firsts, DOCUMENTS[:3])))
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(expected, abs=ATOL)


def test_score_mismatched_lists_are_refused(reranker: Served):
    body = {"text_1": ["w1", "w2"], "text_2": ["w3", "w4", "w5"]}
    reply = http("POST", f"{reranker.url}/score", json=body)
    error = assert_error(reply, 400, param="text_2")
    assert "text_1 has 2 texts and text_2 3" in error["message"]
    reply = http("POST", f"{reranker.url}/score", json={"text_1": "w1", "text_2": []})
    assert_error(reply, 400, param="text_2")


def test_use_activation_false_gives_the_logit(cross_encoder: Served):
    body = {"text_1": QUERY, "text_2": DOCUMENTS[:2]}
    probs = [d["score"] for d in post(cross_encoder, "/score", body)["data"]]
    raw = post(cross_encoder, "/score", {**body, "use_activation": False})
    logits = torch.tensor([d["score"] for d in raw["data"]])
    assert torch.sigmoid(logits).tolist() == pytest.approx(probs, abs=ATOL)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank"])
def test_jina_rerank_orders_by_hugging_face_scores(scorer: Served, path: str):
    reference = hf_scores(scorer, [(QUERY, d) for d in DOCUMENTS])
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -reference[i])
    gaps = np.diff(sorted(reference))
    assert gaps.min() > 10 * ATOL  # the order is the scores', not float noise
    documents = [d if i % 2 else {"text": d} for i, d in enumerate(DOCUMENTS)]  # both shapes
    reply = post(scorer, path, {"model": scorer.name, "query": QUERY, "documents": documents})
    assert set(reply) == {"id", "model", "usage", "results"}
    assert reply["id"].startswith("rerank-") and reply["model"] == scorer.name
    results = reply["results"]
    assert [r["index"] for r in results] == order
    for r in results:
        assert set(r) == {"index", "document", "relevance_score"}
        assert r["document"] == {"text": DOCUMENTS[r["index"]]}  # Jina's default: returned
        assert r["relevance_score"] == pytest.approx(reference[r["index"]], abs=ATOL)
    tokens = sum(len(scorer.engine.tokenizer(QUERY, d).input_ids) for d in DOCUMENTS)
    assert reply["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    top = post(scorer, path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 2})
    assert [r["index"] for r in top["results"]] == order[:2]
    bare = post(scorer, path, {"query": QUERY, "documents": DOCUMENTS, "return_documents": False})
    assert [set(r) for r in bare["results"]] == [{"index", "relevance_score"}] * len(DOCUMENTS)
    everything = post(scorer, path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 99})
    assert [r["index"] for r in everything["results"]] == order


def test_cohere_v2_client_reranks(reranker: Served):
    reference = hf_scores(reranker, [(QUERY, d) for d in DOCUMENTS])
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -reference[i])
    co = cohere.ClientV2(base_url=reranker.url, api_key="unused")
    reply = co.rerank(model=reranker.name, query=QUERY, documents=DOCUMENTS, top_n=3)
    assert [r.index for r in reply.results] == order[:3]
    expected = [reference[i] for i in order[:3]]
    assert [r.relevance_score for r in reply.results] == pytest.approx(expected, abs=ATOL)
    raw = post(reranker, "/v2/rerank", {"query": QUERY, "documents": DOCUMENTS})
    assert "document" not in raw["results"][0]  # Cohere v2 results carry no document
    asked = post(reranker, "/v2/rerank", {"query": QUERY, "documents": DOCUMENTS[:1],
                                          "return_documents": True})  # fmt: skip
    assert asked["results"][0]["document"] == {"text": DOCUMENTS[0]}


def test_an_embedding_model_scores_by_cosine_similarity(embedder: Served):
    """The query after the folder's "query" prompt, as sentence-transformers'
    ``encode_query`` puts it, the documents as ``encode_document`` does (no prompt here)."""
    st = SentenceTransformer(str(embedder.folder), device="cpu")
    query = st.encode_query([QUERY], convert_to_tensor=True)
    documents = st.encode_document(DOCUMENTS, convert_to_tensor=True)
    reference = torch.nn.functional.cosine_similarity(query, documents).tolist()
    scores = post(embedder, "/score", {"text_1": QUERY, "text_2": DOCUMENTS})
    assert [d["score"] for d in scores["data"]] == pytest.approx(reference, abs=ATOL)
    tokenizer = embedder.engine.tokenizer
    texts = [PROMPTS["query"] + QUERY, *DOCUMENTS]
    tokens = sum(len(tokenizer(t).input_ids) for t in texts)  # the query embedded once
    assert scores["usage"]["prompt_tokens"] == tokens
    reranked = post(embedder, "/rerank", {"query": QUERY, "documents": DOCUMENTS})
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -reference[i])
    assert [r["index"] for r in reranked["results"]] == order


def test_score_and_rerank_refuse_a_classifier_with_several_labels(classifier: Served):
    reply = http("POST", f"{classifier.url}/score", json={"text_1": "w1", "text_2": "w2"})
    error = assert_error(reply, 400, param="text_2")
    assert "3 labels" in error["message"] and "/classify" in error["message"]
    reply = http("POST", f"{classifier.url}/rerank", json={"query": "w1", "documents": ["w2"]})
    assert_error(reply, 400, param="documents")


@torch.no_grad()
def test_classify_labels_and_probs_equal_hugging_face(classifier: Served):
    texts = ["w1 w2 w3", "w4", "yes no w5 w6 w7 w8", "w9 w10"]
    model = AutoModelForSequenceClassification.from_pretrained(
        classifier.folder, dtype=torch.float32
    ).eval()
    tokenizer = classifier.engine.tokenizer
    logits = [model(torch.tensor([tokenizer(t).input_ids])).logits[0] for t in texts]
    reply = post(classifier, "/classify", {"model": classifier.name, "input": texts})
    assert reply["id"].startswith("classify-") and reply["object"] == "list"
    for i, (data, row) in enumerate(zip(reply["data"], logits)):
        probs = torch.softmax(row, -1)
        assert set(data) == {"index", "label", "probs", "num_classes"}
        assert data["index"] == i and data["num_classes"] == 3
        assert data["probs"] == pytest.approx(probs.tolist(), abs=ATOL)
        assert data["label"] == model.config.id2label[int(probs.argmax())]
    raw = post(classifier, "/classify", {"input": texts, "use_activation": False})
    for data, row in zip(raw["data"], logits):
        assert data["probs"] == pytest.approx(row.tolist(), abs=ATOL)
    tokens = sum(len(tokenizer(t).input_ids) for t in texts)
    assert reply["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_a_decoder_reranker_computes_a_long_query_once(reranker: Served):
    """The first pair runs alone, so the others find the query's full KV block in the prefix
    cache (admitted in one step together, each would compute it)."""
    query = " ".join(f"w{i}" for i in range(60, 80))  # 20 tokens: one full block, then 4
    hit_tokens = "paged_serve_prefix_cache_hit_tokens_total"
    before = metric_values(reranker.url)[hit_tokens]
    reply = post(reranker, "/rerank", {"query": query, "documents": DOCUMENTS})
    hits = metric_values(reranker.url)[hit_tokens] - before
    assert hits == 16 * (len(DOCUMENTS) - 1)
    reference = hf_scores(reranker, [(query, d) for d in DOCUMENTS])
    got = sorted((r["index"], r["relevance_score"]) for r in reply["results"])
    assert [score for _, score in got] == pytest.approx(reference, abs=ATOL)
