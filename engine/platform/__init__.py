"""Device questions: the dtype a device runs best, host-to-device tensors; engine/platform/cpu
holds the CPU-only code.
"""
