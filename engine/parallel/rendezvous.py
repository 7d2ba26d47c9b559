"""Where a tensor-parallel engine's ranks meet, kept on the loopback interface when they all run
on this machine.

Two kinds of socket listen while the ranks run:

- the driver's **store** (a ``TCPStore``, unauthenticated: anyone who reaches it can read and
  write the rendezvous keys). Given ``tcp://host:port``, torch binds it to every interface
  whatever ``host`` says, so the driver binds a socket to ``host:port`` itself and hands torch
  its descriptor (``master_listen_fd``);
- each rank's **gloo pair listener**, on the device torch derives from the machine's hostname
  (often the LAN address), or from ``GLOO_SOCKET_IFNAME``. NCCL's bootstrap likewise follows
  ``NCCL_SOCKET_IFNAME``.

When the rendezvous address is a loopback one (the default, ``127.0.0.1``), both are pinned to
the loopback interface: the store's socket is bound there, and ``GLOO_SOCKET_IFNAME`` /
``NCCL_SOCKET_IFNAME`` are set to it for the group's life unless the user set them. An
explicit non-loopback ``MASTER_ADDR`` (multi-node) keeps torch's behaviour: the store listens on
every interface, which the other nodes need to reach it.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

logger = logging.getLogger(__name__)

DEFAULT_ADDRESS = "127.0.0.1"
SOCKET_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
IFF_LOOPBACK = 0x8  # <linux/if.h>


@dataclass(slots=True)
class Rendezvous:
    """The driver's rendezvous point: ``address:port``, and for a loopback address the store's
    socket, already bound there (holding it keeps the port ours until the store takes it)."""

    address: str
    port: int
    listener: socket.socket | None = None

    @classmethod
    def for_driver(cls) -> Rendezvous:
        """``MASTER_ADDR``/``MASTER_PORT`` when set (multi-node), else ``127.0.0.1`` and a free
        port; a loopback address gets its socket bound now."""
        address = os.environ.get("MASTER_ADDR", DEFAULT_ADDRESS)
        port = int(os.environ.get("MASTER_PORT", 0))
        if is_loopback(address):
            listener = bind_listener(address, port)
            return cls(address, listener.getsockname()[1], listener)
        if port == 0:
            with socket.socket() as probe:  # a free port here; the other nodes need it spelled
                probe.bind(("", 0))
                port = probe.getsockname()[1]
        return cls(address, port)

    def close(self) -> None:
        """Release the bound socket if the store never took it (idempotent)."""
        if self.listener is not None:
            self.listener.close()
            self.listener = None


def is_loopback(address: str) -> bool:
    """Whether every address ``address`` (an IP or a host name) resolves to is a loopback one."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def loopback_interface() -> str:
    """The name of this machine's loopback interface (``lo`` on Linux)."""
    for flags in sorted(Path("/sys/class/net").glob("*/flags")):
        try:
            if int(flags.read_text(), 16) & IFF_LOOPBACK:
                return flags.parent.name
        except (OSError, ValueError):
            continue
    return "lo"


def bind_listener(address: str, port: int) -> socket.socket:
    """A TCP socket bound to ``address:port`` (0: a free port), not yet listening."""
    family, kind, proto, _, where = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(where)
    except OSError:
        listener.close()
        raise
    return listener


def open_store(
    *,
    address: str,
    port: int,
    rank: int,
    world_size: int,
    timeout: datetime.timedelta,
    listener: socket.socket | None = None,
) -> dist.TCPStore:
    """The rendezvous store: rank 0 hosts it (on ``listener``, or on a socket bound to a loopback
    ``address`` here; on every interface for any other address), the others connect to it."""
    if rank != 0:
        return dist.TCPStore(address, port, world_size, False, timeout)
    if listener is None and is_loopback(address):
        listener = bind_listener(address, port)
    if listener is None:
        return dist.TCPStore(address, port, world_size, True, timeout, multi_tenant=True)
    # The store owns (and closes) the descriptor from here on.
    return dist.TCPStore(
        address, port, world_size, True, timeout, master_listen_fd=listener.detach()
    )


def pin_sockets_to_loopback() -> dict[str, str | None]:
    """Set ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` to the loopback interface where the
    user left them unset; returns what ``restore_environment`` needs to undo it."""
    interface = loopback_interface()
    previous: dict[str, str | None] = {}
    for name in SOCKET_INTERFACE_VARIABLES:
        if not os.environ.get(name):
            previous[name] = os.environ.get(name)
            os.environ[name] = interface
    return previous


def restore_environment(previous: dict[str, str | None]) -> None:
    """Undo ``pin_sockets_to_loopback``."""
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
