"""Tests of engine/model/: loading and checkpoint checks, the model body, every architecture family,
fused and quantized projections, latent and hybrid attention, sharded loading, the default model.
"""
