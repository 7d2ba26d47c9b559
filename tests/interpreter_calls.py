"""Make Triton's interpreter stop re-patching ``triton.language`` at every device-function call.

Under ``TRITON_INTERPRET=1`` a kernel launch patches ``triton.language`` once (every builtin
swapped for its interpreted form, found with ``inspect.getmembers``) and restores it when the
launch ends. Each call of a ``@triton.jit`` helper inside the kernel then runs the same patch
again (``InterpretedFunction.__call__`` calls ``interpreter._patch_lang``): it finds every
builtin already swapped, so it changes nothing, but it walks the modules' members each time.
In the split-row sampler (``kernels/triton/sampling_split.py``, 20 launches, about 20,000
helper calls for 8 rows) that walk took half of a 145 s profiled call.

``skip_repatching_inside_a_launch`` wraps ``interpreter._patch_lang`` so that a call finding
every ``triton.language`` module its function sees already patched returns an empty patch
scope; a launch (nothing patched yet) and any helper seeing a module not yet patched still
run the original. What the kernels compute is unchanged: the skipped work set attributes to
what they already held.
"""

from __future__ import annotations

import functools

import triton.language as tl
from triton.runtime import interpreter

_LANGS = (tl, tl.core)


def _patched(lang) -> bool:
    """Whether the interpreter's builtins are in place in ``lang`` (a launch is running)."""
    return not tl.core.is_builtin(lang.program_id)


def skip_repatching_inside_a_launch() -> None:
    """Install the wrapper (once per process)."""
    original = interpreter._patch_lang
    if getattr(original, "_skips_repatching", False):
        return

    langs_of: dict[int, list] = {}  # id of a function's globals: the language modules in them

    @functools.wraps(original)
    def patch_lang(fn):
        key = id(fn.__globals__)
        if key not in langs_of:
            langs_of[key] = [v for v in fn.__globals__.values() if any(v is m for m in _LANGS)]
        langs = langs_of[key]
        if langs and all(_patched(lang) for lang in langs):
            return interpreter._LangPatchScope()  # nothing changed, nothing to restore
        return original(fn)

    patch_lang._skips_repatching = True
    interpreter._patch_lang = patch_lang
