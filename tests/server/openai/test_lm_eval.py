"""lm-evaluation-harness against a real ``paged-serve``, on two small tasks built from local
files: a multiple-choice (loglikelihood) task and a generation task.

lm-eval's ``local-completions`` model talks to the server as it would to vLLM: it finds
``/tokenizer_info`` and ``/tokenize`` and uses the server's tokenizer (no local copy, nothing
downloaded), scores each choice with ``echo`` + ``logprobs`` + ``max_tokens: 1`` on token-id
prompts (several per request), and generates with ``stop``. Each choice's score is checked
against Hugging Face's log-likelihood (one full fp32 forward), and each generation against the
server's own greedy completion of the same prompt (which tests/engine/model/test_default_model.py
holds to HF's). The data are JSON lines read by the ``datasets`` json builder with the hub turned
off. """

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from tests.server.conftest import http
from tests.server.processes import READY, START_DEADLINE_S, ServerProcess

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

SERVED = "smol"
MAX_GEN_TOKS = 8
DOCS = [
    {"country": "France", "choices": ["Paris", "Berlin", "Madrid", "Rome"], "answer": 0},
    {"country": "Germany", "choices": ["Vienna", "Berlin", "Bern", "Prague"], "answer": 1},
    {"country": "Italy", "choices": ["Milan", "Naples", "Rome", "Turin"], "answer": 2},
    {"country": "Spain", "choices": ["Lisbon", "Seville", "Barcelona", "Madrid"], "answer": 3},
    {"country": "Japan", "choices": ["Tokyo", "Osaka", "Kyoto", "Seoul"], "answer": 0},
]
TASKS = {
    "paged_serve_capitals_mc": """
output_type: multiple_choice
doc_to_text: "Question: What is the capital of {{country}}?\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - metric: acc
""",
    "paged_serve_capitals_gen": f"""
output_type: generate_until
doc_to_text: "Q: What is the capital of {{{{country}}}}?\\nA:"
doc_to_target: " {{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {MAX_GEN_TOKS}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
""",
}


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    server = ServerProcess(
        [
            "--port", "0",
            "--kv-cache-memory", str(32 << 20),
            "--max-model-len", "512",
            "--served-model-name", SERVED,
            "--dtype", "float32",  # the scores are held to Hugging Face fp32
        ]
    )  # fmt: skip
    try:
        yield server.wait_for(READY, START_DEADLINE_S).group("url")
    finally:
        server.stop()


@torch.inference_mode()
def hf_loglikelihoods(
    model: PreTrainedModel, pairs: list[tuple[list[int], list[int]]]
) -> list[float]:
    """Each (context, continuation)'s log-likelihood of the continuation, from one forward of
    all of them right-padded (causal attention: padding after a sequence does not touch it)."""
    seqs = [context + continuation for context, continuation in pairs]
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, seq in enumerate(seqs):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
    log_probs = torch.log_softmax(model(ids, attention_mask=mask).logits.float(), dim=-1)
    return [
        sum(log_probs[i, j - 1, seq[j]].item() for j in range(len(context), len(seq)))
        for i, (seq, (context, _)) in enumerate(zip(seqs, pairs))
    ]


def write_tasks(folder: Path) -> None:
    data = folder / "capitals.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    for name, body in TASKS.items():
        dataset = {"data_files": {"test": str(data)}, "cache_dir": str(folder / "cache")}
        head = f"task: {name}\ndataset_path: json\ndataset_kwargs: {json.dumps(dataset)}\n"
        (folder / f"{name}.yaml").write_text(head + "test_split: test\n" + body)


def test_lm_eval_local_completions(
    server_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    hf_default_model: PreTrainedModel,
):
    for offline in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(offline, "1")
    write_tasks(tmp_path)
    lm = LocalCompletionsAPI(
        base_url=f"{server_url}/v1/completions",
        model=SERVED,
        batch_size=4,  # four token-id prompts per request
        max_retries=1,
        max_length=512,
    )
    assert lm.tokenizer_backend == "remote"  # found /tokenizer_info and /tokenize
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        bootstrap_iters=0,
        log_samples=True,
    )

    # Loglikelihood: every choice's score is HF's log-likelihood of its tokens (encoded as
    # lm-eval encodes them), and the accuracy follows from those.
    mc = out["samples"]["paged_serve_capitals_mc"]
    assert len(mc) == len(DOCS)
    pairs = [lm._encode_pair(*args) for sample in mc for args in sample["arguments"]]
    expected = iter(hf_loglikelihoods(hf_default_model, pairs))
    hits = 0
    for sample in mc:
        scores = []
        for [(loglikelihood, _greedy)] in sample["resps"]:
            want = next(expected)
            assert loglikelihood == pytest.approx(want, abs=1e-3)
            scores.append(want)
        hits += scores.index(max(scores)) == sample["doc"]["answer"]
    assert out["results"]["paged_serve_capitals_mc"]["acc,none"] == hits / len(DOCS)

    # Generation: each answer is the server's greedy completion, cut at the stop string.
    gen = out["samples"]["paged_serve_capitals_gen"]
    assert len(gen) == len(DOCS)
    for sample in gen:
        [(context, _kwargs)] = sample["arguments"]
        body = {"prompt": context, "max_tokens": MAX_GEN_TOKS, "temperature": 0, "stop": ["\n"]}
        reply = http("POST", f"{server_url}/v1/completions", json=body)
        assert sample["resps"] == [[reply.json()["choices"][0]["text"]]]
    assert "exact_match,none" in out["results"]["paged_serve_capitals_gen"]
