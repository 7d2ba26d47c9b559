"""The paged memory the attention layers read and write: the KV cache (one allocation, per-head
K/V or latent entries, sized from the memory budget), a hybrid model's linear-attention state
cache, and the per-step ``AttentionContext`` (block tables, slot mapping, those caches) that the
runner sets around a forward and the model's swapped attention reads. It imports neither the
runner nor the model: both import it.
"""
