"""Running a step on the device: the model runner (it owns the KV and state caches of
engine/kv/, the kernel backend and the sampler), decode graphs, the flattened step inputs and
their packed message for tensor-parallel workers, prompt scoring, and building a runner.
"""
