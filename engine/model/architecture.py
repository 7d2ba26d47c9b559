"""Which Hugging Face causal LMs the engine serves, and the reason it refuses one.

The engine swaps its paged attention in through transformers' attention interface and runs the
model's own modules, so any causal LM whose attention layers call that interface and know their
``layer_idx`` runs, dense or mixture-of-experts: RoPE, NoPE layers, per-layer sliding windows,
soft-capped scores, attention sinks and any ``scaling`` arrive as the arguments HF passes;
multi-head latent attention (MLA) modules built as DeepSeek-V3's run on a latent cache
(``engine/model/latent_attention.py``); hybrids whose ``linear_attention`` layers are gated
DeltaNet mixers (Qwen3-Next, Qwen3.5) run them over per-sequence state slots
(``engine/model/linear_attention.py``). The
families whose decoder ``engine/model/body/`` reproduces without HF's per-layer Python run on
it (``FAST_BODY_ARCHITECTURES``); every other one runs HF's own decoder forward over the flat
batch. What cannot be right is refused at load, before any KV memory is allocated, with what is
missing: other linear-attention or state-space layers, DeepSeek's sparse attention, ALiBi biases,
bidirectional attention in a model served to generate, attention that does not go through the
interface, encoder-decoders. A pooling model (embeddings, classifiers: ``engine/pooling/``) needs
no LM head and may be a bidirectional encoder (``is_bidirectional``).
"""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from paged_serve.engine.kv.kv_cache import FEED_FORWARD_LAYER_TYPES
from paged_serve.engine.model.latent_attention import unservable_latent_reason
from paged_serve.engine.model.linear_attention import linear_attention_layers
from paged_serve.engine.model.linear_swap import transformer_layers
from paged_serve.engine.model.mamba_mixer import mamba2_layers, unservable_mixer_reason
from paged_serve.engine.model.short_conv import SHORT_CONV_LAYER_TYPE, short_conv_layers

# Decoders engine/model/body/ runs op for op (tests/engine/model/test_model_body.py).
FAST_BODY_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",  # its own fused qkv_proj and gate_up_proj
    "Olmo2ForCausalLM",  # norms after each block, QK norms over every head
    "SmolLM3ForCausalLM",  # NoPE layers
    "GraniteForCausalLM",  # embedding and residual multipliers
    "Gemma2ForCausalLM",  # norms around each block, offset weights, soft-capped scores
    "Gemma3ForCausalLM",  # and QK norms, a rotary embedding per layer type
    "Qwen3MoeForCausalLM",  # the mixtures of experts: their own blocks (body/feed_forward.py)
    "Qwen2MoeForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",  # and QK norms over every head, clip_qkv
    "GptOssForCausalLM",  # and attention sinks, rotation by half-angle pairs
    "Glm4MoeForCausalLM",  # and a partial rotary embedding, optional QK norms
    "DeepseekV3ForCausalLM",  # latent attention through its own (swapped) module
    "DeepseekV2ForCausalLM",
    "Glm4MoeLiteForCausalLM",
    "Qwen3NextForCausalLM",  # gated DeltaNet and gated attention through their own modules
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "CohereForCausalLM",  # LayerNorm, attention and MLP in parallel, rotation in pairs
)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
LINEAR_LAYER_TYPE = "linear_attention"  # gated DeltaNet or Mamba-2, over state slots
PARALLEL_LAYER_TYPE = "hybrid"  # Falcon-H1: attention and a Mamba-2 mixer side by side


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The model's attention modules: those named ``*Attention`` that know their ``layer_idx``
    (an encoder's ``*SelfAttention``, the one that calls the interface, where its wrapper is
    an ``*Attention`` too)."""
    return [
        m
        for m in model.modules()
        if type(m).__name__.endswith("Attention") and getattr(m, "layer_idx", None) is not None
    ]


def decoder_model(model: nn.Module) -> nn.Module:
    """The decoder a causal LM's head sits on: ``model.base_model``, unless that is the model
    itself (Llama 4's ``Llama4ForCausalLM`` names ``language_model`` as its base model prefix
    but keeps its decoder at ``model.model``), then ``model.model``; the model itself when it
    has neither (a bare encoder)."""
    base = getattr(model, "base_model", model)
    if base is not model:
        return base
    inner = getattr(model, "model", None)
    return inner if isinstance(inner, nn.Module) else model


def _has_layer_list(model: PreTrainedModel) -> bool:
    try:
        transformer_layers(model)
    except ValueError:
        return False
    return True


def text_config(model: PreTrainedModel) -> PretrainedConfig:
    """The config of the model's text decoder: its own config, or a vision-language model's
    ``text_config`` (sizes, vocabulary, context and logit transforms live there)."""
    return model.config.get_text_config()


def is_multimodal(model: PreTrainedModel) -> bool:
    """The model runs a vision encoder beside its language model (a LLaVA-style checkpoint
    loaded whole: ``get_image_features`` and a ``vision_config``); a vision-language checkpoint
    loaded as its text model alone is not."""
    vision = getattr(model.config, "vision_config", None) is not None
    return vision and callable(getattr(model, "get_image_features", None))


def is_bidirectional(model: nn.Module) -> bool:
    """Some attention layer of ``model`` attends both ways (``is_causal`` False): an encoder,
    whose every token sees its whole prompt."""
    return any(getattr(m, "is_causal", True) is False for m in attention_layers(model))


def number_attention_layers(model: PreTrainedModel) -> None:
    """Give the attention module of each transformer layer that lacks one its ``layer_idx``
    (Nomic BERT's modules are not numbered; the paged cache is indexed by it), in place."""
    for index, layer in enumerate(transformer_layers(model)):
        unnumbered = [
            m
            for m in layer.modules()
            if type(m).__name__.endswith("Attention")
            and hasattr(m, "is_causal")
            and getattr(m, "layer_idx", None) is None
        ]
        if len(unnumbered) == 1:
            unnumbered[0].layer_idx = index


def check_servable(model: PreTrainedModel, pooling: bool = False) -> None:
    """Raise ValueError naming what the engine lacks to serve ``model``; None when it can.
    A pooling model (``pooling``: embeddings, classifiers) needs no LM head and may be a
    bidirectional encoder (BERT's ``encoder.layer`` holds its layers; attention modules without
    a ``layer_idx`` are numbered, ``number_attention_layers``)."""
    name, config = type(model).__name__, text_config(model)
    if pooling:
        number_attention_layers(model)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model: paged-serve serves decoder-only LMs")
    if not pooling and (model.get_output_embeddings() is None or decoder_model(model) is model):
        raise ValueError(f"{name} is not a causal LM: an LM head over a decoder (base_model)")
    encoder = pooling and is_bidirectional(model)
    if not encoder and not _has_layer_list(model):
        raise ValueError(
            f"{name} keeps no list of decoder layers where the engine's module swaps (fused and "
            "quantized projections, sharding) look: model.model.layers, "
            "model.model.language_model.layers or the base model's layers"
        )
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", "") == "alibi":
        raise ValueError(f"{name} uses ALiBi position biases, which the paged kernels do not add")
    if getattr(config, "kv_lora_rank", None):
        for module in attention_layers(model):
            reason = unservable_latent_reason(module)
            if reason is not None:
                raise ValueError(f"{name} {reason}")
    layer_types = getattr(config, "layer_types", None) or []
    served = (
        *ATTENTION_LAYER_TYPES,
        LINEAR_LAYER_TYPE,
        PARALLEL_LAYER_TYPE,
        SHORT_CONV_LAYER_TYPE,
        *FEED_FORWARD_LAYER_TYPES,
    )
    other = sorted({t for t in layer_types if t not in served})
    if other:
        raise ValueError(
            f"{name} has {', '.join(other)} layers, which paged-serve does not support yet "
            f"(it serves {', '.join(served)} layers)"
        )
    linear = _check_linear_layers(model, layer_types)
    # Hybrids' flag is off for their stateful cache, not their attention (which calls the
    # interface): their mixers are swapped whole.
    if not getattr(model, "_supports_attention_backend", False) and not linear:
        raise ValueError(
            f"{name}'s attention does not go through transformers' attention interface, so "
            "paged attention cannot be swapped in"
        )
    modules = attention_layers(model)
    if not pooling and is_bidirectional(model):
        raise ValueError(
            f"{name} has bidirectional attention layers: paged-serve serves causal LMs"
        )
    mixerless = {i for i, t in enumerate(layer_types) if t in FEED_FORWARD_LAYER_TYPES}
    found = sorted({m.layer_idx for m in modules} | set(linear) | mixerless)
    layers = int(config.num_hidden_layers)
    if found != list(range(layers)):
        shown = ", ".join(map(str, found[:8])) + (", ..." if len(found) > 8 else "")
        raise ValueError(
            f"{name}: attention modules found for layers [{shown}] of {layers}; paged attention "
            "needs one per decoder layer, numbered by layer_idx"
        )


def _check_linear_layers(model: PreTrainedModel, layer_types: list[str]) -> list[int]:
    """The layer ids of ``model``'s stateful mixers (gated DeltaNet, Mamba-2 or LFM2's short
    convolutions), one per ``linear_attention`` or ``conv`` entry of ``layer_types`` and one
    beside the attention of each ``hybrid`` entry (ValueError naming what does not fit)."""
    stateful = (LINEAR_LAYER_TYPE, PARALLEL_LAYER_TYPE, SHORT_CONV_LAYER_TYPE)
    wanted = [i for i, t in enumerate(layer_types) if t in stateful]
    delta_nets, mambas = linear_attention_layers(model), mamba2_layers(model)
    convs = short_conv_layers(model)
    found = sorted(m.layer_idx for m in (*delta_nets, *mambas, *convs))
    name = type(model).__name__
    if found != wanted:
        raise ValueError(
            f"{name}: linear_attention layers {wanted}, but gated DeltaNet mixers (with conv1d, "
            f"A_log, dt_bias, a gated norm and HF's input projections) or Mamba-2 mixers (in_proj, "
            f"conv1d, A_log, dt_bias, D, norm, out_proj) at {found}: other linear-attention and "
            "state-space layers are not supported yet"
        )
    if sum(map(bool, (delta_nets, mambas, convs))) > 1:
        raise ValueError(f"{name} mixes kinds of stateful layers; one state shape is served")
    for module in delta_nets:
        if module.activation not in ("silu", "swish"):
            raise ValueError(
                f"{name}: the gated DeltaNet convolution's activation is {module.activation!r}; "
                "the kernels apply SiLU"
            )
    for module in mambas:
        reason = unservable_mixer_reason(module)
        if reason is not None:
            raise ValueError(f"{name}: layer {module.layer_idx}'s Mamba-2 mixer: {reason}")
    return wanted


def runs_fast_body(model: PreTrainedModel) -> bool:
    """Whether ``engine/model/body/`` runs this model's decoder (else HF's own forward): a family
    of ``FAST_BODY_ARCHITECTURES``."""
    return type(model).__name__ in FAST_BODY_ARCHITECTURES
