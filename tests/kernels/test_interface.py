"""Every backend's functions take the calls of ``kernels/interface.py``: each parameter of the
protocol by the same name and kind, with a default wherever the protocol has one, and any
further parameter with a default (so the engine's call, which passes the protocol's, binds)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest

from paged_serve.engine.platform.cpu.attention import PlannedTorchAttention
from paged_serve.engine.platform.cpu.linear_attention import causal_conv1d_cpu, gated_delta_rule_cpu
from paged_serve.engine.platform.cpu.moe import grouped_moe
from paged_serve.engine.platform.cpu.ssm import ssd_scan_cpu
from paged_serve.kernels import interface, reference
from paged_serve.kernels.triton import (
    block_copy,
    causal_conv,
    delta_rule,
    fused_moe,
    kv_write,
    lora,
    mla_attention,
    paged_attention,
    sampling,
    ssd_scan,
)

PLANNED = PlannedTorchAttention()
IMPLEMENTATIONS: list[tuple[type, Callable]] = [
    (interface.WriteKv, kv_write.write_kv),
    (interface.WriteKv, reference.write_kv_ref),
    (interface.WriteKv, PLANNED.write_kv),
    (interface.PagedAttention, paged_attention.paged_attention),
    (interface.PagedAttention, reference.paged_attention_ref),
    (interface.PagedAttention, PLANNED.paged_attention),
    (interface.WriteLatent, kv_write.write_latent),
    (interface.WriteLatent, reference.write_latent_ref),
    (interface.MlaAttention, mla_attention.mla_attention),
    (interface.MlaAttention, reference.mla_attention_ref),
    (interface.CausalConv, causal_conv.causal_conv1d),
    (interface.CausalConv, reference.causal_conv1d_ref),
    (interface.CausalConv, causal_conv1d_cpu),
    (interface.GatedDeltaRule, delta_rule.gated_delta_rule),
    (interface.GatedDeltaRule, reference.gated_delta_rule_ref),
    (interface.GatedDeltaRule, gated_delta_rule_cpu),
    (interface.SsdScan, ssd_scan.ssd_scan),
    (interface.SsdScan, reference.ssd_scan_ref),
    (interface.SsdScan, ssd_scan_cpu),
    (interface.CopyBlocks, block_copy.copy_blocks),
    (interface.CopyBlocks, reference.copy_blocks_ref),
    (interface.FusedSample, sampling.sample),
    (interface.FusedMoe, fused_moe.fused_moe),
    (interface.FusedMoe, reference.fused_moe_ref),
    (interface.FusedMoe, grouped_moe),
    (interface.LoraShrink, lora.lora_shrink),
    (interface.LoraShrink, reference.lora_shrink_ref),
    (interface.LoraExpand, lora.lora_expand),
    (interface.LoraExpand, reference.lora_expand_ref),
]


def _protocol_parameters(protocol: type) -> list[inspect.Parameter]:
    return list(inspect.signature(protocol.__call__).parameters.values())[1:]  # without self


@pytest.mark.parametrize(
    "protocol,function",
    IMPLEMENTATIONS,
    ids=[f"{p.__name__}-{getattr(f, '__qualname__', f)}" for p, f in IMPLEMENTATIONS],
)
def test_backend_implements_the_protocol(protocol: type, function: Callable) -> None:
    wanted = _protocol_parameters(protocol)
    given = inspect.signature(function).parameters
    for param in wanted:
        assert param.name in given, f"{function.__qualname__} lacks {param.name!r}"
        have = given[param.name]
        assert have.kind == param.kind, f"{param.name!r} is {have.kind}, not {param.kind}"
        if param.default is not inspect.Parameter.empty:
            assert have.default == param.default, f"{param.name!r} defaults differently"
    names = {p.name for p in wanted}
    extra = [p.name for p in given.values() if p.name not in names]
    assert all(given[name].default is not inspect.Parameter.empty for name in extra), extra
    positional = [p.name for p in given.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == [p.name for p in wanted if p.kind is p.POSITIONAL_OR_KEYWORD]


def test_a_missing_parameter_is_caught() -> None:
    """The check fails for a function that does not take the protocol's call."""

    def write_kv(key, value, k_cache, v_cache):  # no slot_mapping
        return None

    with pytest.raises(AssertionError, match="slot_mapping"):
        test_backend_implements_the_protocol(interface.WriteKv, write_kv)
