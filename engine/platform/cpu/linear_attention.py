"""The CPU's gated DeltaNet kernels: the references' semantics, vectorised for serving.

``kernels/reference.py`` defines the causal convolution and the gated delta rule one sequence
and one token at a time. Serving on the CPU needs two shapes fast, so this module runs:

* decode rows (one token each) of every sequence of the step together: one gather of their
  windows and states, one update, one scatter;
* prefill chunks one sequence at a time, the delta rule in ``CHUNK``-token blocks of the WY
  form (``kernels/triton/delta_rule.py`` explains it; here ``(I + L)^-1`` is a unit-triangular
  solve), the convolution as ``K`` shifted multiply-adds.

tests/engine/platform/cpu/test_cpu_linear_attention.py checks both against the references in
float64. """

from __future__ import annotations

import torch

from paged_serve.kernels.reference import causal_conv_rows, l2_normalize

CHUNK = 64  # tokens per block of the chunked delta rule


def _rows(cu_seqlens: torch.Tensor) -> tuple[list[int], list[int]]:
    starts = cu_seqlens.tolist()
    return starts[:-1], starts[1:]


def causal_conv1d_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    has_state: torch.Tensor,
    silu: bool = True,
) -> torch.Tensor:
    """``paged_serve.kernels.reference.causal_conv1d_ref``, decode rows batched (see the module
    doc)."""
    starts, ends = _rows(cu_seqlens)
    slots, has = state_slots.tolist(), has_state.tolist()
    width = weight.shape[1]
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = weight.to(compute).t()  # [K, C]
    b_c = None if bias is None else bias.to(compute)
    out = torch.empty_like(x)
    single = [s for s, (a, b) in enumerate(zip(starts, ends)) if b - a == 1]
    if single:
        rows = torch.tensor([starts[s] for s in single])
        at = torch.tensor([slots[s] for s in single])
        window = conv_state.index_select(0, at).to(compute)  # [n, K - 1, C]
        window *= torch.tensor([float(has[s] != 0) for s in single], dtype=compute)[:, None, None]
        ext = torch.cat([window, x.index_select(0, rows).to(compute)[:, None]], dim=1)
        y = (ext * w).sum(1)
        if b_c is not None:
            y += b_c
        out[rows] = (torch.nn.functional.silu(y) if silu else y).to(x.dtype)
        conv_state[at] = ext[:, 1:].to(conv_state.dtype)
    for s, (a, b) in enumerate(zip(starts, ends)):
        if b - a == 1 or b == a:
            continue
        window = (
            conv_state[slots[s]].to(compute)
            if has[s]
            else x.new_zeros(width - 1, x.shape[1], dtype=compute)
        )
        y, window = causal_conv_rows(window, x[a:b].to(compute), w.t(), b_c, silu)
        out[a:b] = y.to(x.dtype)
        conv_state[slots[s]] = window.to(conv_state.dtype)
    return out


def _chunked_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    S: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in WY blocks: q, k ``[H, n, Dk]`` (normalised, q scaled), v ``[H, n, Dv]``,
    g, beta ``[H, n]``, state ``S [H, Dk, Dv]``; ``(o [H, n, Dv], S)``."""
    n = q.shape[1]
    out = torch.empty_like(v)
    for c0 in range(0, n, CHUNK):
        c1 = min(c0 + CHUNK, n)
        Q, K, V, b = q[:, c0:c1], k[:, c0:c1], v[:, c0:c1], beta[:, c0:c1]
        G = g[:, c0:c1].cumsum(-1)  # [H, c]
        size = c1 - c0
        causal = torch.ones(size, size, dtype=torch.bool).tril()
        decay = (G[:, :, None] - G[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        k_beta = K * b[..., None]
        system = (k_beta @ K.transpose(1, 2) * decay).tril(-1)
        system += torch.eye(size, dtype=Q.dtype)
        rhs = torch.cat([V * b[..., None], k_beta * G.exp()[..., None]], dim=-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        u, w = solved[..., : V.shape[-1]], solved[..., V.shape[-1] :]
        u = u - w @ S
        out[:, c0:c1] = (Q * G.exp()[..., None]) @ S + (Q @ K.transpose(1, 2) * decay) @ u
        g_last = G[:, -1:]
        S = S * g_last.exp()[..., None] + (K * (g_last - G).exp()[..., None]).transpose(1, 2) @ u
    return out, S


def gated_delta_rule_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    has_state: torch.Tensor,
    max_seqlen_q: int,
    scale: float | None = None,
) -> torch.Tensor:
    """``paged_serve.kernels.reference.gated_delta_rule_ref``: decode rows batched, prefill
    chunks in WY blocks (see the module doc). Math in ``state``'s dtype."""
    del max_seqlen_q  # the split below looks at each sequence's own length
    compute = state.dtype
    group = v.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qn = l2_normalize(q.to(compute)).repeat_interleave(group, dim=1) * scale  # [T, Hv, Dk]
    kn = l2_normalize(k.to(compute)).repeat_interleave(group, dim=1)
    vv, gg, bb = v.to(compute), g.to(compute), beta.to(compute)
    out = torch.empty(v.shape, dtype=compute)
    starts, ends = _rows(cu_seqlens)
    slots, has = state_slots.tolist(), has_state.tolist()
    single = [s for s, (a, b) in enumerate(zip(starts, ends)) if b - a == 1]
    if single:
        rows = torch.tensor([starts[s] for s in single])
        at = torch.tensor([slots[s] for s in single])
        S = state.index_select(0, at)  # [n, H, Dk, Dv]
        fresh = torch.tensor([float(has[s] != 0) for s in single], dtype=compute)
        S *= (gg[rows].exp() * fresh[:, None])[..., None, None]  # decay; zeros if fresh
        kt, qt = kn[rows].unsqueeze(-2), qn[rows].unsqueeze(-2)  # [n, H, 1, Dk]
        delta = (vv[rows] - (kt @ S).squeeze(-2)) * bb[rows][..., None]  # [n, H, Dv]
        dk, dv = S.shape[-2:]
        S.view(-1, dk, dv).baddbmm_(kt.reshape(-1, dk, 1), delta.reshape(-1, 1, dv))
        out[rows] = (qt @ S).squeeze(-2)
        state.index_copy_(0, at, S)
    for s, (a, b) in enumerate(zip(starts, ends)):
        if b - a <= 1:
            continue
        S = state[slots[s]] if has[s] else torch.zeros_like(state[slots[s]])
        o, S = _chunked_sequence(
            qn[a:b].transpose(0, 1),
            kn[a:b].transpose(0, 1),
            vv[a:b].transpose(0, 1),
            gg[a:b].t(),
            bb[a:b].t(),
            S,
        )
        out[a:b] = o.transpose(0, 1)
        state[slots[s]] = S
    return out.to(v.dtype)
