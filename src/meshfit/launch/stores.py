"""TCPStore servers that listen on one address, and the local addresses of this machine.

torch's TCPStore server binds every interface (`*:PORT`) whatever host name it is given
(measured on torch 2.13, with and without libuv: a single-node run's two stores were
reachable from another network namespace). It does accept a socket that is already
listening (`master_listen_fd`), so meshfit binds that socket itself, to the one address
the store is meant for: 127.0.0.1 on a single node, node 0's own address otherwise.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct
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


_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def _ipv4_of(ifname: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(
                probe.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15])
            )
        except OSError:  # no IPv4 address on it
            return None
    return socket.inet_ntoa(packed[20:24])


def _ipv6_interfaces() -> dict[str, str]:
    """IPv6 address -> interface, from /proc/net/if_inet6 (Linux)."""
    found: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6:
                found[str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))] = fields[5]
    return found


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds `address`, or None."""
    try:
        addr = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is None:
            return _ipv6_interfaces().get(str(addr))
        addr = addr.ipv4_mapped
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == str(addr):
            return name
    return None


def interface_towards(host: str, port: int) -> tuple[str, str] | None:
    """(interface, local address) this machine reaches `host` from, or None when `host`
    does not resolve or no route leads there. The interface is the one holding the
    route's source address: towards one of our own addresses the route goes through
    lo, but peers on other hosts reach us at that address's own interface."""
    local = address_towards(host, port)
    if local is None:
        return None
    name = interface_of(local)
    return None if name is None else (name, local)


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
