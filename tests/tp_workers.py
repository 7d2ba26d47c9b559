"""In-process tensor-parallel engines in the tests fork their worker ranks from a forkserver
that has already imported torch, transformers and the worker's code.

``TensorParallelWorkers`` starts each worker rank with multiprocessing's ``spawn``: a fresh
interpreter that imports torch, transformers and the engine before it reads its spec, about 8 s
of CPU on the 2-core box, paid by every TP=2 engine the suite builds (dozens). The ``forkserver``
context starts its server once per test process with ``PRELOAD`` imported, then forks each
worker from it: 0.3 s a TP=2 engine after the first (``LLM(loaded=..., tensor_parallel_size=2)``
of a tiny Llama, 8.0-8.3 s with spawn). What a worker receives is the same: the process object
and its ``WorkerSpec`` (the model included) are pickled and sent as under ``spawn``, and the
worker runs ``run_worker`` in a process of its own. The server CLI's tensor-parallel tests
(tests/server_tp, tests/engine/executor/test_tp_faults.py) start real ``paged-serve`` processes,
which spawn, and an engine on a model of more than ``MAX_SHARED_TENSORS`` tensors (the default
model) spawns. """

from __future__ import annotations

import multiprocessing
from types import SimpleNamespace

from paged_serve.engine.executor import workers
from paged_serve.engine.executor.rank import WorkerSpec

PRELOAD = ["torch", "transformers", "paged_serve.engine.executor.rank"]
# The forkserver sends a new process's file descriptors with it, at most 256, and torch shares
# each tensor of a pickled model as one: a model with more tensors starts with spawn.
MAX_SHARED_TENSORS = 200


def _tensors(spec: WorkerSpec) -> int:
    """How many tensors the spec's pickled model shares (0 when the rank loads its own)."""
    model = spec.model
    if model is None:
        return 0
    return sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())


def fork_tp_workers_from_a_preloaded_server() -> None:
    """Make ``paged_serve.engine.executor.workers`` start its ranks from the forkserver where their
    spec's model has at most ``MAX_SHARED_TENSORS`` tensors (once per process; the server itself
    starts at the first worker)."""
    if isinstance(workers.mp, SimpleNamespace):
        return
    original = workers.mp
    forkserver = multiprocessing.get_context("forkserver")
    forkserver.set_forkserver_preload(PRELOAD)
    spawn = original.get_context("spawn")

    def process(*, target, args, **kwargs):
        spec = args[0]
        context = forkserver if _tensors(spec) <= MAX_SHARED_TENSORS else spawn
        return context.Process(target=target, args=args, **kwargs)

    def get_context(method: str | None = None):
        if method != "spawn":
            return original.get_context(method)
        return SimpleNamespace(Pipe=spawn.Pipe, Process=process)

    workers.mp = SimpleNamespace(get_context=get_context, Process=original.Process)
