"""The pooling endpoints: embeddings (OpenAI's ``/v1/embeddings``, vLLM's ``/pooling``), label
scores (``/classify``), pair scores (``/score``) and rerank (Jina's and Cohere's shapes), each a
request's inputs tokenized, run as engine pooling requests started together, and answered in
one reply."""
