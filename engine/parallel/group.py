"""A rank's view of the tensor-parallel process groups: the compute group and the step channel.

Two torch.distributed groups per engine:

- the **compute group** (the default group: NCCL on CUDA, gloo on CPU) carries the row-parallel
  all-reduces inside the forward, with ``COLLECTIVE_TIMEOUT`` so that a peer that hangs fails
  the step instead of hanging it forever (a peer that dies closes its sockets and fails it at
  once on gloo);
- the **step channel** (always gloo, on host memory) carries the driver's per-step message and
  the start-up agreements (KV block count, decode-graph capture). Workers wait on it between
  steps for as long as the engine idles, so its timeout is effectively unbounded; a worker
  learns that the driver died from its parent pipe instead (``engine/executor/rank.py``).

Both meet through the driver's store; for a loopback address every socket they listen on stays
on the loopback interface (``engine/parallel/rendezvous.py``).

A step goes out as one flat int64 array (the runner's packed step message,
engine/runner/step_message.py): one broadcast of ``FIRST_CHUNK`` entries (length first), plus a
second broadcast of the rest only when a step's metadata is larger (long prefills).
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from paged_serve.engine.parallel.rendezvous import (
    is_loopback,
    open_store,
    pin_sockets_to_loopback,
    restore_environment,
)
from paged_serve.engine.platform.platform import Platform

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)
IDLE_TIMEOUT = datetime.timedelta(days=3650)  # workers wait for the next step indefinitely
FIRST_CHUNK = 2048  # int64 entries (16 KiB): a decode step of dozens of sequences fits


@dataclass(slots=True)
class TensorParallelGroup:
    """This process's rank in the tensor-parallel groups (rank 0 is the driver)."""

    rank: int
    world_size: int
    step_channel: object  # a gloo ProcessGroup
    _first: torch.Tensor
    closed: bool = False
    _pinned_environment: dict[str, str | None] = field(default_factory=dict)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @classmethod
    def join(
        cls,
        *,
        rank: int,
        world_size: int,
        address: str,
        port: int,
        platform: Platform,
        listener: socket.socket | None = None,
    ) -> TensorParallelGroup:
        """Join (rank 0: host) the process groups at ``address:port``; blocks until every rank
        has joined or ``COLLECTIVE_TIMEOUT`` passed. A loopback ``address`` keeps every socket
        of the groups on the loopback interface (``engine/parallel/rendezvous.py``); rank 0 hosts
        the store on ``listener`` when given (a socket bound to ``address:port``; the store
        takes it over). ``platform``: this rank's, at its own device (``cuda:r``), which
        chooses the compute group's communicator."""
        if dist.is_initialized():
            raise RuntimeError(
                "a tensor-parallel engine already runs in this process: shut it down first"
            )
        backend = platform.communicator
        pinned = pin_sockets_to_loopback() if is_loopback(address) else {}
        try:
            store = open_store(
                address=address,
                port=port,
                rank=rank,
                world_size=world_size,
                timeout=COLLECTIVE_TIMEOUT,
                listener=listener,
            )
            dist.init_process_group(
                backend,
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=COLLECTIVE_TIMEOUT,
                **platform.group_options(),
            )
            channel = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        except BaseException:
            if dist.is_initialized():
                dist.destroy_process_group()
            restore_environment(pinned)
            raise
        first = torch.zeros(FIRST_CHUNK, dtype=torch.int64)
        return cls(rank, world_size, channel, first, _pinned_environment=pinned)

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` any rank passed (every rank must call it)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.step_channel)
        return int(t.item())

    def all_ranks(self, flag: bool) -> bool:
        """True when every rank passed True (every rank must call it)."""
        return bool(self.min_over_ranks(int(flag)))

    def send_packed_step(self, packed: torch.Tensor) -> None:
        """Driver: broadcast a packed step message (1-D int64, on the CPU) to the workers."""
        n = packed.numel()
        head = min(n, FIRST_CHUNK - 1)
        first = self._first
        first[0] = n
        first[1 : 1 + head] = packed[:head]
        dist.broadcast(first, src=0, group=self.step_channel)
        if n > head:
            dist.broadcast(packed[head:].contiguous(), src=0, group=self.step_channel)

    def receive_packed_step(self) -> torch.Tensor:
        """Worker: wait for the driver's next packed step message (1-D int64)."""
        first = self._first
        dist.broadcast(first, src=0, group=self.step_channel)
        n = int(first[0])
        head = min(n, FIRST_CHUNK - 1)
        packed = first[1 : 1 + head].clone()
        if n > head:
            rest = torch.empty(n - head, dtype=torch.int64)
            dist.broadcast(rest, src=0, group=self.step_channel)
            packed = torch.cat([packed, rest])
        return packed

    def close(self) -> None:
        """Leave the groups (idempotent); the process may then join another engine's."""
        if not self.closed and dist.is_initialized():
            dist.destroy_process_group()
        if not self.closed:
            restore_environment(self._pinned_environment)
        self.closed = True
