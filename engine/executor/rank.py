"""One tensor-parallel worker rank's process: load and shard its model, join the groups, then
run the driver's steps until SHUTDOWN (``run_worker``); ``python -m
paged_serve.engine.executor.rank`` starts a rank on another node (``main``). The driver's side is
``engine/executor/workers.py``.

A rank the driver spawned has a pipe to it: start-up status and its last error go up, and a
thread blocked reading it sees end-of-file when the driver is gone (even killed), so the rank
exits instead of lingering as an orphan. A rank started by hand has no pipe: it exits when a
collective fails (the driver's sockets close) or at SHUTDOWN.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from transformers import PreTrainedModel

from paged_serve.engine.config import EngineConfig
from paged_serve.engine.engine_args import add_engine_args, engine_kwargs
from paged_serve.engine.model.sharding import shard_model
from paged_serve.engine.parallel.group import TensorParallelGroup
from paged_serve.engine.platform.platform import platform_for
from paged_serve.engine.runner.build import build_runner, context_length, load_for
from paged_serve.engine.runner.step_message import SHUTDOWN, unpack_step


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker needs to build its rank: the engine config, its rank, where the groups
    meet, the driver's context length (None: derive it the driver's way), and the model to
    shard (None: load ``config.model`` itself)."""

    config: EngineConfig
    rank: int
    local_rank: int
    address: str
    port: int
    max_model_len: int | None
    model: PreTrainedModel | None


def _exit_when_driver_dies(pipe: Connection) -> None:
    """Exit as soon as the driver's end of ``pipe`` closes (the driver ended or was killed)."""

    def watch() -> None:
        try:
            while True:
                pipe.recv()
        except (EOFError, OSError):
            os._exit(1)

    threading.Thread(target=watch, name="driver-watch", daemon=True).start()


def run_worker(spec: WorkerSpec, pipe: Connection | None) -> None:
    """A worker rank's whole life: load and shard, join, then run steps until SHUTDOWN.

    Any failure is sent to the driver as ``("error", cause)`` (when there is a ``pipe``: a rank
    the driver spawned) and ends the process with exit code 1; the driver turns it into a
    TensorParallelError naming this rank.
    """
    log_format = f"%(levelname)s rank {spec.rank}: %(message)s"
    logging.basicConfig(level=logging.WARNING, format=log_format)
    if pipe is not None:
        _exit_when_driver_dies(pipe)
        # Ctrl-C reaches the whole process group: the driver shuts its workers down itself.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = spec.config
    world = config.tensor_parallel_size
    # cuda:LOCAL_RANK (its node's GPU) on CUDA, the CPU otherwise: made once, in this process
    platform = platform_for(config.device).rank_platform(spec.local_rank)
    platform.enter_rank(world)
    group = None

    def join() -> TensorParallelGroup:
        """Report the prepared shard to the driver, then join the groups."""
        nonlocal group
        if pipe is not None:
            pipe.send(("loaded", None))
        group = TensorParallelGroup.join(
            rank=spec.rank,
            world_size=world,
            address=spec.address,
            port=spec.port,
            platform=platform,
        )
        return group

    try:
        model = spec.model
        max_model_len = spec.max_model_len
        sharded = False
        if model is None:  # its own shard from the checkpoint's files, where they allow it
            loaded = load_for(config, platform, rank=spec.rank)
            model, sharded = loaded.model, loaded.shard is not None
            max_model_len = max_model_len or context_length(config, loaded.max_model_len)
        if not sharded:
            shard_model(model, rank=spec.rank, world_size=world)
        runner = build_runner(model, config, platform, max_model_len=max_model_len, group=join)
        while True:
            message = unpack_step(group.receive_packed_step())
            if message.kind == SHUTDOWN:
                break
            runner.run_worker_step(message)
    except BaseException as exc:
        logging.getLogger(__name__).error("rank %d failed:\n%s", spec.rank, traceback.format_exc())
        try:
            if pipe is not None:
                pipe.send(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        os._exit(1)
    if group is not None:
        group.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m paged_serve.engine.executor.rank [engine flags]``: one rank on another node.

    The rank comes from ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and the driver's address from
    ``MASTER_ADDR``/``MASTER_PORT``; the engine flags must be the driver's (``--model``,
    ``--max-model-len``, ``--kv-cache-memory``, ...), ``-tp`` defaulting to ``WORLD_SIZE``.
    """
    parser = argparse.ArgumentParser(
        prog="python -m paged_serve.engine.executor.rank", description=main.__doc__
    )
    add_engine_args(parser)
    args = parser.parse_args(argv)
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except KeyError as exc:
        parser.error(f"{exc.args[0]} must be set in the environment")
    if args.tensor_parallel_size == 1:
        args.tensor_parallel_size = world
    config = EngineConfig(model=args.model, **engine_kwargs(args))
    if config.tensor_parallel_size != world or not 0 < rank < world:
        parser.error(f"RANK {rank} of WORLD_SIZE {world} with -tp {config.tensor_parallel_size}")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    run_worker(WorkerSpec(config, rank, local_rank, address, port, None, None), None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
