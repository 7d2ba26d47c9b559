"""A module that holds a stored layout (``engine/quant/weights.py``, the experts' layouts of
``kernels/interface.py``): the layout's tensors as the module's buffers, its other fields as
settings, and the layout given back as its dataclass.

The buffers are not persistent: a checkpoint's tensors of these names (``qweight``, ``scales``,
...) are in its own format's layout, not this one, so ``load_state_dict`` must not read them.
They move and count with the model (``.to``, ``weight_memory``).
"""

from __future__ import annotations

from dataclasses import fields

from torch import nn


def hold_layout(module: nn.Module, layout: object, optional: tuple[str, ...]) -> dict[str, object]:
    """Register every tensor field of the dataclass ``layout`` on ``module`` as a buffer of its
    name (the ``optional`` fields also when None); returns the other fields (bits, group size,
    block, ...) by name."""
    settings: dict[str, object] = {}
    for f in fields(layout):
        value = getattr(layout, f.name)
        if hasattr(value, "shape") or (value is None and f.name in optional):
            module.register_buffer(f.name, value, persistent=False)
        else:
            settings[f.name] = value
    return settings


def held_layout(module: nn.Module, cls: type, settings: dict[str, object]) -> object:
    """The ``cls`` dataclass of what ``hold_layout`` put on ``module`` (views of its buffers)."""
    values = {f.name: settings.get(f.name) for f in fields(cls)}
    values.update({name: buf for name, buf in module._buffers.items() if name in values})
    return cls(**values)


def settings_repr(settings: dict[str, object]) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items())
