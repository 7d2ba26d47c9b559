"""POST /v1/embeddings and POST /pooling on a Qwen3 embedder (last-token pooling, a
sentence-transformers folder): equal to the engine's own ``pool`` and to sentence-transformers,
through raw HTTP, the openai SDK and LangChain."""

from __future__ import annotations

import asyncio
import base64
import struct

import numpy as np
import openai
import pytest
import torch
from sentence_transformers import SentenceTransformer

from paged_serve.engine.pooling_params import PoolingParams
from tests.server.conftest import assert_error, http
from tests.server.pooling.conftest import Served

# different lengths, one repeated word, and the "yes"/"no" words of the vocabulary
TEXTS = ["w1 w2 w3", "w4", "yes no w5 w6 w7 w8 w9 w10 w11", "w1 w2 w3 w12"]
ATOL = 1e-5


def embed(served: Served, body: dict, path: str = "/v1/embeddings") -> dict:
    reply = http("POST", f"{served.url}{path}", json=body)
    assert reply.status == 200, reply.body
    return reply.json()


def vectors(reply: dict, key: str = "embedding") -> np.ndarray:
    data = reply["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    return np.array([d[key] for d in data])


def st_embeddings(served: Served, texts: list[str]) -> np.ndarray:
    model = SentenceTransformer(str(served.folder), device="cpu")
    return model.encode(texts, convert_to_numpy=True, batch_size=len(texts))


def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


def test_embeddings_equal_the_engine_and_sentence_transformers(embedder: Served):
    reply = embed(embedder, {"model": embedder.name, "input": TEXTS, "user": "someone"})
    assert set(reply) == {"id", "object", "created", "model", "data", "usage"}
    assert reply["object"] == "list" and reply["model"] == embedder.name
    assert reply["id"].startswith("embd-") and isinstance(reply["created"], int)
    assert all(set(d) == {"index", "object", "embedding"} for d in reply["data"])
    assert all(d["object"] == "embedding" for d in reply["data"])
    got = vectors(reply)
    tokenizer = embedder.engine.tokenizer
    lengths = [len(tokenizer(t).input_ids) for t in TEXTS]
    assert reply["usage"] == {"prompt_tokens": sum(lengths), "total_tokens": sum(lengths)}

    async def direct() -> list[list[float]]:
        outs = [await embedder.engine.pool(t, PoolingParams()) for t in TEXTS]
        return [out.pooled for out in outs]

    engine_vectors = np.array(asyncio.run(direct()))
    assert np.abs(got - engine_vectors).max() <= ATOL  # batched as one call == one at a time
    reference = st_embeddings(embedder, TEXTS)
    assert got.shape == reference.shape == (len(TEXTS), 64)
    assert np.abs(got - reference).max() <= ATOL
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)  # Normalize module


def test_token_id_inputs_equal_their_texts(embedder: Served):
    tokenizer = embedder.engine.tokenizer
    ids = [tokenizer(t).input_ids for t in TEXTS]
    by_text = vectors(embed(embedder, {"input": TEXTS}))
    by_ids = vectors(embed(embedder, {"input": ids}))
    assert np.abs(by_ids - by_text).max() <= ATOL
    one = vectors(embed(embedder, {"input": ids[0]}))  # a flat id list is one input
    assert one.shape == (1, 64) and np.abs(one[0] - by_text[0]).max() <= ATOL
    single = vectors(embed(embedder, {"input": TEXTS[2]}))  # a string is one input
    assert np.abs(single[0] - by_text[2]).max() <= ATOL


def test_base64_decodes_to_the_same_floats(embedder: Served):
    floats = embed(embedder, {"input": TEXTS, "encoding_format": "float"})
    packed = embed(embedder, {"input": TEXTS, "encoding_format": "base64"})
    for f, b in zip(floats["data"], packed["data"]):
        raw = base64.b64decode(b["embedding"])
        decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
        # the float reply is the float32 value printed as a double: equal after rounding
        assert list(decoded) == [float(np.float32(x)) for x in f["embedding"]]
    assert packed["usage"] == floats["usage"]


def test_normalize_false_and_dimensions_on_a_matryoshka_model(matryoshka: Served):
    raw = vectors(embed(matryoshka, {"input": TEXTS, "normalize": False}))
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0, atol=1e-3)
    normalized = vectors(embed(matryoshka, {"input": TEXTS}))
    assert np.abs(raw / np.linalg.norm(raw, axis=1, keepdims=True) - normalized).max() <= ATOL
    short = vectors(embed(matryoshka, {"input": TEXTS, "dimensions": 16}))
    expected = raw[:, :16] / np.linalg.norm(raw[:, :16], axis=1, keepdims=True)
    assert short.shape == (len(TEXTS), 16)
    assert np.abs(short - expected).max() <= ATOL
    st = st_embeddings(matryoshka, TEXTS)[:, :16]  # sentence-transformers' full embedding, cut
    assert np.abs(short - st / np.linalg.norm(st, axis=1, keepdims=True)).max() <= ATOL
    as_vllm = vectors(embed(matryoshka, {"input": TEXTS, "use_activation": False}))
    assert np.abs(as_vllm - raw).max() == 0  # vLLM's newer name for normalize
    reply = http("POST", f"{matryoshka.url}/v1/embeddings", json={"input": "w1", "dimensions": 65})
    error = assert_error(reply, 400, param="dimensions")
    assert "1 to 64" in error["message"]


def test_dimensions_are_refused_on_a_model_that_is_not_matryoshka(embedder: Served):
    reply = http("POST", f"{embedder.url}/v1/embeddings", json={"input": "w1", "dimensions": 16})
    error = assert_error(reply, 400, param="dimensions")
    assert "not a Matryoshka model" in error["message"]


@pytest.mark.parametrize("encoding_format", ["float", None])
def test_openai_sdk(embedder: Served, encoding_format: str | None):
    """The SDK asks for base64 when no format is given and decodes it itself."""
    extra = {} if encoding_format is None else {"encoding_format": encoding_format}
    reply = client(embedder).embeddings.create(model=embedder.name, input=TEXTS, **extra)
    got = np.array([d.embedding for d in reply.data])
    assert [d.index for d in reply.data] == list(range(len(TEXTS)))
    assert reply.model == embedder.name and reply.object == "list"
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > 0
    assert np.abs(got - st_embeddings(embedder, TEXTS)).max() <= ATOL
    one = client(embedder).embeddings.create(model=embedder.name, input=TEXTS[0], **extra)
    assert np.abs(np.array(one.data[0].embedding) - got[0]).max() <= ATOL


def test_openai_sdk_dimensions_on_a_matryoshka_model(matryoshka: Served):
    reply = client(matryoshka).embeddings.create(model=matryoshka.name, input=TEXTS, dimensions=8)
    assert [len(d.embedding) for d in reply.data] == [8] * len(TEXTS)
    with pytest.raises(openai.BadRequestError):
        client(matryoshka).embeddings.create(model=matryoshka.name, input=TEXTS, dimensions=128)


def test_langchain_openai_embeddings(embedder: Served):
    """LangChain's ``OpenAIEmbeddings``. Its default splits texts with tiktoken, whose encoding
    files it downloads (not possible offline, and the wrong tokenizer for this model), so the
    two offline ways are tested: ``check_embedding_ctx_length=False`` sends the texts as they
    are; ``tiktoken_enabled=False`` with ``tiktoken_model_name`` the model's folder splits
    them with the model's own Hugging Face tokenizer and sends each chunk decoded back to text
    (LangChain sends no token ids on that path)."""
    from langchain_openai import OpenAIEmbeddings

    reference = st_embeddings(embedder, TEXTS)
    common = {
        "base_url": f"{embedder.url}/v1",
        "api_key": "unused",
        "model": embedder.name,
        "max_retries": 0,
    }
    plain = OpenAIEmbeddings(check_embedding_ctx_length=False, **common)
    assert np.abs(np.array(plain.embed_documents(TEXTS)) - reference).max() <= ATOL
    assert np.abs(np.array(plain.embed_query(TEXTS[2])) - reference[2]).max() <= ATOL
    by_hf_tokenizer = OpenAIEmbeddings(
        tiktoken_enabled=False, tiktoken_model_name=str(embedder.folder), **common
    )
    got = np.array(by_hf_tokenizer.embed_documents(TEXTS))
    assert np.abs(got - reference).max() <= ATOL


def test_pooling_endpoint_returns_the_pooled_output(embedder: Served, classifier: Served):
    reply = embed(embedder, {"input": TEXTS}, "/pooling")
    assert reply["id"].startswith("pool-") and reply["object"] == "list"
    assert all(set(d) == {"index", "object", "data"} for d in reply["data"])
    assert all(d["object"] == "pooling" for d in reply["data"])
    assert np.abs(vectors(reply, "data") - st_embeddings(embedder, TEXTS)).max() <= ATOL
    packed = embed(embedder, {"input": TEXTS[:1], "encoding_format": "base64"}, "/pooling")
    raw = base64.b64decode(packed["data"][0]["data"])
    assert np.abs(np.frombuffer(raw, "<f4") - vectors(reply, "data")[0]).max() == 0
    scores = embed(classifier, {"input": TEXTS}, "/pooling")  # a classifier's label scores
    probs = vectors(scores, "data")
    assert probs.shape == (len(TEXTS), 3) and np.allclose(probs.sum(axis=1), 1.0, atol=1e-6)
    raw_reply = embed(classifier, {"input": TEXTS, "use_activation": False}, "/pooling")
    logits = vectors(raw_reply, "data")
    assert np.abs(torch.softmax(torch.tensor(logits), -1).numpy() - probs).max() <= ATOL


def test_prompt_name_puts_the_folders_prompt_before_each_text(embedder: Served):
    """sentence-transformers' ``prompt_name``: Qwen3-Embedding's query instruction."""
    got = vectors(embed(embedder, {"input": TEXTS, "prompt_name": "query"}))
    model = SentenceTransformer(str(embedder.folder), device="cpu")
    reference = model.encode(TEXTS, prompt_name="query", convert_to_numpy=True)
    assert np.abs(got - reference).max() <= ATOL
    assert np.abs(got - vectors(embed(embedder, {"input": TEXTS}))).max() > 1e-3
    reply = http("POST", f"{embedder.url}/v1/embeddings", json={"input": "w1", "prompt_name": "x"})
    error = assert_error(reply, 400, param="prompt_name")
    assert "has no prompt 'x'" in error["message"] and "query" in error["message"]
