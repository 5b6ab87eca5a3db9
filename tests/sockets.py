"""Listening TCP sockets of a process tree, read from /proc (Linux), and two network
namespaces on tests/cluster.py's bridge: two 'hosts' on one machine."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

from cluster import Cluster, cluster_unavailable

LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


def process_tree(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
    tree, grew = {root}, True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= children
        grew = bool(children)
    return tree


def _socket_inodes(pids: set[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[len("socket:[") : -1])
    return inodes


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_addr)
    # /proc prints each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def listening_sockets(root: int) -> set[tuple[str, int]]:
    """(address, port) of every socket the tree of `root` listens on."""
    pids = process_tree(root)
    inodes = _socket_inodes(pids)
    found = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{root}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == LISTEN and fields[9] in inodes:
                    addr, port = fields[1].split(":")
                    found.add((str(_address(addr)), int(port, 16)))
    return found


def is_loopback(address: str) -> bool:
    addr = ipaddress.ip_address(address)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def watch_listening(proc: subprocess.Popen, timeout: float) -> set[tuple[str, int]]:
    """Every listening socket seen in `proc`'s tree until it exits (polled every 0.1 s)."""
    seen: set[tuple[str, int]] = set()
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"{proc.args} still running after {timeout} s")
        seen |= listening_sockets(proc.pid)
        time.sleep(0.1)
    return seen


@dataclass(frozen=True)
class TwoHosts:
    run_ns: str  # where the run goes
    stranger_ns: str
    run_addr: str
    stranger_addr: str
    run_dev: str  # each host's interface, for GLOO_SOCKET_IFNAME
    stranger_dev: str

    def in_run_host(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.run_ns, *argv]

    def in_stranger_host(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.stranger_ns, *argv]


def netns_unavailable() -> str | None:
    """Why the two-host test bed cannot be built here, or None."""
    return cluster_unavailable()


@contextlib.contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    """A run's host and a stranger's on one bridge (tests/cluster.py, torn down on exit).
    Raises ClusterUnavailable when namespaces cannot be built."""
    with Cluster(1, extra=1) as cluster:
        run, stranger = cluster.hosts[0], cluster.outsiders[0]
        yield TwoHosts(run.ns, stranger.ns, run.addr, stranger.addr, run.dev, stranger.dev)
