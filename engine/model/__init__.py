"""The model: loading (safetensors, GGUF), preparing it for the engine, the model body over Hugging
Face's modules, swapping in paged attention and fused or quantized projections.
"""
