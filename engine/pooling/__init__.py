"""Pooling models: one vector or one set of label scores per prompt, instead of generated tokens.

``sentence_transformers.py`` reads a sentence-transformers folder (pooling mode, Dense layers,
normalization, prompts); ``pooling_model.py`` builds what a loaded model pools and which head
turns the pooled row into an embedding or label scores (``heads.py``); ``pooler.py`` reduces a
step's hidden states to those rows, prompt chunk by prompt chunk.
"""
