"""TCPStore servers that listen on one address, and the local addresses of this machine.

torch's TCPStore server binds every interface (`*:PORT`) whatever host name it is given
(measured on torch 2.13, with and without libuv: a single-node run's two stores were
reachable from another network namespace). It does accept a socket that is already
listening (`master_listen_fd`), so meshfit binds that socket itself, to the one address
the store is meant for: 127.0.0.1 on a single node, node 0's own address otherwise.
"""

from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta

import torch.distributed as dist


def is_loopback(host: str) -> bool:
    """True for localhost, 127.0.0.0/8 and ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def own_address(host: str) -> str | None:
    """The address of `host` that belongs to this machine, or None.

    An address is ours when a socket can bind to it; unlike matching host names (torch's
    `_matches_machine_hostname`), this holds inside a container or network namespace
    whose host name resolves to some other address.
    """
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return None
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((sockaddr[0], 0))
            except OSError:
                continue
            return sockaddr[0]
    return None


def address_towards(host: str, port: int) -> str | None:
    """This machine's address on the route to `host` (no packet is sent), or None."""
    try:
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_UDP)
    except (socket.gaierror, UnicodeError):
        return None
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect(sockaddr)
            except OSError:
                continue
            return probe.getsockname()[0]
    return None


def serve_store(address: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A TCPStore server (multi-tenant) that listens on `address` only.

    Raises OSError when the address is not ours or the port is taken.
    """
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(socket.SOMAXCONN)
        # libuv explicitly: the older backend, given a listening fd, never answered a
        # client on torch 2.13 (the client timed out after 5 s; libuv answered at once).
        store = dist.TCPStore(
            address,
            listener.getsockname()[1],
            is_master=True,
            multi_tenant=True,
            timeout=timeout,
            master_listen_fd=listener.fileno(),
            use_libuv=True,
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the descriptor from now on
    return store
