"""A tensor-parallel engine on one machine listens on the loopback interface only: the driver's
torch.distributed store (unauthenticated) and every rank's gloo pair sockets, even where the
machine's hostname resolves to a LAN address (gloo's default device follows the hostname).

Each engine runs in a child process (``tests/reliability/tp_listeners.py``), which reports the
sockets it and its workers listen on, read from ``/proc/net/tcp{,6}``. The hostname case runs
the child in a private mount namespace whose ``/etc/hosts`` maps the hostname to this machine's
first non-loopback IPv4 address (root only, and only where ``unshare`` works).
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from paged_serve.engine.parallel import rendezvous as tp_rendezvous
from paged_serve.engine.parallel.rendezvous import Rendezvous, is_loopback, pin_sockets_to_loopback
from tests.reliability.tp_listeners import listening_sockets

ROOT = Path(__file__).resolve().parents[2]
PROBE_TIMEOUT_S = 300
SIOCGIFADDR = 0x8915


def run_probe(prefix: list[str] | None = None) -> dict:
    """Run the TP=2 probe (under ``prefix``, e.g. an ``unshare`` shell) and return its report."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in (*tp_rendezvous.SOCKET_INTERFACE_VARIABLES, "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, "-m", "tests.reliability.tp_listeners"]
    done = subprocess.run(
        [*(prefix or []), *command],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_loopback_only(report: dict) -> None:
    listeners = report["listeners"]
    pids = {pid for _, _, pid in listeners}
    # The store and gloo's pair listeners: the driver and each worker listen on something, so
    # an empty list would mean the probe saw nothing, not that nothing was exposed.
    assert set(report["worker_pids"]) <= pids and len(pids) >= 2, listeners
    exposed = [s for s in listeners if not ipaddress.ip_address(s[0]).is_loopback]
    assert exposed == [], f"listening beyond loopback: {exposed}"


def test_a_tp_group_listens_on_loopback_only():
    report = run_probe()
    assert report["tokens"] == 4
    assert_loopback_only(report)
    assert report["gloo_socket_ifname"] == tp_rendezvous.loopback_interface()
    assert report["gloo_socket_ifname_after"] is None  # restored when the engine shut down


def non_loopback_ipv4() -> str | None:
    """This machine's first non-loopback IPv4 address (of an interface that is up), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode())
            try:
                packed = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)
            except OSError:
                continue
            address = ipaddress.ip_address(packed[20:24])
            if not address.is_loopback:
                return str(address)
    return None


def test_gloo_stays_on_loopback_where_the_hostname_resolves_to_a_lan_address(tmp_path):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a private /etc/hosts")
    lan = non_loopback_ipv4()
    if lan is None:
        pytest.skip("no non-loopback IPv4 address on this machine")
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{lan} {socket.gethostname()}\n")
    mounted = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount --bind {hosts} /etc/hosts && true"],
        capture_output=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"no private mount namespace here: {mounted.stderr.decode()[-200:]}")
    prefix = ["unshare", "-m", "sh", "-c", f'mount --bind {hosts} /etc/hosts && exec "$@"', "sh"]
    report = run_probe(prefix)
    assert report["hostname_address"] == lan  # gloo's default device would bind there
    assert_loopback_only(report)


# ------------------------------------------------------------------ the rendezvous itself
@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("::1", True),
        ("localhost", True),
        ("10.0.0.1", False),
        ("0.0.0.0", False),
        ("::", False),
    ],
)
def test_is_loopback(address, loopback):
    assert is_loopback(address) is loopback


def test_the_driver_binds_the_store_socket_to_loopback_before_spawning(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    rendezvous = Rendezvous.for_driver()
    try:
        assert rendezvous.listener is not None
        assert rendezvous.listener.getsockname() == ("127.0.0.1", rendezvous.port)
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("0.0.0.0", rendezvous.port))  # the port is held until the store takes it
    finally:
        rendezvous.close()
    assert rendezvous.listener is None


def test_a_multi_node_address_is_left_to_torch(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29511")
    rendezvous = Rendezvous.for_driver()
    assert (rendezvous.address, rendezvous.port, rendezvous.listener) == ("10.0.0.1", 29511, None)


def test_pinning_keeps_what_the_user_set_and_restores_the_rest(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    previous = pin_sockets_to_loopback()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
    assert os.environ["NCCL_SOCKET_IFNAME"] == tp_rendezvous.loopback_interface()
    tp_rendezvous.restore_environment(previous)
    assert "NCCL_SOCKET_IFNAME" not in os.environ and os.environ["GLOO_SOCKET_IFNAME"] == "eth7"


def test_the_socket_table_reader_sees_a_listener_and_its_address():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert ("127.0.0.1", port, os.getpid()) in listening_sockets({os.getpid()})
