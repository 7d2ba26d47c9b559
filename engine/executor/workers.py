"""The driver's handle on its tensor-parallel workers: start them, watch them, stop them.

Process layout (rank 0 is the engine process itself, the *driver*)::

    driver (rank 0)                                  worker (rank r, spawned)
    ------------------------------------------       ---------------------------------------
    load rank 0's shard (or the whole model,
      checked to shard: ValueError)
    spawn ranks 1..N-1 (pipe + process each)  --->   load rank r's shard (or the whole model,
                                                       or unpickle the driver's)
    shard a whole copy                               shard a whole copy; move to cuda:r
    wait for every "loaded" (or an error)     <---   "loaded" (or "error", cause) on the pipe
    join the process groups                   <-->   join the process groups
    ModelRunner: min KV budget over ranks     <-->   ModelRunner: the same agreements
    per step: broadcast the step message      --->   run the same body forward (no LM head)
    shutdown: broadcast SHUTDOWN, join        --->   leave the groups, exit 0

The worker side is ``engine/executor/rank.py``. The pipe does three jobs: start-up status, a
worker's
last error (its cause, for the driver's message), and the driver's liveness (end-of-file tells a
worker that the driver is gone). The driver notices a dead worker before each step (process
sentinels) or through the failed collective.

Multi-node: with ``LOCAL_WORLD_SIZE=L`` the driver spawns ranks 1..L-1 only; ranks L..N-1 are
started on other nodes with ``python -m paged_serve.engine.executor.rank`` (the engine flags, plus
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` in the environment). Such
a rank has no pipe: it learns that the driver is gone when a collective fails.
"""

from __future__ import annotations

import logging
import os
import signal
from multiprocessing.connection import Connection, wait

import torch.multiprocessing as mp
from transformers import PreTrainedModel

from paged_serve.engine.config import EngineConfig
from paged_serve.engine.executor.rank import WorkerSpec, run_worker
from paged_serve.engine.model.sharding import (
    check_shardable,
    plain_projections,
    shard_model,
    shard_shape,
)
from paged_serve.engine.parallel.group import TensorParallelGroup
from paged_serve.engine.parallel.rendezvous import Rendezvous
from paged_serve.engine.platform.platform import Platform
from paged_serve.engine.runner.step_message import StepMessage, pack_step

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading a large model from disk can take minutes
JOIN_TIMEOUT_S = 10.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed (at start-up or in a step); the message names it."""


def local_world_size(world_size: int) -> int:
    """Ranks on this node: ``LOCAL_WORLD_SIZE`` when set (multi-node), else all of them."""
    return max(1, min(world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


class TensorParallelWorkers:
    """The driver's handle on its worker processes and the process groups."""

    def __init__(self, processes: dict[int, mp.Process], pipes: dict[int, Connection]):
        self.processes = processes
        self.pipes = pipes
        self.group: TensorParallelGroup | None = None
        self.errors: dict[int, str] = {}
        self.failed = False
        self._failure: TensorParallelError | None = None

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        model: PreTrainedModel,
        platform: Platform,
        *,
        max_model_len: int,
        share_model: bool,
        sharded: bool = False,
    ) -> TensorParallelWorkers:
        """Spawn ranks 1..N-1, shard ``model`` in place for rank 0 (unless ``sharded``: it was
        loaded as rank 0's shard) and join the groups; ``platform`` is the engine's.

        share_model: send the driver's (unsharded) model to the workers instead of having each
        load ``config.model`` (an in-memory model has no path to load from).
        Raises ValueError when the model does not shard N ways, TensorParallelError naming the
        rank and cause when a worker fails to start.
        """
        world = config.tensor_parallel_size
        if sharded and share_model:
            raise ValueError("a model loaded as rank 0's shard cannot be sent to the other ranks")
        shard_shape(model.config.get_text_config(), world)  # refuse before any process starts
        if not sharded:  # a loaded shard was checked before it was read
            plain_projections(model)  # a model prepared for one device: its original projections
            check_shardable(model, world)
        # A loopback rendezvous binds the store's socket now: the port is ours from here on.
        rendezvous = Rendezvous.for_driver()
        try:
            return cls._start(
                config, model, platform, rendezvous, max_model_len, share_model, sharded
            )
        finally:
            rendezvous.close()  # a no-op once the store has taken the descriptor

    @classmethod
    def _start(
        cls,
        config: EngineConfig,
        model: PreTrainedModel,
        platform: Platform,
        rendezvous: Rendezvous,
        max_model_len: int,
        share_model: bool,
        sharded: bool,
    ) -> TensorParallelWorkers:
        world = config.tensor_parallel_size
        address, port = rendezvous.address, rendezvous.port
        ctx = mp.get_context("spawn")
        processes, pipes = {}, {}
        local = local_world_size(world)
        if local < world:
            remote = (local, world - 1, address, port)
            logger.info("ranks %d..%d join from other nodes at %s:%d", *remote)
        for rank in range(1, local):
            shared = model if share_model else None
            spec = WorkerSpec(config, rank, rank, address, port, max_model_len, shared)
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=run_worker, args=(spec, theirs), name=f"paged-serve-tp{rank}", daemon=True
            )
            proc.start()
            theirs.close()
            processes[rank], pipes[rank] = proc, ours
            logger.info("tensor-parallel rank %d started (pid %d)", rank, proc.pid)
        workers = cls(processes, pipes)
        try:
            # cuda:0, with its index (NCCL's device_id)
            own = platform.rank_platform(0)
            if not sharded:
                shard_model(model, rank=0, world_size=world)
            model.to(own.device)
            workers._wait_loaded()
            workers.group = TensorParallelGroup.join(
                rank=0,
                world_size=world,
                address=address,
                port=port,
                platform=own,
                listener=rendezvous.listener,  # the store takes its descriptor over
            )
        except BaseException:
            workers.close()
            raise
        return workers

    @property
    def worker_pids(self) -> dict[int, int]:
        return {rank: p.pid for rank, p in self.processes.items()}

    def _wait_loaded(self) -> None:
        """Block until every worker reports its shard loaded; raise for the first that fails."""
        pending = dict(self.pipes)
        sentinels = {self.processes[r].sentinel: r for r in pending}
        while pending:
            ready = wait([*pending.values(), *sentinels], timeout=START_TIMEOUT_S)
            if not ready:
                raise TensorParallelError(
                    f"tensor-parallel ranks {sorted(pending)} did not load the model in "
                    f"{START_TIMEOUT_S:.0f} s"
                )
            for rank, pipe in list(pending.items()):
                if pipe in ready or self.processes[rank].sentinel in ready:
                    status = self._read(rank)
                    if status != "loaded":
                        raise TensorParallelError(self._cause(rank, "at start-up"))
                    del pending[rank]

    def _read(self, rank: int) -> str | None:
        """The next status a worker sent (recording an error's cause); None at end of file."""
        try:
            kind, detail = self.pipes[rank].recv()
        except (EOFError, OSError):
            return None
        if kind == "error":
            self.errors[rank] = detail
        return kind

    def _cause(self, rank: int, when: str) -> str:
        proc = self.processes[rank]
        proc.join(JOIN_TIMEOUT_S if rank in self.errors else 1.0)
        while rank not in self.errors and self.pipes[rank].poll() and self._read(rank):
            pass
        cause = self.errors.get(rank) or describe_exit(proc.exitcode)
        return f"tensor-parallel rank {rank} (pid {proc.pid}) failed {when}: {cause}"

    def alive(self) -> bool:
        """Every worker process is running."""
        return not self.failed and all(p.is_alive() for p in self.processes.values())

    def check(self) -> None:
        """Raise TensorParallelError if a worker has died (before a step's broadcast)."""
        if self.failed or not self.alive():
            raise self.failure(None)

    def failure(self, exc: BaseException | None) -> TensorParallelError:
        """The error for a failed collective or a dead worker, naming the rank and its cause;
        the remaining workers are stopped (the group cannot go on without one rank)."""
        if self._failure is not None:
            return self._failure
        self.failed = True
        dead = [r for r, p in self.processes.items() if not p.is_alive() or self.pipes[r].poll()]
        if not dead:
            for proc in self.processes.values():  # a worker may still be exiting
                proc.join(1.0)
            dead = [r for r, p in self.processes.items() if not p.is_alive()]
        causes = [self._cause(r, "during a step") for r in dead]
        self.close()
        message = "; ".join(causes) or f"tensor-parallel step failed: {exc}"
        self._failure = TensorParallelError(message)
        return self._failure

    def close(self) -> None:
        """Stop the workers (asking politely when the group is healthy) and leave the groups.
        Idempotent; no worker process outlives it."""
        group = self.group
        if group is not None and not group.closed and not self.failed and self.alive():
            try:
                group.send_packed_step(pack_step(StepMessage.shutdown()))
            except RuntimeError:
                logger.warning("tensor-parallel shutdown message failed: stopping the workers")
        for proc in self.processes.values():
            proc.join(JOIN_TIMEOUT_S if group is not None and not self.failed else 0.0)
            if proc.is_alive():
                proc.kill()
                proc.join(JOIN_TIMEOUT_S)
        for pipe in self.pipes.values():
            pipe.close()
        if group is not None:
            group.close()
