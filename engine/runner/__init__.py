"""Running a step on the device: the model runner, the KV cache, decode graphs, the flattened step
inputs, the attention backend and the per-step attention context, prompt scoring.
"""
