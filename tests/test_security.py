"""Issue 22: a single-node run listens on loopback only; a stranger's bytes in the
rendezvous store are never unpickled; a node with another secret, or one that cannot
reach node 0, stops with one meshfit line; restarts still resume exactly.

The two-host tests build two network namespaces on a bridge (tests/cluster.py)
and skip when that needs what this machine lacks (root, the ip command)."""

from __future__ import annotations

import base64
import os
import pickle
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import sockets
import torch
from cluster import ClusterUnavailable
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _BackendRendezvousStateHolder,
)
from workers import fit_killed_once

import meshfit as mf
from meshfit.launch import rendezvous

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")
SECRET = "test-secret-0123456789abcdef0123"
TINY_DEMO = ["--steps", "2", "--layers", "1", "--width", "32", "--heads", "2"]
TINY_DEMO += ["--data-bytes", "100000", "--sample-bytes", "8"]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop(rendezvous.SECRET_ENV, None)
    return {**env, **extra}


def _meshfit(*args: str) -> list[str]:
    return [sys.executable, "-m", "meshfit.cli", *args]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _meshfit_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("meshfit: error:")]


class _Payload:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


# ---- the signed backend, in one process -------------------------------------------------


def _state_holder(backend) -> _BackendRendezvousStateHolder:
    settings = RendezvousSettings("run", 1, 1, RendezvousTimeout(), timedelta(seconds=5), 3)
    return _BackendRendezvousStateHolder(backend, settings, cache_duration=0)


@pytest.mark.parametrize("signed", [True, False], ids=["meshfit", "c10d-control"])
def test_foreign_rendezvous_state_is_refused_before_unpickling(tmp_path, signed) -> None:
    """The pickle torch's state holder would load is written where the rendezvous state
    lives. meshfit's backend refuses it; torch's own backend (the control) runs it,
    which shows the payload is live."""
    store = torch.distributed.HashStore()
    plain = C10dRendezvousBackend(store, "run")
    backend = rendezvous.SignedBackend(plain, SECRET.encode(), "run", "here") if signed else plain
    holder = _state_holder(backend)
    holder.mark_dirty()
    holder.sync()  # a real state, signed when signed
    marker = tmp_path / "ran"
    store.set("torch.rendezvous.run", base64.b64encode(pickle.dumps(_Payload(str(marker)))))
    if signed:
        with pytest.raises(rendezvous.ForeignRendezvousState, match="not signed"):
            holder.sync()
        assert not marker.exists()
    else:
        with pytest.raises(AttributeError):  # os.system's int is not a state
            holder.sync()
        assert marker.exists()


def test_signed_state_round_trips_and_another_secret_is_refused() -> None:
    store = torch.distributed.HashStore()
    ours = rendezvous.SignedBackend(C10dRendezvousBackend(store, "r"), b"a" * 32, "r", "x")
    theirs = rendezvous.SignedBackend(C10dRendezvousBackend(store, "r"), b"b" * 32, "r", "x")
    state, token, has_set = ours.set_state(b"state")
    assert (state, has_set) == (b"state", True)
    assert ours.get_state() == (b"state", token)
    with pytest.raises(rendezvous.ForeignRendezvousState):
        theirs.get_state()


def test_run_id_is_derived_from_the_secret() -> None:
    a, b = rendezvous.run_id(b"a" * 32), rendezvous.run_id(b"b" * 32)
    assert a != b and a == rendezvous.run_id(b"a" * 32) and len(a) > 30


# ---- one machine: nothing listens outside loopback -----------------------------------------


@pytest.mark.parametrize(
    "how",
    [
        pytest.param("run", marks=pytest.mark.slow),
        pytest.param("demo", marks=pytest.mark.slow),
        "launch",
    ],
)
def test_single_node_run_listens_on_loopback_only(how) -> None:
    if how == "run":
        argv = _meshfit("run", "--nproc", "2", os.path.join(SCRIPTS, "hold.py"))
    elif how == "demo":
        argv = _meshfit("demo", "--nproc", "2", *TINY_DEMO)
    else:
        code = "import meshfit as mf, workers; mf.launch(workers.hold, nproc=2, args=(2,))"
        argv = [sys.executable, "-c", code]
    proc = subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = sockets.watch_listening(proc, timeout=180)
    out, err = proc.communicate()
    assert proc.returncode == 0, err.decode()[-3000:]
    # The stores and gloo's sockets were seen (the check can see a listener at all) ...
    assert len(seen) >= 3, seen
    # ... and every one of them was on loopback.
    assert all(sockets.is_loopback(addr) for addr, _ in seen), seen


# ---- two hosts: a stranger in another network namespace ------------------------------------


@pytest.fixture
def hosts():
    reason = sockets.netns_unavailable()
    if reason:
        pytest.skip(reason)
    try:
        with sockets.two_hosts() as two:
            yield two
    except ClusterUnavailable as exc:
        pytest.skip(f"cannot build network namespaces here: {exc}")


def _stranger(hosts, port: int, marker, keys: list[str], seconds: float = 4):
    argv = [sys.executable, os.path.join(SCRIPTS, "stranger.py"), hosts.run_addr, str(port)]
    return subprocess.run(
        hosts.in_stranger_host([*argv, str(marker), str(seconds), *keys]),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow
def test_stranger_cannot_reach_a_single_node_run(hosts) -> None:
    argv = _meshfit("run", "--nproc", "2", os.path.join(SCRIPTS, "hold.py"))
    run = subprocess.Popen(
        hosts.in_run_host(argv), env=_env(HOLD_S="6"), stdout=subprocess.PIPE, text=True
    )
    try:
        seen: set[tuple[str, int]] = set()
        deadline = time.monotonic() + 120
        while len(seen) < 4 and run.poll() is None and time.monotonic() < deadline:
            seen |= sockets.listening_sockets(run.pid)  # 2 stores + 2 gloo workers
            time.sleep(0.2)
        assert len(seen) >= 4, seen
        probe = (
            "import socket, sys\n"
            "for port in map(int, sys.argv[2:]):\n"
            "    try: socket.create_connection((sys.argv[1], port), timeout=3).close()\n"
            "    except OSError: continue\n"
            "    print('reached', port)\n"
        )
        ports = [str(port) for _, port in seen]
        reach = subprocess.run(
            hosts.in_stranger_host([sys.executable, "-c", probe, hosts.run_addr, *ports]),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert reach.returncode == 0, reach.stderr
        assert reach.stdout == "", f"a stranger reached the run: {reach.stdout}"
    finally:
        run.communicate(timeout=120)
    assert run.returncode == 0


def _node0(hosts, port: int, hold_s: str) -> subprocess.Popen:
    """Node 0 of the elastic multi-node path, on the run host's own address, in a
    namespace where the host name resolves elsewhere (to 127.0.0.1)."""
    argv = _meshfit("run", "--nnodes", "1", "--master", f"{hosts.run_addr}:{port}", "--nproc", "2")
    return subprocess.Popen(
        hosts.in_run_host([*argv, os.path.join(SCRIPTS, "hold.py")]),
        env=_env(HOLD_S=hold_s, MESHFIT_RUN_SECRET=SECRET),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
@pytest.mark.alone  # the stranger comes 5 s after the run starts
def test_stranger_attack_runs_no_code_and_the_run_finishes(hosts, tmp_path) -> None:
    """The issue's attack: a pickle under the known key torch.rendezvous.meshfit (and
    the c10d default's guesses). The run's key is derived from its secret, so the
    writes land beside it and the run finishes; node 0 hosts its rendezvous although
    its host name does not resolve to --master's address."""
    port, marker = _free_port(), tmp_path / "stranger-ran-code"
    run = _node0(hosts, port, hold_s="8")
    try:
        time.sleep(5)
        keys = ["torch.rendezvous.meshfit", "torch.rendezvous.none", "torch.rendezvous."]
        stranger = _stranger(hosts, port, marker, keys)
        assert stranger.returncode == 0, stranger.stderr[-2000:]  # it did connect and write
    finally:
        out, err = run.communicate(timeout=180)
    assert run.returncode == 0, err[-3000:]
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.alone  # the stranger comes 5 s after the run starts
def test_stranger_who_knows_the_key_stops_the_run_with_one_line(hosts, tmp_path) -> None:
    port, marker = _free_port(), tmp_path / "stranger-ran-code"
    run = _node0(hosts, port, hold_s="30")
    try:
        time.sleep(5)
        key = "torch.rendezvous." + rendezvous.run_id(SECRET.encode())
        _stranger(hosts, port, marker, [key])
    finally:
        out, err = run.communicate(timeout=180)
    assert run.returncode == 2, err[-3000:]
    lines = _meshfit_lines(err)
    assert len(lines) == 1 and "not signed with this run's secret" in lines[0], err[-3000:]
    assert "Traceback" not in err
    assert not marker.exists()


@pytest.mark.slow
def test_two_hosts_with_the_secret_train_together(hosts, tmp_path) -> None:
    """The elastic multi-node path across two network namespaces: the signed rendezvous
    admits the node that has the secret, and the run matches one node's."""
    master = ["--nnodes", "2", "--nproc", "1", "--master", f"{hosts.run_addr}:{_free_port()}"]
    script = [os.path.join(SCRIPTS, "fault_train.py"), "--checkpoint-dir", str(tmp_path / "ck")]
    argv = _meshfit("run", *master, *script, "--out", str(tmp_path / "two.pt"))
    nodes = []
    for wrap, dev in (
        (hosts.in_run_host, hosts.run_dev),
        (hosts.in_stranger_host, hosts.stranger_dev),
    ):
        env = _env(MESHFIT_RUN_SECRET=SECRET, GLOO_SOCKET_IFNAME=dev)
        nodes.append(subprocess.Popen(wrap(argv), env=env, stderr=subprocess.PIPE, text=True))
        time.sleep(2)  # node 0 first, as a cluster would start it
    errors = [node.communicate(timeout=180)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], errors
    one = subprocess.run(
        _meshfit("run", "--nproc", "2", *script[:1], "--checkpoint-dir", str(tmp_path / "c1"))
        + ["--out", str(tmp_path / "one.pt")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    a = torch.load(tmp_path / "two.pt", weights_only=True)
    b = torch.load(tmp_path / "one.pt", weights_only=True)
    for name, value in b["state"].items():
        assert torch.equal(a["state"][name], value), name


# ---- several nodes: secrets and reachability, on loopback ---------------------------------


def test_node_with_another_secret_is_refused_with_one_line() -> None:
    port = _free_port()
    master = ["--nnodes", "2", "--nproc", "1", "--master", f"127.0.0.1:{port}"]
    script = os.path.join(SCRIPTS, "hold.py")
    node0 = subprocess.Popen(
        _meshfit("run", *master, script),
        env=_env(MESHFIT_RUN_SECRET=SECRET),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        time.sleep(3)  # node 0 hosts the rendezvous first
        node1 = subprocess.run(
            _meshfit("run", *master, script),
            env=_env(MESHFIT_RUN_SECRET="another-secret-0123456789abcdef"),
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        node0.kill()
        node0.communicate()
    assert node1.returncode == 2, node1.stderr[-3000:]
    lines = _meshfit_lines(node1.stderr)
    assert len(lines) == 1 and "this node's run secret is not node 0's" in lines[0], node1.stderr
    assert "Traceback" not in node1.stderr


def test_unreachable_rendezvous_stops_with_one_line_in_the_stated_time() -> None:
    # 192.0.2.0/24 (TEST-NET-1) is nobody's; .222 is not an address of this machine.
    master = "192.0.2.222:29999"
    started = time.monotonic()
    result = subprocess.run(
        _meshfit("run", "--nnodes", "2", "--master", master, os.path.join(SCRIPTS, "hold.py")),
        env=_env(MESHFIT_RUN_SECRET=SECRET, MESHFIT_RDZV_TIMEOUT_S="3"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    lines = _meshfit_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert f"no meshfit rendezvous answered at {master} within 3 s" in lines[0]
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 60


@pytest.mark.slow
def test_multi_node_run_without_a_secret_is_refused_up_front() -> None:
    script = os.path.join(SCRIPTS, "hold.py")
    result = subprocess.run(
        _meshfit("run", "--nnodes", "2", "--master", "127.0.0.1:29999", script),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "needs a secret shared by its nodes" in result.stderr
    result = subprocess.run(
        _meshfit("run", "--nnodes", "2", "--master", "127.0.0.1:29999", script),
        env=_env(MESHFIT_RUN_SECRET="s3cr3t"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "too short to be a secret" in result.stderr
    assert "s3cr3t" not in result.stderr  # a secret is never printed


# ---- restarts -------------------------------------------------------------------------------


@pytest.mark.slow
def test_launch_restarts_after_a_killed_worker_and_resumes_exactly(tmp_path) -> None:
    clean = mf.launch(fit_killed_once, nproc=2, args=(str(tmp_path / "a"), None))
    killed = mf.launch(fit_killed_once, nproc=2, args=(str(tmp_path / "b"), 5), max_restarts=1)
    assert clean["attempt"] == 0 and killed["attempt"] == 1  # the kill really happened
    assert killed["losses"] == clean["losses"]
    for name, value in clean["state"].items():
        assert torch.equal(killed["state"][name], value), name
