"""Pooling models on the paged engine against their references in fp32: sentence-transformers'
``encode`` for embedders (its own reading of the same folder), Hugging Face's forward for
classifiers and cross-encoders, the LM's yes/no logits for a Qwen3-Reranker-style model.

Every case runs prompts of different lengths batched together through a small step budget
(a decoder's prompts are chunked), and ends with the block pool intact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sentence_transformers import SentenceTransformer
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from paged_serve.engine.llm import LLM
from paged_serve.engine.pooling_params import PoolingParams
from tests.pooling_models import (
    RERANKER_OVERRIDES,
    WORDS,
    bert_cross_encoder,
    bert_embedder,
    embeddinggemma_embedder,
    modernbert_cross_encoder,
    modernbert_embedder,
    nomic_bert_embedder,
    qwen3_classifier,
    qwen3_embedder,
    qwen3_reranker,
    xlm_roberta_cross_encoder,
    xlm_roberta_embedder,
)

TEXTS = [
    "w1 w2 w3",
    " ".join(f"w{i}" for i in range(4, 45)),  # 41 tokens: three chunks of a 16-token budget
    "yes no",
    "w9",
    " ".join(f"w{i}" for i in range(60, 80)),
]
PAIRS = [("w1 w2", "w3 w4 w5"), ("yes", "no w7 w8 w9 w10"), ("w5", "w5"), ("w6 w7", "w100")]
ENGINE = {"dtype": "float32", "kv_cache_memory": 8 << 20, "max_num_batched_tokens": 16}


def close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """The issue's bar: cosine >= 0.99999 per row and max abs error <= 1e-5."""
    assert ours.shape == ref.shape
    assert torch.nn.functional.cosine_similarity(ours, ref).min() >= 0.99999
    assert (ours - ref).abs().max() <= 1e-5


def embed(folder: Path, texts: list[str], **config: object) -> tuple[torch.Tensor, LLM]:
    llm = LLM(str(folder), **{**ENGINE, **config})
    out = torch.tensor(llm.embed(texts))
    llm.engine.block_manager.check_integrity()
    return out, llm


EMBEDDERS = {
    "qwen3-last": lambda f: qwen3_embedder(f, "lasttoken"),
    "qwen3-mean": lambda f: qwen3_embedder(f, "mean_tokens"),
    "qwen3-cls": lambda f: qwen3_embedder(f, "cls_token"),
    "qwen3-max-dense": lambda f: qwen3_embedder(f, "max_tokens", dense=24),
    "bert-mean": lambda f: bert_embedder(f, "mean_tokens"),
    "bert-cls-unnormalized": lambda f: bert_embedder(f, "cls_token", normalize=False),
    "xlm-roberta-cls": xlm_roberta_embedder,
    "modernbert-mean": modernbert_embedder,  # local attention: a bidirectional 8-token window
    "nomic-bert-mean": nomic_bert_embedder,  # rotary positions
    "embeddinggemma": embeddinggemma_embedder,  # bidirectional Gemma 3: a window, a Dense layer
}


@pytest.mark.parametrize("kind", list(EMBEDDERS))
def test_embeddings_equal_sentence_transformers(kind: str, tmp_path: Path) -> None:
    folder = EMBEDDERS[kind](tmp_path / kind)
    ours, _ = embed(folder, TEXTS)
    ref = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True)
    close(ours, ref.float())


def test_an_embedding_alone_equals_the_batched_one(tmp_path: Path) -> None:
    folder = bert_embedder(tmp_path / "bert")
    batched, llm = embed(folder, TEXTS)
    for text, row in zip(TEXTS, batched):
        assert torch.equal(torch.tensor(llm.embed(text)[0]), row)


def test_a_last_token_pooling_takes_prefix_cache_hits(tmp_path: Path) -> None:
    """A shared prefix is served from the cache (the query's blocks in a rerank), and the
    embedding is the one computed without the hit."""
    folder = qwen3_embedder(tmp_path / "qwen3", "lasttoken")
    prefix = " ".join(f"w{i}" for i in range(32))  # two full 16-token blocks
    llm = LLM(str(folder), **ENGINE)
    first = llm.embed(prefix + " w100")[0]
    engine = llm.engine
    hits = engine.scheduler.prefix_hit_tokens
    second = llm.embed(prefix + " w101")[0]
    assert engine.scheduler.prefix_hit_tokens - hits == 32
    cold = LLM(str(folder), **ENGINE, enable_prefix_caching=False).embed(prefix + " w101")[0]
    close(torch.tensor([second]), torch.tensor([cold]))
    assert first != second
    engine.block_manager.check_integrity()


@pytest.mark.parametrize("mode", ["mean_tokens", "cls_token"])
def test_a_pooling_over_every_token_never_skips_one(mode: str, tmp_path: Path) -> None:
    folder = qwen3_embedder(tmp_path / mode, mode)
    llm = LLM(str(folder), **ENGINE)
    prompt = " ".join(f"w{i}" for i in range(40))
    first = llm.embed(prompt)
    hits = llm.engine.scheduler.prefix_hit_tokens
    assert llm.embed(prompt) == first
    assert llm.engine.scheduler.prefix_hit_tokens == hits


def test_an_encoder_runs_each_prompt_whole_and_keeps_no_blocks(tmp_path: Path) -> None:
    """A prompt longer than the step budget still runs in one pass (the budget is raised to
    the context), nothing is cached and every block is back in the pool."""
    folder = bert_embedder(tmp_path / "bert")
    llm = LLM(str(folder), **ENGINE)
    assert llm.engine.scheduler.max_num_batched_tokens >= llm.engine.max_model_len
    assert not llm.engine.block_manager.enable_prefix_caching
    llm.embed(TEXTS)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_an_encoder_on_the_triton_kernels(tmp_path: Path) -> None:
    """The Triton prefill kernel with causal off (the interpreter on a CPU)."""
    folder = bert_embedder(tmp_path / "bert")
    texts = TEXTS[:3]
    ours, _ = embed(folder, texts, attention_backend="triton", device="cpu")
    ref = SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_tensor=True)
    close(ours, ref.float())


def test_dimensions_on_a_matryoshka_model_only(tmp_path: Path) -> None:
    folder = qwen3_embedder(tmp_path / "qwen3")
    plain = LLM(str(folder), **ENGINE)
    with pytest.raises(ValueError, match="not a Matryoshka model"):
        plain.embed("w1 w2", PoolingParams(dimensions=8))
    plain.engine.block_manager.check_integrity()
    full = torch.tensor(plain.embed("w1 w2", PoolingParams(normalize=False))[0])
    matryoshka = LLM(str(folder), **ENGINE, hf_overrides={"is_matryoshka": True})
    short = torch.tensor(matryoshka.embed("w1 w2", PoolingParams(dimensions=8))[0])
    close(short[None], torch.nn.functional.normalize(full[:8], dim=0)[None])
    with pytest.raises(ValueError, match="dimensions must be one of"):
        matryoshka.embed("w1", PoolingParams(dimensions=65))


def test_a_sequence_classifier_equals_hf(tmp_path: Path) -> None:
    folder = qwen3_classifier(tmp_path / "cls")
    llm = LLM(str(folder), **ENGINE)
    ours = torch.tensor(llm.classify(TEXTS, PoolingParams("classify", activation=False)))
    hf = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        ref = torch.cat([hf(**tok(t, return_tensors="pt")).logits for t in TEXTS])
    close(ours, ref)
    probs = torch.tensor(llm.classify(TEXTS))
    close(probs, ref.softmax(-1))
    assert llm.engine.pooling.labels == ("label_0", "label_1", "label_2")


def test_a_reranker_scores_from_its_yes_and_no_logits(tmp_path: Path) -> None:
    folder = qwen3_reranker(tmp_path / "reranker")
    llm = LLM(str(folder), **ENGINE, hf_overrides=RERANKER_OVERRIDES)
    ours = torch.tensor(llm.classify(TEXTS))
    lm = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    yes_no = [WORDS.index("no"), WORDS.index("yes")]
    with torch.no_grad():
        logits = [lm(**tok(t, return_tensors="pt")).logits[0, -1, yes_no] for t in TEXTS]
    ref = torch.stack([row.softmax(-1)[1:] for row in logits])
    close(ours, ref)


@pytest.mark.parametrize(
    "build", [bert_cross_encoder, xlm_roberta_cross_encoder, modernbert_cross_encoder]
)
def test_a_cross_encoder_scores_pairs_as_hf(build, tmp_path: Path) -> None:
    """Pairs as the tokenizer encodes them, BERT's segment ids included."""
    folder = build(tmp_path / "ce")
    llm = LLM(str(folder), **ENGINE)
    tok = AutoTokenizer.from_pretrained(folder)
    encoded = [tok(a, b) for a, b in PAIRS]
    token_types = llm.engine.pooling.token_types
    assert token_types == (build is bert_cross_encoder)
    scores = []
    for e in encoded:
        types = tuple(e["token_type_ids"]) if token_types else None
        params = PoolingParams("classify", activation=False, token_type_ids=types)
        scores += llm.classify(e["input_ids"], params)
    hf = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    ref = []
    for a, b in PAIRS:
        inputs = tok(a, b, return_tensors="pt")
        if not token_types:  # XLM-RoBERTa has one segment: its tokenizer's ids are not read
            inputs.pop("token_type_ids")
        with torch.no_grad():
            ref.append(hf(**inputs).logits)
    close(torch.tensor(scores), torch.cat(ref))
    llm.engine.block_manager.check_integrity()


def test_the_wrong_kind_of_request_is_refused(tmp_path: Path) -> None:
    from paged_serve.engine.sampling_params import SamplingParams

    folder = qwen3_embedder(tmp_path / "qwen3")
    llm = LLM(str(folder), **ENGINE)
    with pytest.raises(ValueError, match="--runner generate"):
        llm.generate("w1 w2", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="serves embed, not classify"):
        llm.classify("w1")
    llm.engine.block_manager.check_integrity()
