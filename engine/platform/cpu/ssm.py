"""The CPU's Mamba-2 scan: the reference's semantics, vectorised for serving.

``kernels/reference.py``'s ``ssd_scan_ref`` defines the selective state-space scan one sequence
and one token at a time. Serving on the CPU needs two shapes fast, so this module runs:

* decode rows (one token each) of every sequence of the step together: one gather of their
  states, one update ``S = exp(dt A) S + dt x B^T``, one read-out ``y = S C``, one scatter;
* prefill chunks one sequence at a time in the state-space dual form
  (``kernels/triton/ssd_scan.py`` derives it), the sequence cut into ``CHUNK``-token blocks
  and every block's work done at once as batched matrix products: the causal mixing matrix
  ``(C B^T) * exp(c_t - c_s) * dt_s`` of each block times its x, and the state each block
  would leave starting from zeros. Only the hand-over of the state from block to block is a
  loop (one multiply-add per block, not per token); each block's output then adds its carried
  state's part ``exp(c_t) (S C_t)`` in one more batched product. A long prefill goes in
  ``SEGMENT``-token pieces, the state carried between them, which bounds the memory of the
  ``[blocks, H, CHUNK, CHUNK]`` mixing matrices.

Heads that share a group of B and C are kept as a ``[G, H // G]`` pair of axes, so ``C B^T``
is formed once per group. tests/engine/platform/cpu/test_cpu_ssm.py checks both paths against
the reference in float64."""

from __future__ import annotations

import torch

CHUNK = 64  # tokens per block of the chunked form
SEGMENT = 16 * CHUNK  # tokens batched at once: bounds the [blocks, H, CHUNK, CHUNK] temporaries


def _rows(cu_seqlens: torch.Tensor) -> tuple[list[int], list[int]]:
    starts = cu_seqlens.tolist()
    return starts[:-1], starts[1:]


def _decode_rows(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    at: torch.Tensor,
    keep: torch.Tensor,
) -> torch.Tensor:
    """One token of each of ``n`` sequences: x ``[n, H, P]``, dt ``[n, H]``, A ``[H]``, B and
    C ``[n, H, N]`` (already per head), all in the state's dtype; their states are
    ``state[at]``, scaled by ``keep [n]`` (0 for a fresh sequence). Writes the new states back;
    returns ``y [n, H, P]`` without the skip."""
    S = state.index_select(0, at)  # [n, H, P, N]
    S *= ((dt * A).exp() * keep[:, None])[..., None, None]
    p, width = S.shape[-2:]
    # S += (dt x) B^T, one rank-1 update per (row, head), in place.
    S.view(-1, p, width).baddbmm_((dt[..., None] * x).reshape(-1, p, 1), B.reshape(-1, 1, width))
    state.index_copy_(0, at, S)
    return (S @ C[..., None]).squeeze(-1)


def _chunked_sequence(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    S: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence of ``n`` tokens in ``CHUNK``-token blocks: x ``[n, H, P]``, dt ``[n, H]``,
    A ``[H]``, B and C ``[n, G, N]``, start state ``S [H, P, N]``, all in one float dtype.
    Returns ``(y [n, H, P]`` without the skip, the final state ``[H, P, N])``."""
    n, heads, p = x.shape
    groups, width = B.shape[1:]
    per = heads // groups
    blocks = -(-n // CHUNK)
    pad = blocks * CHUNK - n
    # Padded tokens have dt = 0 (no decay), x = B = C = 0: they add nothing and are dropped.
    if pad:
        x, dt, B, C = (
            torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in (x, dt, B, C)
        )
    # Blocks first, then groups, heads within a group (R of them) and tokens: [c, G, R, L, ...].
    xs = x.reshape(blocks, CHUNK, groups, per, p).permute(0, 2, 3, 1, 4)  # [c, G, R, L, P]
    dts = dt.reshape(blocks, CHUNK, groups, per).permute(0, 2, 3, 1)  # [c, G, R, L]
    bs = B.reshape(blocks, CHUNK, groups, width).transpose(1, 2)  # [c, G, L, N], per group
    cs = C.reshape(blocks, CHUNK, groups, width).transpose(1, 2)
    cum = (dts * A.view(groups, per, 1)).cumsum(-1)  # [c, G, R, L], running log decay <= 0
    total = cum[..., -1:]  # [c, G, R, 1]
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=x.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    mix = (cs @ bs.transpose(-1, -2))[:, :, None] * decay * dts[..., None, :]  # [c,G,R,L,L]
    y = mix @ xs  # the block's own tokens
    # The state each block leaves from zeros, (x * exp(total - cum) dt)^T B: a group's heads
    # stacked as rows of one product with its B, [c, G, R * P, L] @ [c, G, L, N].
    weighted = (xs * ((total - cum).exp() * dts)[..., None]).transpose(-1, -2)
    local = (weighted.reshape(blocks, groups, per * p, CHUNK) @ bs).view(
        blocks, groups, per, p, width
    )
    carried = torch.empty_like(local)  # the state each block starts with
    s = S.reshape(groups, per, p, width)
    block_decay = total.exp()[..., None]  # [c, G, R, 1, 1]
    for k in range(blocks):
        carried[k] = s
        s = s * block_decay[k] + local[k]
    # exp(c_t) (C S^T), the group's heads side by side: [c, G, L, N] @ [c, G, N, R * P].
    inter = cs @ carried.view(blocks, groups, per * p, width).transpose(-1, -2)
    y += inter.view(blocks, groups, CHUNK, per, p).transpose(2, 3) * cum.exp()[..., None]
    y = y.permute(0, 3, 1, 2, 4).reshape(blocks * CHUNK, heads, p)[:n]
    return y, s.reshape(heads, p, width)


def ssd_scan_cpu(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    state: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    has_state: torch.Tensor,
    max_seqlen_q: int,
) -> torch.Tensor:
    """``paged_serve.kernels.reference.ssd_scan_ref``: decode rows batched, prefill chunks in
    the chunked dual form (see the module doc). x ``[T, H, P]``, dt ``[T, H]``, A ``[H]``, B
    and C ``[T, G, N]``, D ``[H]`` or None, ``state [slots, H, P, N]`` updated in place. Math
    in ``state``'s dtype; ``y [T, H, P]`` in x's dtype."""
    del max_seqlen_q  # the split below looks at each sequence's own length
    compute = state.dtype
    group = x.shape[1] // B.shape[1]
    xx, dd, aa = x.to(compute), dt.to(compute), A.to(compute)
    bb, cc = B.to(compute), C.to(compute)
    out = torch.empty(x.shape, dtype=compute, device=x.device)
    starts, ends = _rows(cu_seqlens)
    slots, has = state_slots.tolist(), has_state.tolist()
    single = [s for s, (a, b) in enumerate(zip(starts, ends)) if b - a == 1]
    if single:
        rows = torch.tensor([starts[s] for s in single], device=x.device)
        at = torch.tensor([slots[s] for s in single], device=x.device)
        keep = torch.tensor([float(has[s] != 0) for s in single], dtype=compute, device=x.device)
        out[rows] = _decode_rows(
            xx[rows],
            dd[rows],
            aa,
            bb[rows].repeat_interleave(group, dim=1),
            cc[rows].repeat_interleave(group, dim=1),
            state,
            at,
            keep,
        )
    for s, (a, b) in enumerate(zip(starts, ends)):
        if b - a == 1:
            continue
        S = state[slots[s]].to(compute) if has[s] else torch.zeros_like(state[slots[s]])
        for s0 in range(a, b, SEGMENT):
            rows = slice(s0, min(s0 + SEGMENT, b))
            out[rows], S = _chunked_sequence(xx[rows], dd[rows], aa, bb[rows], cc[rows], S)
        state[slots[s]] = S  # an empty fresh sequence still starts its slot from zeros
    if D is not None:
        out += D.to(compute)[:, None] * xx
    return out.to(x.dtype)
