"""The model: loading (safetensors, GGUF), preparing it for the engine, the model body over Hugging
Face's modules, swapping in paged attention and fused or quantized projections, and cutting it
across tensor-parallel ranks (sharding by module swap, a rank's shard read alone from the
checkpoint).
"""
