"""Shard a Hugging Face decoder in place for tensor parallelism, by swapping its Linear modules.

Megatron's layout, applied to every decoder layer of the supported families::

    attention: q_proj, k_proj, v_proj  column-parallel (rank r: heads r*H/N .. (r+1)*H/N - 1)
               o_proj                  row-parallel (the input columns of those heads), all_reduce
    latent:    q_proj | q_b_proj,      column-parallel by heads (multi-head latent attention;
               kv_b_proj               q_a_proj and kv_a_proj_with_mqa, the latent, replicated)
    MLP:       gate_proj, up_proj      column-parallel (rows r*I/N .. (r+1)*I/N - 1)
               down_proj               row-parallel, all_reduce
    DeltaNet:  input projections,      column-parallel by key heads and the value heads they
               conv1d, A_log, dt_bias  serve (gated DeltaNet: each rank's own q, k, v channels)
               out_proj                row-parallel, all_reduce
    encoder:   attention.self.query,   column-parallel by heads (BERT and RoBERTa-style
               key, value;             encoder layers: a pooling model's bidirectional
               intermediate.dense      encoder), and the MLP's rows
               attention.output.dense, row-parallel, all_reduce
               output.dense

A column-parallel projection is a plain ``nn.Linear`` holding its rank's output rows, so the
attention module's ``view(*shape, -1, head_dim)`` yields the local heads by itself and the paged
attention function (and the kernels under it) see ``Hq/N`` query and ``Hkv/N`` KV heads with no
change. A row-parallel projection (``RowParallelLinear``) multiplies its slice of the input
features and sums the partial outputs over the ranks, then adds the bias once. Two all-reduces
per layer; the residual stream, the norms, rotary embeddings, the embeddings and the LM head stay
replicated (why: docs/architecture.md, "Tensor parallelism").

Sharding runs before any other rewrite of the projections (a fused q/k/v weight is fused from
the already-sharded ones), so rank-local modules are ordinary ``nn.Linear``s to such code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from paged_serve.engine.model.fused_projections import linear_from, unfuse_projections
from paged_serve.engine.model.latent_attention import is_latent_attention
from paged_serve.engine.model.linear_attention import is_gated_delta_net
from paged_serve.engine.model.linear_swap import transformer_layers
from paged_serve.engine.model.mamba_mixer import is_mamba2_mixer, mamba2_layers
from paged_serve.engine.model.short_conv import short_conv_layers
from paged_serve.engine.platform.cpu.linears import restore_plain_linears
from paged_serve.engine.platform.cpu.packed_experts import restore_plain_experts
from paged_serve.engine.quant.experts import StoredExperts
from paged_serve.engine.quant.linear import QuantizedLinear
from paged_serve.engine.quant.slicing import columns_of, expert_inputs, expert_outputs, rows_of


@dataclass(frozen=True, slots=True)
class ShardSource:
    """Where a rank's tensor of a model sharded on the meta device comes from (read by
    engine/model/shard_loading.py): ``ranges`` ``[start, stop)`` of the full tensor ``full``
    along ``dim``, concatenated (no ranges: all of it), or zeros of the rank's shape."""

    full: torch.Tensor
    dim: int = 0
    ranges: tuple[tuple[int, int], ...] = ()
    zeros: bool = False


SOURCE = "_tp_source"  # the attribute a meta shard carries its ShardSource in


def _note(shard: torch.Tensor, source: ShardSource) -> None:
    """Tag ``shard`` with ``source`` when sharding runs on the meta device (a real full tensor
    is never referenced: the shard holds its own values then)."""
    if source.full.is_meta:
        setattr(shard, SOURCE, source)


@dataclass(frozen=True, slots=True)
class ShardShape:
    """A model's sharded dimensions on one rank: heads and MLP width per rank."""

    num_heads: int
    num_kv_heads: int
    intermediate_size: int


def shard_shape(hf_config: object, world_size: int) -> ShardShape:
    """Per-rank heads and MLP width; ValueError naming the numbers when ``world_size`` does not
    divide them. KV heads are never replicated: fewer KV heads than ranks is refused."""
    if getattr(hf_config, "num_attention_heads", None) is None:
        raise ValueError(
            f"tensor parallelism shards attention heads, and {type(hf_config).__name__} has "
            "none: serve it with --tensor-parallel-size 1"
        )
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    intermediate = int(hf_config.intermediate_size)
    if kv_heads < world_size:
        raise ValueError(
            f"tensor_parallel_size {world_size} is more than the model's {kv_heads} KV heads: "
            f"each rank needs at least one KV head (use a tensor_parallel_size that divides "
            f"{kv_heads})"
        )
    for what, count in (
        ("attention heads", heads),
        ("KV heads", kv_heads),
        ("MLP intermediate size", intermediate),
    ):
        if count % world_size:
            raise ValueError(
                f"tensor_parallel_size {world_size} does not divide the model's {count} {what}"
            )
    return ShardShape(heads // world_size, kv_heads // world_size, intermediate // world_size)


def plain_projections(model: nn.Module) -> None:
    """A model prepared for one device (fused, packed projections) back to its original
    ``nn.Linear`` ones, in place: what sharding (and ``check_shardable``) reads."""
    restore_plain_linears(model)
    restore_plain_experts(model)
    unfuse_projections(model)


def check_shardable(model: nn.Module, world_size: int) -> None:
    """Raise ValueError naming what this module swap cannot shard ``world_size`` ways: each
    decoder layer needs ``self_attn.{q,k,v,o}_proj`` as ``nn.Linear``s, an MLP that is a dense
    ``gate/up/down_proj`` or a mixture-of-experts block (``_plain_experts``), widths the size
    divides, and per-head q/k norms only (a norm over all heads, as OLMo 2's, would need every
    rank's heads). ``model`` has its plain projections (``plain_projections``)."""
    name = type(model).__name__
    if short_conv_layers(model):
        raise ValueError(
            f"tensor parallelism does not shard {name}'s short-convolution mixers yet: serve "
            "it with --tensor-parallel-size 1"
        )
    if getattr(model.config, "vision_config", None) is not None:
        raise ValueError(
            f"tensor parallelism does not shard {name}, a vision-language model, yet: serve it "
            "with --tensor-parallel-size 1"
        )
    if is_encoder(model) and mamba2_layers(model):
        raise ValueError(
            f"tensor parallelism shards decoders whose layers are model.model.layers; {name} "
            "keeps its own elsewhere: serve it with --tensor-parallel-size 1"
        )
    if is_encoder(model):
        _check_encoder_shardable(model, world_size)
        return
    head_dim = getattr(model.config, "head_dim", None)
    for i, layer in enumerate(model.model.layers):
        attn, mlp, mixer = getattr(layer, "self_attn", None), _mlp(layer), _mixer(layer)
        if mixer is not None and is_gated_delta_net(mixer):
            _check_delta_net_shardable(mixer, f"{name} layer {i}", world_size)
        elif mixer is not None:  # beside attention too (Falcon-H1)
            _check_mamba2_shardable(mixer, f"{name} layer {i}", world_size)
        elif attn is None:
            raise ValueError(
                f"tensor parallelism: {name} layer {i} has no self_attn, linear_attn or mamba "
                "mixer to shard"
            )
        if mlp is None:
            raise ValueError(
                f"tensor parallelism: {name} layer {i} has no feed-forward block it knows "
                "(mlp or feed_forward)"
            )
        missing = (
            []
            if attn is None
            else [n for n in _head_projections(attn) + ["o_proj"] if not _linear(attn, n)]
        )
        if missing:
            raise ValueError(f"tensor parallelism: {name} layer {i} has no {missing} Linear")
        if not _dense_mlp(mlp) and not _plain_experts(mlp):
            raise ValueError(
                f"tensor parallelism shards dense gate/up/down MLPs and mixture-of-experts blocks "
                f"of a router, gated experts and shared gated MLPs; {name} layer {i}'s MLP is "
                f"{type(mlp).__name__}"
            )
        widths = {"MLP": mlp.gate_proj.out_features} if _dense_mlp(mlp) else {}
        if _plain_experts(mlp):
            widths["experts'"] = _experts_width(mlp.experts)
            for part_name, part in _shared_parts(mlp).items():
                if _dense_mlp(part):
                    widths[part_name] = part.gate_proj.out_features
        for what, width in widths.items():
            if width % world_size:
                raise ValueError(
                    f"tensor_parallel_size {world_size} does not divide {name} layer {i}'s "
                    f"{what} width {width}"
                )
        for norm_name in ("q_norm", "k_norm"):
            norm = getattr(attn, norm_name, None) if attn is not None else None
            weight = getattr(norm, "weight", None)
            if weight is not None and head_dim is not None and weight.numel() != head_dim:
                raise ValueError(
                    f"tensor parallelism: {name}'s {norm_name} normalises over all heads "
                    f"({weight.numel()} wide), which needs every rank's heads"
                )


def _mlp(layer: nn.Module) -> nn.Module | None:
    """A decoder layer's feed-forward block (``mlp``, or Bamba's and Falcon-H1's
    ``feed_forward``)."""
    mlp = getattr(layer, "mlp", None)
    return mlp if mlp is not None else getattr(layer, "feed_forward", None)


def _mixer(layer: nn.Module) -> nn.Module | None:
    """A decoder layer's stateful token mixer: gated DeltaNet's ``linear_attn`` or a Mamba-2
    mixer (Bamba's ``mamba``), None for an attention layer."""
    mixer, mamba = getattr(layer, "linear_attn", None), getattr(layer, "mamba", None)
    if mixer is None and mamba is not None and is_mamba2_mixer(mamba):
        mixer = mamba
    return mixer


def _check_mamba2_shardable(mixer: nn.Module, where: str, world_size: int) -> None:
    """Each rank needs whole heads and whole groups of B and C (its gated norm normalises
    per group), as plain Linears."""
    for what, count in (("heads", mixer.num_heads), ("groups", mixer.n_groups)):
        if count % world_size:
            raise ValueError(
                f"tensor_parallel_size {world_size} does not divide {where}'s {count} Mamba-2 "
                f"{what}"
            )
    norm = mixer.norm
    per_group = (
        getattr(norm, "group_size", None) == mixer.intermediate_size // mixer.n_groups
        or getattr(norm, "n_groups", None) == mixer.n_groups  # Falcon-H1's
        or isinstance(norm, nn.Identity)  # Falcon-H1 without the mixer's norm
    )
    if not per_group:
        raise ValueError(f"tensor parallelism: {where}'s gated norm is not per group of heads")
    missing = [n for n in ("in_proj", "out_proj") if not _linear(mixer, n)]
    if missing:
        raise ValueError(f"tensor parallelism: {where} has no {missing} Linear")


def _check_delta_net_shardable(mixer: nn.Module, where: str, world_size: int) -> None:
    """Each rank needs whole key heads and the value heads they serve, as plain Linears."""
    for what, count in (("key heads", mixer.num_k_heads), ("value heads", mixer.num_v_heads)):
        if count % world_size:
            raise ValueError(
                f"tensor_parallel_size {world_size} does not divide {where}'s {count} gated "
                f"DeltaNet {what}"
            )
    names = [n for n, m in mixer.named_children() if n.startswith("in_proj") or n == "out_proj"]
    missing = [n for n in names if not _linear(mixer, n)]
    if missing:
        raise ValueError(f"tensor parallelism: {where} has no {missing} Linear")


def _head_projections(attn: nn.Module) -> list[str]:
    """The projections of ``attn`` whose output rows are per-head (column-parallel)."""
    if is_latent_attention(attn):
        query = "q_proj" if getattr(attn, "q_proj", None) is not None else "q_b_proj"
        return [query, "kv_b_proj"]
    return ["q_proj", "k_proj", "v_proj"]


def _linear(module: nn.Module, name: str) -> bool:
    return isinstance(getattr(module, name, None), (nn.Linear, QuantizedLinear))


def _dense_mlp(module: nn.Module | None) -> bool:
    """A gated MLP of ``gate/up/down_proj`` Linears (a dense layer, or a shared expert)."""
    return module is not None and all(
        _linear(module, n) for n in ("gate_proj", "up_proj", "down_proj")
    )


ROUTER_NAMES = ("gate", "router")  # what the families call a block's router


def _shared_parts(mlp: nn.Module) -> dict[str, nn.Module]:
    """The children of a mixture-of-experts block beside its router and routed experts."""
    return {n: m for n, m in mlp.named_children() if n not in ("experts", *ROUTER_NAMES)}


def _plain_experts(mlp: nn.Module | None) -> bool:
    """A mixture-of-experts block this swap shards: a router, ``experts`` with a gate/up pair
    (transformers' experts modules: ``gate_up_proj`` and ``down_proj``, in either layout, gate
    and up concatenated or interleaved, with or without biases), and besides them only shared
    experts (gated MLPs, sharded as dense ones) and a shared expert's one-output gate
    (``Linear(H, 1)``, replicated)."""
    experts = getattr(mlp, "experts", None)
    if experts is None or not any(getattr(mlp, n, None) is not None for n in ROUTER_NAMES):
        return False
    for part in _shared_parts(mlp).values():
        one_gate = isinstance(part, nn.Linear) and part.out_features == 1
        if not (_dense_mlp(part) or one_gate):
            return False
    return getattr(experts, "has_gate", False) and hasattr(experts, "is_transposed")


def _experts_width(experts: nn.Module) -> int:
    """``I``: the experts' intermediate width (``down_proj`` reads it)."""
    down = experts.down_proj
    return down.shape[1] if experts.is_transposed else down.shape[2]


def _shard_experts(experts: nn.Module, rank: int, world_size: int, group: object | None) -> None:
    """Rank ``r`` keeps its slice ``r*I/N .. (r+1)*I/N`` of each expert's gate and up outputs
    (and their biases) and the matching inputs of its down projection; the down bias stays on
    rank 0 only, and the experts' partial sums are all-reduced (``tp_group``, read by
    engine/model/experts_swap.py), so the bias is added once."""
    part = _experts_width(experts) // world_size
    width = part * world_size
    lo, hi = rank * part, (rank + 1) * part
    if experts.is_concatenated:  # [gate rows; up rows]
        keep_ranges = ((lo, hi), (width + lo, width + hi))
    else:  # gate and up interleaved: the pairs of this slice are adjacent
        keep_ranges = ((2 * lo, 2 * hi),)
    keep = torch.cat([torch.arange(a, b) for a, b in keep_ranges])
    mine = slice(lo, hi)
    if isinstance(experts.down_proj, StoredExperts):  # a checkpoint's, kept quantized
        _shard_stored_experts(experts, keep_ranges, lo, hi)
    else:
        full_gate_up, full_down = experts.gate_up_proj, experts.down_proj
        gate_up, down = full_gate_up.data, full_down.data
        if experts.is_transposed:  # [E, in, out]
            gate_up, down = gate_up[:, :, keep], down[:, mine, :]
            gate_up_dim, down_dim = 2, 1
        else:  # [E, out, in]
            gate_up, down = gate_up[:, keep, :], down[:, :, mine]
            gate_up_dim, down_dim = 1, 2
        experts.gate_up_proj = nn.Parameter(gate_up.contiguous(), requires_grad=False)
        experts.down_proj = nn.Parameter(down.contiguous(), requires_grad=False)
        _note(experts.gate_up_proj, ShardSource(full_gate_up, gate_up_dim, keep_ranges))
        _note(experts.down_proj, ShardSource(full_down, down_dim, ((mine.start, mine.stop),)))
    if experts.has_bias:
        full_bias = experts.gate_up_proj_bias
        bias = full_bias.data[:, keep].contiguous()
        experts.gate_up_proj_bias = nn.Parameter(bias, requires_grad=False)
        _note(experts.gate_up_proj_bias, ShardSource(full_bias, 1, keep_ranges))
        full_down_bias = experts.down_proj_bias
        down_bias = full_down_bias.data
        down_bias = down_bias.clone() if rank == 0 else torch.zeros_like(down_bias)
        experts.down_proj_bias = nn.Parameter(down_bias, requires_grad=False)
        _note(experts.down_proj_bias, ShardSource(full_down_bias, zeros=rank != 0))
    experts.intermediate_dim = experts.intermediate_size = part
    experts.tp_group = group
    experts.tp_reduce = True


def _shard_stored_experts(
    experts: nn.Module, keep_ranges: tuple[tuple[int, int], ...], lo: int, hi: int
) -> None:
    """The same slices of experts held in a checkpoint's quantized layout (``StoredExperts``,
    ``[E, out, in]``), cut in their stored codes and scales (``engine/quant/slicing.py``)."""
    experts.gate_up_proj = StoredExperts(expert_outputs(experts.gate_up_proj.stored, keep_ranges))
    experts.down_proj = StoredExperts(expert_inputs(experts.down_proj.stored, lo, hi))


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_r @ W_r^T) + b``: this rank's input slice times its weight columns,
    summed over the ranks of ``group``; the bias (replicated) is added once, after the sum.

    The local product is a bias-free ``nn.Linear`` (``proj``), so weight-only quantization
    swaps it as it swaps every other projection."""

    def __init__(
        self,
        weight: torch.Tensor | QuantizedLinear,
        bias: torch.Tensor | None,
        group: object | None,
    ):
        super().__init__()
        # a checkpoint's quantized projection comes already sliced (engine/quant/slicing.py)
        self.proj = weight if isinstance(weight, QuantizedLinear) else linear_from(weight, None)
        self.in_features = self.proj.in_features
        self.out_features = self.proj.out_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group  # None: the default process group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x).contiguous()  # all_reduce sums the ranks' buffers in memory order
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (local), out_features={self.out_features}"


def _plain(linear: nn.Module) -> nn.Linear | QuantizedLinear:
    """``linear`` if sharding can slice it: a plain ``nn.Linear``, or a checkpoint's quantized
    projection (sliced in its stored layout)."""
    if type(linear) is not nn.Linear and not isinstance(linear, QuantizedLinear):
        raise ValueError(
            f"tensor parallelism shards plain nn.Linear projections, got {type(linear).__name__}:"
            " shard before quantizing"
        )
    return linear


def _rows(linear: nn.Module, rank: int, world_size: int) -> nn.Module:
    """Column-parallel: the ``rank``-th block of output rows, as a plain ``nn.Linear`` (or a
    ``QuantizedLinear`` of those rows)."""
    n = _plain(linear).out_features // world_size
    return _row_ranges(linear, ((rank * n, (rank + 1) * n),))


def _row_ranges(linear: nn.Module, ranges: tuple[tuple[int, int], ...]) -> nn.Module:
    """Column-parallel over one or several blocks: output rows ``ranges``, concatenated."""
    linear = _plain(linear)
    if isinstance(linear, QuantizedLinear):
        return rows_of(linear, ranges)
    bias = None if linear.bias is None else _take_rows(linear.bias, ranges)
    out = linear_from(_take_rows(linear.weight, ranges), bias)
    _note(out.weight, ShardSource(linear.weight, 0, ranges))
    if linear.bias is not None:
        _note(out.bias, ShardSource(linear.bias, 0, ranges))
    return out


def _take_rows(t: torch.Tensor, ranges: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """Rows ``ranges`` of ``t`` concatenated, in a tensor of their own (the full one is freed)."""
    return torch.cat([t.detach()[a:b] for a, b in ranges])


def _columns(linear: nn.Linear, rank: int, world_size: int, group: object | None) -> nn.Module:
    """Row-parallel: the ``rank``-th block of input columns, summed over the ranks."""
    linear = _plain(linear)
    n = linear.in_features // world_size
    if isinstance(linear, QuantizedLinear):
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return RowParallelLinear(columns_of(linear, rank * n, (rank + 1) * n), bias, group)
    weight = linear.weight.detach()[:, rank * n : (rank + 1) * n].contiguous()
    bias = None if linear.bias is None else linear.bias.detach().clone()
    row_parallel = RowParallelLinear(weight, bias, group)
    _note(row_parallel.proj.weight, ShardSource(linear.weight, 1, ((rank * n, (rank + 1) * n),)))
    if bias is not None:
        _note(row_parallel.bias, ShardSource(linear.bias))
    return row_parallel


def shard_model(
    model: nn.Module, *, rank: int, world_size: int, group: object | None = None
) -> ShardShape:
    """Shard every decoder layer of ``model`` (a supported causal LM) in place for ``rank``.

    ``group``: the process group the row-parallel all-reduces run on (None: the default one,
    which must exist before the first forward, not before this call).
    """
    shape = shard_shape(model.config, world_size)
    plain_projections(model)
    if is_encoder(model):
        _shard_encoder(model, rank, world_size, group)
        return shape
    for layer in model.model.layers:
        attn, mlp, mixer = getattr(layer, "self_attn", None), _mlp(layer), _mixer(layer)
        if mixer is not None and is_gated_delta_net(mixer):  # a hybrid's (check_shardable)
            _shard_delta_net(mixer, rank, world_size, group)
        elif mixer is not None:
            _shard_mamba2(mixer, rank, world_size, group)
        if attn is not None:  # alone, or beside a Mamba-2 mixer (Falcon-H1)
            _shard_attention(attn, shape, rank, world_size, group)
        if _plain_experts(mlp):
            _shard_experts(mlp.experts, rank, world_size, group)
            dense = [m for m in _shared_parts(mlp).values() if _dense_mlp(m)]
        else:
            dense = [mlp]
        for part in dense:
            _shard_dense_mlp(part, rank, world_size, group)
    return shape


def _shard_attention(
    attn: nn.Module, shape: ShardShape, rank: int, world_size: int, group: object | None
) -> None:
    """Megatron's attention split: per-head projections column-parallel, o_proj row-parallel."""
    for name in _head_projections(attn):
        setattr(attn, name, _rows(getattr(attn, name), rank, world_size))
    attn.o_proj = _columns(attn.o_proj, rank, world_size, group)
    # The ratio is unchanged, but keep the module's own bookkeeping true to its heads.
    attn.num_key_value_groups = shape.num_heads // shape.num_kv_heads
    sinks = getattr(attn, "sinks", None)
    if sinks is not None:  # gpt-oss: one logit per query head, this rank's heads
        heads = slice(rank * shape.num_heads, (rank + 1) * shape.num_heads)
        attn.sinks = nn.Parameter(sinks.data[heads].clone(), requires_grad=False)
        _note(attn.sinks, ShardSource(sinks, 0, ((heads.start, heads.stop),)))


def _shard_delta_net(mixer: nn.Module, rank: int, world_size: int, group: object | None) -> None:
    """Rank ``r`` keeps key heads ``r*Hk/N ..`` and the value heads they serve: its rows of the
    input projections (Qwen3-Next's fused ones are grouped per key head, so those are one
    block; Qwen3.5's ``in_proj_qkv`` is q, k, v one after another, three blocks, as are the
    convolution's channels), its ``A_log`` and ``dt_bias`` entries and ``out_proj``'s input
    columns (all-reduced). The gated norm is per value head: replicated."""
    hk, hv = mixer.num_k_heads // world_size, mixer.num_v_heads // world_size
    dk, dv, key_dim = mixer.head_k_dim, mixer.head_v_dim, mixer.key_dim
    channels = (
        (rank * hk * dk, (rank + 1) * hk * dk),
        (key_dim + rank * hk * dk, key_dim + (rank + 1) * hk * dk),
        (2 * key_dim + rank * hv * dv, 2 * key_dim + (rank + 1) * hv * dv),
    )
    if hasattr(mixer, "in_proj_qkvz"):
        for name in ("in_proj_qkvz", "in_proj_ba"):
            setattr(mixer, name, _rows(getattr(mixer, name), rank, world_size))
    else:
        mixer.in_proj_qkv = _row_ranges(mixer.in_proj_qkv, channels)
        for name in ("in_proj_z", "in_proj_b", "in_proj_a"):
            setattr(mixer, name, _rows(getattr(mixer, name), rank, world_size))
    heads = ((rank * hv, (rank + 1) * hv),)
    _shard_mixer_parameters(mixer, channels, {"A_log": heads, "dt_bias": heads})
    mixer.out_proj = _columns(mixer.out_proj, rank, world_size, group)
    mixer.num_k_heads, mixer.num_v_heads = hk, hv
    mixer.key_dim, mixer.value_dim = hk * dk, hv * dv
    mixer.conv_dim = mixer.conv1d.weight.shape[0]


def _shard_mixer_parameters(
    mixer: nn.Module,
    channels: tuple[tuple[int, int], ...],
    per_head: dict[str, tuple[tuple[int, int], ...]],
    norm: tuple[tuple[int, int], ...] | None = None,
) -> None:
    """A stateful mixer's parameters cut to this rank's rows: ``conv1d``'s ``channels``, each
    of ``per_head``'s parameters its ranges, and (``norm``) the gated norm's lanes."""
    conv = mixer.conv1d
    parts = [(conv, "weight", channels), (conv, "bias", channels)]
    parts += [(mixer, name, ranges) for name, ranges in per_head.items()]
    if norm is not None:
        parts.append((mixer.norm, "weight", norm))
    for module, name, ranges in parts:
        full = getattr(module, name, None)  # no bias, or no norm (Falcon-H1's option)
        if full is None:
            continue
        setattr(module, name, nn.Parameter(_take_rows(full, ranges), requires_grad=False))
        _note(getattr(module, name), ShardSource(full, 0, ranges))
    conv.in_channels = conv.out_channels = conv.groups = conv.weight.shape[0]


def _shard_mamba2(mixer: nn.Module, rank: int, world_size: int, group: object | None) -> None:
    """Rank ``r`` keeps heads ``r*H/N ..`` and groups ``r*G/N ..``: its rows of ``in_proj``'s
    gate ``z``, ``x``, ``B``, ``C`` and ``dt`` blocks (and of Falcon-H1's ``mup_vector``), the
    matching convolution channels (``x``, ``B``, ``C``), its heads' ``A_log``, ``dt_bias`` and
    ``D``, its lanes of the gated norm (whole groups, so each normalises as before) and
    ``out_proj``'s input columns (all-reduced)."""
    heads, groups = mixer.num_heads // world_size, mixer.n_groups // world_size
    inner, lanes = mixer.intermediate_size, heads * mixer.head_dim
    bc, state = mixer.n_groups * mixer.ssm_state_size, groups * mixer.ssm_state_size

    def block(offset: int, width: int) -> tuple[int, int]:
        return offset + rank * width, offset + (rank + 1) * width

    x, b, c = block(0, lanes), block(inner, state), block(inner + bc, state)
    channels = (x, b, c)  # of the convolution: x, B, C
    projection = (x, *((lo + inner, hi + inner) for lo, hi in channels))
    projection += (block(2 * inner + 2 * bc, heads),)  # z, x, B, C, dt
    mixer.in_proj = _row_ranges(mixer.in_proj, projection)
    mup = getattr(mixer, "mup_vector", None)
    if mup is not None:
        mixer.mup_vector = _take_rows(mup.reshape(-1), projection)
    per_head = (block(0, heads),)
    _shard_mixer_parameters(
        mixer, channels, {"A_log": per_head, "dt_bias": per_head, "D": per_head}, norm=(x,)
    )
    mixer.out_proj = _columns(mixer.out_proj, rank, world_size, group)
    mixer.num_heads, mixer.n_groups, mixer.intermediate_size = heads, groups, lanes
    if hasattr(mixer.norm, "n_groups"):  # Falcon-H1's norm counts its groups
        mixer.norm.n_groups = groups
    mixer.conv_dim = mixer.conv1d.weight.shape[0]


def _shard_dense_mlp(mlp: nn.Module, rank: int, world_size: int, group: object | None) -> None:
    """Megatron's MLP split: gate and up column-parallel, down row-parallel (all-reduced)."""
    for name in ("gate_proj", "up_proj"):
        setattr(mlp, name, _rows(getattr(mlp, name), rank, world_size))
    mlp.down_proj = _columns(mlp.down_proj, rank, world_size, group)


# A BERT or RoBERTa-style encoder layer's projections, by their paths in the layer.
ENCODER_COLUMN_PARALLEL = (
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "intermediate.dense",
)
ENCODER_ROW_PARALLEL = ("attention.output.dense", "output.dense")


def is_encoder(model: nn.Module) -> bool:
    """``model`` keeps its layers elsewhere than a decoder's ``model.model.layers`` (a pooling
    model's bidirectional encoder)."""
    return not isinstance(getattr(getattr(model, "model", None), "layers", None), nn.ModuleList)


def _owner(layer: nn.Module, path: str) -> tuple[nn.Module, str]:
    *parents, leaf = path.split(".")
    owner = layer
    for part in parents:
        owner = getattr(owner, part, None)
        if owner is None:
            break
    return owner, leaf


def _check_encoder_shardable(model: nn.Module, world_size: int) -> None:
    """Every layer needs BERT's projections (``ENCODER_COLUMN_PARALLEL``, ``..._ROW_PARALLEL``)
    as ``nn.Linear``s whose widths ``world_size`` divides."""
    name = type(model).__name__
    for i, layer in enumerate(transformer_layers(model)):
        for path in ENCODER_COLUMN_PARALLEL + ENCODER_ROW_PARALLEL:
            owner, leaf = _owner(layer, path)
            if not isinstance(getattr(owner, leaf, None), nn.Linear):
                raise ValueError(
                    f"tensor parallelism shards BERT and RoBERTa-style encoder layers; {name} "
                    f"layer {i} has no {path} Linear (serve it with --tensor-parallel-size 1)"
                )


def _shard_encoder(model: nn.Module, rank: int, world_size: int, group: object | None) -> None:
    """Megatron's split of each encoder layer (module docstring); the embeddings, the norms,
    the pooler and the classifier stay replicated."""
    for layer in transformer_layers(model):
        for path in ENCODER_COLUMN_PARALLEL:
            owner, leaf = _owner(layer, path)
            setattr(owner, leaf, _rows(getattr(owner, leaf), rank, world_size))
        for path in ENCODER_ROW_PARALLEL:
            owner, leaf = _owner(layer, path)
            setattr(owner, leaf, _columns(getattr(owner, leaf), rank, world_size, group))
