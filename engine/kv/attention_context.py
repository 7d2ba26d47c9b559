"""Per-step attention metadata, set around one forward pass by a context manager.

The model runner builds one ``AttentionContext`` per step and enters ``attention_context(ctx)``
around the Hugging Face forward; the paged attention function registered with transformers
reads it with ``current_attention_context()``. Entering twice (nesting) is refused so metadata
can never leak from one step into another.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from paged_serve.engine.kv.kv_cache import KVCache
    from paged_serve.engine.kv.lora_step import LoRAStep
    from paged_serve.engine.kv.state_cache import StateCache
    from paged_serve.engine.platform.kernel_backend import KernelBackend


@dataclass(frozen=True, slots=True)
class AttentionContext:
    """Metadata of one flat ragged batch.

    cu_seqlens_q: ``[S + 1]`` int32 offsets of each sequence's query tokens;
    seq_lens: ``[S]`` int32 context lengths including this step's tokens;
    block_tables: ``[S, max_blocks]`` int32; slot_mapping: ``[T]`` int64 cache slot per token.
    max_seqlen_q / max_seqlen_k: host-side maxima, so kernels never sync to read them.
    A hybrid model's linear-attention layers also read ``state_cache``, each sequence's
    ``state_slots [S]`` int32 and ``has_state [S]`` int32 (0: start from a zero state).
    ``lora``: each token's LoRA adapter slot (``engine/kv/lora_step.py``), None when no token of
    the step has an adapter. ``positions``: ``[T]`` int64, each token's position in its
    sequence (the step's position ids; Llama 4's NoPE layers scale their queries by it), None
    where a caller has none.
    """

    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    kv_cache: KVCache
    backend: KernelBackend
    state_cache: StateCache | None = None
    state_slots: torch.Tensor | None = None
    has_state: torch.Tensor | None = None
    lora: LoRAStep | None = None
    positions: torch.Tensor | None = None

    def state_layer(self, layer_idx: int, mixer: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s ``(windows, recurrent states)`` in the step's state cache;
        RuntimeError naming the ``mixer`` kind when the step has no state slots."""
        if self.state_cache is None or self.state_slots is None or self.has_state is None:
            raise RuntimeError(f"a {mixer} layer ran in a step without state slots")
        return self.state_cache.layer(layer_idx)

    def slot_args(self) -> dict[str, torch.Tensor]:
        """What the stateful kernels (``CausalConv``, ``GatedDeltaRule``, ``SsdScan``) take to
        find each sequence's tokens and slot."""
        return {
            "cu_seqlens": self.cu_seqlens_q,
            "state_slots": self.state_slots,
            "has_state": self.has_state,
        }


_state = threading.local()


@contextlib.contextmanager
def attention_context(ctx: AttentionContext) -> Iterator[AttentionContext]:
    """Make ``ctx`` the current step's metadata for this thread."""
    if getattr(_state, "ctx", None) is not None:
        raise RuntimeError("attention_context is already active: contexts do not nest")
    _state.ctx = ctx
    try:
        yield ctx
    finally:
        _state.ctx = None


def active_attention_context() -> AttentionContext | None:
    """The active step's metadata, or None outside ``attention_context`` (a module that also
    runs outside a step, such as a projection timed at load)."""
    return getattr(_state, "ctx", None)


def current_attention_context() -> AttentionContext:
    """The active step's metadata; raises if the forward runs outside ``attention_context``."""
    ctx = getattr(_state, "ctx", None)
    if ctx is None:
        raise RuntimeError("paged attention called outside attention_context(...)")
    return ctx
