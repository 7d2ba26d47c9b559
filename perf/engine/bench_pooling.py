"""Embedding and rerank throughput on the CPU: paged-serve's engine against what a user would
run instead, in one process, one run.

    python -m perf.engine.bench_pooling [--batches 1 32 256] [--repeats 3] [--documents 64]

1. Embeddings (``perf/engine/pooling_models.py``: a MiniLM-shaped BERT with mean pooling, a
   small Qwen3 embedder with last-token pooling): ``B`` texts of 16-512 tokens (uniform,
   seeded) through ``LLM.embed`` (one flat batch a step, no padding) and through
   sentence-transformers' ``SentenceTransformer.encode`` (batch 32: it sorts by length and pads
   each batch, then pools). Inputs/s and tokens/s of both, the ratio, and the largest
   difference between the two embeddings.
2. Rerank, one query against ``--documents`` documents:
   - a Qwen3-Reranker-style LM scored from its yes/no logits, against Hugging Face's
     forward on the left-padded batch of query+document pairs (the model card's recipe), ours
     as the server runs a rerank (the first pair alone, then the others) with the prefix cache
     on (the query's blocks computed once) and off;
   - a BERT cross-encoder, against sentence-transformers' ``CrossEncoder.predict`` (batch 32).

The models have random weights (no download): the work per token is a real model's. Medians of
``--repeats`` timed runs after one untimed warm-up each; every run of ours starts with an empty
prefix cache. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from sentence_transformers import CrossEncoder, SentenceTransformer
from transformers import AutoModelForCausalLM, AutoTokenizer

from paged_serve.engine.llm import LLM
from paged_serve.engine.pooling_params import PoolingParams
from perf.engine.pooling_models import RERANKER_OVERRIDES, WORDS, build


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """``(median seconds, last result)`` of ``repeats`` calls after one warm-up call."""
    result = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def texts(count: int, low: int, high: int, seed: int) -> list[str]:
    """``count`` texts of ``low``-``high`` words (one token each), seeded."""
    rng = random.Random(seed)
    return [
        " ".join(f"w{rng.randrange(20000)}" for _ in range(rng.randint(low, high)))
        for _ in range(count)
    ]


def cold(llm: LLM) -> LLM:
    """``llm`` with its prefix cache emptied: a timed run never reuses the last run's
    blocks."""
    llm.engine.block_manager.evict_cached()
    return llm


def engine(folder: Path, args: argparse.Namespace, **config: object) -> LLM:
    return LLM(
        str(folder),
        dtype="float32",
        kv_cache_memory=args.kv_cache_memory << 20,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        **config,
    )


def embeddings(kind: str, root: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    folder = build(kind, root / kind)
    ours = engine(folder, args)
    st = SentenceTransformer(str(folder), device="cpu")
    specials = 2 if kind == "minilm" else 0  # [CLS] and [SEP]
    rows = []
    for batch in args.batches:
        inputs = texts(batch, 16 - specials, 512 - specials, seed=batch)
        tokens = sum(len(t.split()) + specials for t in inputs)
        ours_s, got = timed(lambda x=inputs: cold(ours).embed(x), args.repeats)
        st_s, want = timed(lambda x=inputs: st.encode(x, batch_size=32), args.repeats)
        diff = (torch.tensor(got) - torch.tensor(want)).abs().max().item()
        rows.append(
            {
                "model": kind,
                "batch": batch,
                "tokens": tokens,
                "paged_serve_inputs_per_s": round(batch / ours_s, 2),
                "paged_serve_tokens_per_s": round(tokens / ours_s),
                "sentence_transformers_inputs_per_s": round(batch / st_s, 2),
                "sentence_transformers_tokens_per_s": round(tokens / st_s),
                "speedup": round(st_s / ours_s, 2),
                "max_abs_diff": diff,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    ours.engine.block_manager.check_integrity()
    return rows


def hf_reranker_scores(model: Any, tok: Any, prompts: list[str]) -> list[float]:
    """p(yes) over {no, yes} at each left-padded prompt's last token, one batch."""
    batch = tok(prompts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        logits = model(**batch).logits[:, -1, [WORDS.index("no"), WORDS.index("yes")]]
    return logits.float().softmax(-1)[:, 1].tolist()


def rerank_lm(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    folder = build("reranker", root / "reranker")
    query = texts(1, args.query_words, args.query_words, seed=1)[0]
    documents = texts(args.documents, 32, 256, seed=2)
    prompts = [f"{query} {d}" for d in documents]
    tokens = sum(len(p.split()) for p in prompts)
    result: dict[str, Any] = {"model": "qwen3-reranker", "documents": args.documents}
    scores = {}
    for caching in (True, False):
        llm = engine(folder, args, hf_overrides=RERANKER_OVERRIDES, enable_prefix_caching=caching)
        sched = llm.engine.scheduler

        def run(llm: LLM = llm) -> list[list[float]]:
            # as the server reranks: the first pair alone puts the query's blocks in the cache,
            # then every other pair starts from them
            cold(llm)
            return llm.classify(prompts[:1]) + llm.classify(prompts[1:])

        hits = sched.prefix_hit_tokens
        seconds, got = timed(run, args.repeats)
        per_run = (sched.prefix_hit_tokens - hits) // (args.repeats + 1)
        key = "prefix_cache_on" if caching else "prefix_cache_off"
        result[f"paged_serve_{key}_s"] = round(seconds, 3)
        result[f"paged_serve_{key}_hit_tokens"] = per_run
        scores[caching] = torch.tensor(got)[:, 0]
    tok = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf_s, want = timed(lambda: hf_reranker_scores(model, tok, prompts), args.repeats)
    result.update(
        tokens=tokens,
        hf_padded_batch_s=round(hf_s, 3),
        speedup_prefix_cache_on=round(hf_s / result["paged_serve_prefix_cache_on_s"], 2),
        speedup_prefix_cache_off=round(hf_s / result["paged_serve_prefix_cache_off_s"], 2),
        max_abs_diff=(scores[True] - torch.tensor(want)).abs().max().item(),
        same_order=scores[True].argsort().tolist() == torch.tensor(want).argsort().tolist(),
    )
    print(json.dumps(result), flush=True)
    return result


def rerank_cross_encoder(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    folder = build("cross", root / "cross")
    query = texts(1, 24, 24, seed=1)[0]
    documents = texts(args.documents, 32, 256, seed=2)
    tok = AutoTokenizer.from_pretrained(folder)
    encoded = [tok(query, d) for d in documents]
    prompts = [e["input_ids"] for e in encoded]
    params = [PoolingParams("classify", token_type_ids=tuple(e["token_type_ids"])) for e in encoded]
    llm = engine(folder, args)
    ours_s, got = timed(lambda: llm.classify(prompts, params), args.repeats)
    cross = CrossEncoder(str(folder), device="cpu")
    pairs = [(query, d) for d in documents]
    st_s, want = timed(lambda: cross.predict(pairs, batch_size=32), args.repeats)
    got_t, want_t = torch.tensor(got)[:, 0], torch.tensor(want).float()
    result = {
        "model": "bert-cross-encoder",
        "documents": args.documents,
        "tokens": sum(len(p) for p in prompts),
        "paged_serve_s": round(ours_s, 3),
        "sentence_transformers_cross_encoder_s": round(st_s, 3),
        "speedup": round(st_s / ours_s, 2),
        "max_abs_diff": (got_t - want_t).abs().max().item(),
        "same_order": got_t.argsort().tolist() == want_t.argsort().tolist(),
    }
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--documents", type=int, default=64)
    parser.add_argument("--query-words", type=int, default=128)
    parser.add_argument("--models", nargs="+", default=["minilm", "qwen3"])
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-cache-memory", type=int, default=1024, help="MiB")
    parser.add_argument("--skip-rerank", action="store_true")
    args = parser.parse_args()
    report: dict[str, Any] = {"threads": torch.get_num_threads(), "embeddings": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for kind in args.models:
            report["embeddings"] += embeddings(kind, root, args)
        if not args.skip_rerank:
            report["rerank"] = [rerank_lm(root, args), rerank_cross_encoder(root, args)]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
