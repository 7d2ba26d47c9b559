"""Device questions, answered once per device by a ``Platform`` (``platform.py``): the kernel set,
the dtype a device runs best, the KV budget, host settings, what the model gets, graph capture,
tensor-parallel ranks and their communicator; host-to-device tensors. engine/platform/cpu holds
the CPU-only code.
"""
