"""The per-step message the tensor-parallel driver sends its workers: one flat int64 array.

A step's ``StepInputs`` and its copy-on-write block copies are everything a worker needs to run
the same forward as the driver (it never samples, so no sampling parameters travel). They are
packed into one int64 array, header first::

    [kind, T, S, C, R, B, L, F, Y, Z, W | input_ids T | positions T | slots T |
     cu_seqlens S+1 | seq_lens S | table lengths S | block tables B (concatenated) |
     logit_rows R | block copies 2C (src, dst) | state_slots L | has_state L |
     state copies 2F (src, dst) | token_type_ids Y | lora_slots Z | adapter loads W]

``T`` tokens, ``S`` sequences, ``C`` block copies, ``R`` sampled rows, ``B`` block-table entries;
a hybrid model's ``L = S`` linear-attention state slots and ``F`` fork copies (``0`` otherwise);
``Y = T`` segment ids when a BERT cross-encoder's pairs carry them (``0`` otherwise);
``Z = T`` LoRA adapter slots when a request of the step has an adapter (``0`` otherwise), and
the adapter slots to fill first, each ``slot, id, rank, n, name (n code points), m, path (m
code points)`` (``W`` entries in all; every rank reads the adapter's files itself).
``kind`` is ``STEP`` or ``SHUTDOWN`` (an empty message that stops the workers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from paged_serve.engine.lora.adapter_files import LoRAAdapter
from paged_serve.engine.runner.step_inputs import StepInputs

STEP = 1
SHUTDOWN = 2
HEADER_LEN = 11


@dataclass(frozen=True, slots=True)
class StepMessage:
    """One step for the workers: its block copies ``(src, dst)``, its flat inputs, and a hybrid
    model's state-slot copies ``(src, dst)`` and the LoRA adapter slots to fill."""

    kind: int
    block_copies: list[tuple[int, int]]
    inputs: StepInputs | None
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    lora_loads: list[tuple[int, LoRAAdapter]] = field(default_factory=list)

    @classmethod
    def shutdown(cls) -> StepMessage:
        return cls(SHUTDOWN, [], None)


def pack_step(message: StepMessage) -> torch.Tensor:
    """``message`` as a 1-D int64 CPU tensor (layout in the module docstring)."""
    if message.kind == SHUTDOWN:
        return torch.tensor([SHUTDOWN] + [0] * (HEADER_LEN - 1), dtype=torch.int64)
    inputs = message.inputs
    if message.kind != STEP or inputs is None:
        raise ValueError(f"a step message needs kind STEP and inputs, got kind {message.kind}")
    tables = inputs.block_tables
    flat_tables = [b for table in tables for b in table]
    copies = [i for pair in message.block_copies for i in pair]
    state_copies = [i for pair in message.state_copies for i in pair]
    loads = _pack_loads(message.lora_loads)
    header = [
        STEP,
        len(inputs.input_ids),
        len(inputs.seq_lens),
        len(message.block_copies),
        len(inputs.logit_rows),
        len(flat_tables),
        len(inputs.state_slots),
        len(message.state_copies),
        len(inputs.token_type_ids),
        len(inputs.lora_slots),
        len(loads),
    ]
    return torch.tensor(
        header
        + inputs.input_ids
        + inputs.positions
        + inputs.slots
        + inputs.cu_seqlens
        + inputs.seq_lens
        + [len(t) for t in tables]
        + flat_tables
        + inputs.logit_rows
        + copies
        + inputs.state_slots
        + inputs.has_state
        + state_copies
        + inputs.token_type_ids
        + inputs.lora_slots
        + loads,
        dtype=torch.int64,
    )


def unpack_step(packed: torch.Tensor) -> StepMessage:
    """The inverse of ``pack_step``; ValueError on a malformed array."""
    values = packed.tolist()
    if len(values) < HEADER_LEN:
        raise ValueError(f"a step message has a {HEADER_LEN}-entry header, got {len(values)}")
    kind, t, s, c, r, b, n_state, f, y, z, w = values[:HEADER_LEN]
    if kind == SHUTDOWN:
        return StepMessage.shutdown()
    sizes = [t, t, t, s + 1, s, s, b, r, 2 * c, n_state, n_state, 2 * f, y, z, w]
    expected = HEADER_LEN + sum(sizes)
    if kind != STEP or len(values) != expected:
        raise ValueError(
            f"malformed step message: kind {kind}, {len(values)} entries, expected {expected}"
        )
    ends = list(accumulate(sizes, initial=HEADER_LEN))
    parts = [values[a:e] for a, e in zip(ends, ends[1:])]
    ids, pos, slots, cu, lens, table_lens, flat, rows, copies, held, has, fork_copies = parts[:12]
    types, lora_slots, loads = parts[12:]
    offsets = list(accumulate(table_lens, initial=0))
    tables = [flat[a:z] for a, z in zip(offsets, offsets[1:])]
    inputs = StepInputs(ids, pos, slots, cu, lens, tables, rows, held, has, types, lora_slots)
    return StepMessage(
        STEP,
        list(zip(copies[::2], copies[1::2])),
        inputs,
        list(zip(fork_copies[::2], fork_copies[1::2])),
        _unpack_loads(loads),
    )


def _pack_loads(loads: list[tuple[int, LoRAAdapter]]) -> list[int]:
    packed: list[int] = []
    for slot, adapter in loads:
        packed += [slot, adapter.id, adapter.rank]
        for text in (adapter.name, adapter.path):
            packed += [len(text), *map(ord, text)]
    return packed


def _unpack_loads(packed: list[int]) -> list[tuple[int, LoRAAdapter]]:
    loads = []
    i = 0
    while i < len(packed):
        slot, adapter_id, rank = packed[i : i + 3]
        i += 3
        texts = []
        for _ in range(2):
            n = packed[i]
            texts.append("".join(map(chr, packed[i + 1 : i + 1 + n])))
            i += 1 + n
        loads.append((slot, LoRAAdapter(adapter_id, texts[0], texts[1], rank)))
    return loads
