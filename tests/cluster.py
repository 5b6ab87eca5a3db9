"""Several "hosts" on one machine: network namespaces on a Linux bridge, optionally with
shaped links (tc tbf), each running one command; always torn down.

    with Cluster(2, rate="100mbit") as cluster:
        results = cluster.run([argv_for_host0, argv_for_host1], env=env, timeout=300)

Each host is a network namespace `<prefix>h<i>` with loopback up and one interface,
`eth0`, addressed 10.232.0.<i+1>/24 (a private range that exists only inside these
namespaces). The other end of each `eth0` is a port of the bridge `br0` in the namespace
`<prefix>br`; a `rate` shapes both directions of every host's link with a token bucket
filter (`tc qdisc ... tbf`; this kernel has no netem). The prefix is unique per Cluster
(the pid and a counter) so concurrent test runs do not collide.

Needs root and iproute2; `cluster_unavailable()` says why not, and `Cluster(...)` raises
ClusterUnavailable with that reason (or the failing command's own message).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SUBNET = "10.232.0"
DEV = "eth0"  # every host's interface towards the others
_counter = itertools.count()


class ClusterUnavailable(RuntimeError):
    """The test bed cannot be built on this machine (the message says why)."""


def cluster_unavailable() -> str | None:
    """Why namespaces cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs the ip command (iproute2)"
    return None


@dataclass(frozen=True)
class Host:
    index: int
    ns: str
    addr: str
    dev: str = DEV

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def counters(self, dev: str | None = None) -> dict[str, int]:
        """rx_bytes/tx_bytes of `dev` (this host's eth0 by default), or of "lo"."""
        out = subprocess.run(
            ["ip", "-n", self.ns, "-j", "-s", "link", "show", "dev", dev or self.dev],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        stats = json.loads(out)[0]["stats64"]
        return {"rx_bytes": stats["rx"]["bytes"], "tx_bytes": stats["tx"]["bytes"]}


@dataclass(frozen=True)
class HostResult:
    host: Host
    returncode: int
    stdout: str
    stderr: str

    def tail(self, chars: int = 3000) -> str:
        return (
            f"--- host {self.host.index} ({self.host.ns}) rc={self.returncode}\n"
            + (self.stderr[-chars:])
        )


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise ClusterUnavailable(f"ip {' '.join(args)} failed: {result.stderr.strip()}")


class Cluster:
    """`n` hosts on one bridge; a context manager (teardown on any exit, Ctrl-C too)."""

    def __init__(
        self,
        n: int,
        rate: str | None = None,
        burst: str = "256kb",
        latency: str = "50ms",
        extra: int = 0,
    ):
        """`rate` (tc's units: "100mbit", "1gbit") shapes each host's link both ways;
        `extra` more namespaces are attached to the same bridge but not counted in
        `hosts` (an intruder's, say): `self.outsiders`."""
        self.prefix = f"mfc{os.getpid() % 100000}x{next(_counter)}"
        self.bridge_ns = f"{self.prefix}br"
        every = [Host(i, f"{self.prefix}h{i}", f"{SUBNET}.{i + 1}") for i in range(n + extra)]
        self.hosts, self.outsiders = every[:n], every[n:]
        self.rate, self.burst, self.latency = rate, burst, latency
        self._made: list[str] = []

    # ---- building and tearing down ------------------------------------------------

    def __enter__(self) -> Cluster:
        reason = cluster_unavailable()
        if reason:
            raise ClusterUnavailable(reason)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def _build(self) -> None:
        self._add_ns(self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for host in [*self.hosts, *self.outsiders]:
            self._add_ns(host.ns)
            port = f"p{host.index}"
            # Created straight into the two namespaces: no name is ever taken in the
            # machine's own namespace, so the names can be short and fixed.
            _ip(
                "link", "add", host.dev, "netns", host.ns, "type", "veth",
                "peer", "name", port, "netns", self.bridge_ns,
            )  # fmt: skip
            _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0")
            _ip("-n", self.bridge_ns, "link", "set", port, "up")
            _ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", host.dev)
            _ip("-n", host.ns, "link", "set", "lo", "up")
            _ip("-n", host.ns, "link", "set", host.dev, "up")
            if self.rate:
                # Egress of both ends: what the host sends and what it receives.
                for ns, dev in ((host.ns, host.dev), (self.bridge_ns, port)):
                    self._shape(ns, dev)

    def _shape(self, ns: str, dev: str) -> None:
        result = subprocess.run(
            ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
             "rate", str(self.rate), "burst", self.burst, "latency", self.latency],
            capture_output=True,
            text=True,
        )  # fmt: skip
        if result.returncode != 0:
            raise ClusterUnavailable(f"tc tbf on {dev} failed: {result.stderr.strip()}")

    def close(self) -> None:
        """Kill what still runs in the namespaces, then delete them (which deletes their
        interfaces). Safe to call twice."""
        for ns in reversed(self._made):
            self._kill_all(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()

    def kill_host(self, host: Host) -> None:
        """SIGKILL every process in `host`'s namespace: the host dies, its links stay."""
        self._kill_all(host.ns)

    def cut_link(self, host: Host) -> None:
        """Take `host`'s bridge port down: its processes live on, but no packet reaches
        or leaves it (as a failed switch port or a partitioned node)."""
        _ip("-n", self.bridge_ns, "link", "set", f"p{host.index}", "down")

    @staticmethod
    def _kill_all(ns: str) -> None:
        for _ in range(50):
            pids = subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True
            ).stdout.split()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.1)

    # ---- running ----------------------------------------------------------------------

    def start(
        self, host: Host, argv: Sequence[str], env: Mapping[str, str]
    ) -> subprocess.Popen[str]:
        return subprocess.Popen(
            host.wrap(argv),
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def run(
        self,
        argvs: Sequence[Sequence[str]],
        env: Mapping[str, str] | Sequence[Mapping[str, str]],
        timeout: float = 300,
        stagger: float = 1.0,
    ) -> list[HostResult]:
        """Run argvs[i] on host i (host 0 first, the next `stagger` seconds later, as a
        cluster starts node 0 first); wait for all; every host's output and exit code.
        A host still running after `timeout` seconds is killed (its rc is then < 0)."""
        envs = [env] * len(argvs) if isinstance(env, Mapping) else list(env)
        procs: list[subprocess.Popen[str]] = []
        try:
            for host, argv, host_env in zip(self.hosts, argvs, envs, strict=True):
                procs.append(self.start(host, argv, host_env))
                time.sleep(stagger)
            deadline = time.monotonic() + timeout
            results = []
            for host, proc in zip(self.hosts, procs, strict=False):
                try:
                    out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self._kill_all(host.ns)
                    proc.kill()
                    out, err = proc.communicate()
                    err += f"\n[cluster: killed after {timeout} s]"
                results.append(HostResult(host, proc.returncode, out, err))
            return results
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
