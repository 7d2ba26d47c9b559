"""Checkpoints stored quantized (GPTQ, AWQ, compressed-tensors, fine-grained FP8): what their
``quantization_config`` says, each format's tensors read into one layout per kind of weight,
and the projections that multiply by them (docs/models.md, "Quantized checkpoints").
"""
