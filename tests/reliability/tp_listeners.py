"""The listening TCP sockets of a process tree, read from ``/proc``; run as a module, the ones a
tensor-parallel engine (TP=2, gloo, a tiny model) opens.

``python -m tests.reliability.tp_listeners`` starts the engine, runs one request (so every gloo
pair is connected), and prints one JSON line: where this machine's hostname resolves (what
gloo's default device binds to), ``GLOO_SOCKET_IFNAME`` while the engine runs, and every socket
that this process and its descendants listen on (address, port, pid).
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
from pathlib import Path

LISTEN = "0A"  # the state column of /proc/net/tcp


def descendants(root: int) -> set[int]:
    """``root`` and every process below it."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    tree, grew = {root}, True
    while grew:
        below = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= below
        grew = bool(below)
    return tree


def _socket_inodes(pids: set[int]) -> dict[str, int]:
    inodes = {}
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes[target[len("socket:[") : -1]] = pid
    return inodes


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)  # 32-bit words in host (little-endian) order
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def listening_sockets(pids: set[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket (v4 and v6) that one of ``pids`` listens on."""
    inodes = _socket_inodes(pids)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == LISTEN and inode in inodes:
                host, port = local.rsplit(":", 1)
                found.append((_address(host), int(port, 16), inodes[inode]))
    return found


def main() -> None:
    from paged_serve.engine import LLM, SamplingParams
    from tests.conftest import loaded, tiny_model

    try:
        hostname_address = socket.gethostbyname(socket.gethostname())
    except OSError:
        hostname_address = None
    llm = LLM(loaded=loaded(tiny_model("llama")), tensor_parallel_size=2, kv_cache_memory=4 << 20)
    try:
        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        [result] = llm.generate([[1, 2, 3]], greedy)
        report = {
            "hostname_address": hostname_address,
            "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
            "worker_pids": sorted(llm.engine.tp.worker_pids.values()),
            "tokens": len(result.token_ids),
            "listeners": listening_sockets(descendants(os.getpid())),
        }
    finally:
        llm.shutdown()
    report["gloo_socket_ifname_after"] = os.environ.get("GLOO_SOCKET_IFNAME")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
