"""meshfit's rendezvous backend: torch's dynamic rendezvous, signed, on one address.

torch's c10d rendezvous keeps its state as a pickle in a TCPStore that has no
authentication, and `_BackendRendezvousStateHolder.sync` unpickles whatever it reads
there: a host that can reach the store can run code in the elastic agent.
meshfit keeps torch's DynamicRendezvousHandler, its state holder and the elastic agent,
and supplies the backend, registered as "meshfit" in torch's handler registry:

- the state is stored with an HMAC-SHA256 tag under the run's secret, and bytes whose
  tag does not verify are refused before `pickle.loads` sees them (SignedBackend);
- the rendezvous key is derived from the secret (run_id), so it cannot be guessed;
- the stores listen on one address (stores.serve_store): 127.0.0.1 on a single node;
- node 0 hosts the store when the endpoint is one of its own addresses (stores.own_address),
  whatever its host name resolves to; another node that cannot reach it within
  MESHFIT_RDZV_TIMEOUT_S seconds stops with one line, and one with another secret is
  refused (the host publishes a challenge only the secret answers).

The secret: a single-node launch makes one in memory (using_secret); a multi-node run
reads MESHFIT_RUN_SECRET or the file named by MESHFIT_RUN_SECRET_FILE on every node.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)
from torch.distributed.elastic.rendezvous import registry as torch_registry
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousTimeout,
    Token,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from meshfit.errors import MeshfitError
from meshfit.launch import stores

BACKEND = "meshfit"
SECRET_ENV = "MESHFIT_RUN_SECRET"
SECRET_FILE_ENV = "MESHFIT_RUN_SECRET_FILE"
TIMEOUT_ENV = "MESHFIT_RDZV_TIMEOUT_S"
# The rendezvous round the agent's workers belong to, in the agent's environment, which
# the workers it starts next inherit (mesh._attempt_store keys their addresses by it).
ROUND_ENV = "MESHFIT_RDZV_ROUND"
DEFAULT_TIMEOUT_S = 30.0
MIN_SECRET_BYTES = 16
# The store's timeout once connected, for the agents' blocking reads (torch's c10d
# backend default).
READ_TIMEOUT = timedelta(seconds=60)
# The worker store's timeout (torch's TCPStore default, used by the handler it replaces).
WORKER_STORE_TIMEOUT = timedelta(seconds=300)
_CHECK_KEY = "meshfit.launch.rendezvous.check"
_TAG = b"meshfit-rdzv-v1"
_MAC_BYTES = hashlib.sha256().digest_size

_in_memory_secret: bytes | None = None


class ForeignRendezvousState(MeshfitError, RendezvousStateError):
    """Bytes in the rendezvous store that this run's secret did not sign."""


# ---- the secret ----------------------------------------------------------------------


def new_secret() -> bytes:
    return secrets.token_bytes(32)


@contextlib.contextmanager
def using_secret(secret: bytes) -> Iterator[None]:
    """Handlers created in this block use `secret`: a single-node launch hands its
    secret to the rendezvous in memory, never through the environment (which the
    workers inherit) or a file."""
    global _in_memory_secret
    saved, _in_memory_secret = _in_memory_secret, secret
    try:
        yield
    finally:
        _in_memory_secret = saved


def read_secret() -> bytes:
    """The multi-node run's secret from MESHFIT_RUN_SECRET or MESHFIT_RUN_SECRET_FILE."""
    if _in_memory_secret is not None:
        return _in_memory_secret
    make = "python3 -c 'import secrets; print(secrets.token_hex(32))'"
    value = os.environ.get(SECRET_ENV)
    path = os.environ.get(SECRET_FILE_ENV)
    if value is None and path:
        try:
            with open(path) as f:
                value = f.read().strip()
        except OSError as exc:
            raise MeshfitError(f"cannot read the run secret from {path}: {exc.strerror}") from None
    if value is None:
        raise MeshfitError(
            f"a multi-node run needs a secret shared by its nodes: set {SECRET_ENV} (or "
            f"{SECRET_FILE_ENV}=PATH) to the same random value on every node, e.g. "
            f'export {SECRET_ENV}="$({make})"'
        )
    secret = value.encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise MeshfitError(
            f"{SECRET_ENV} is too short to be a secret ({len(secret)} characters, fewer "
            f"than {MIN_SECRET_BYTES}); make one with {make}"
        )
    return secret


def _derive(secret: bytes, purpose: str) -> bytes:
    return hmac.new(secret, purpose.encode(), hashlib.sha256).digest()


def run_id(secret: bytes) -> str:
    """The rendezvous id: every node with the secret finds it, no one else can guess it."""
    return "meshfit-" + _derive(secret, "run id").hex()[:32]


# ---- the signed backend --------------------------------------------------------------


class SignedBackend(RendezvousBackend):
    """torch's c10d backend with the state signed: HMAC-SHA256(key, run id + state),
    prepended to the state. Bytes that do not verify raise ForeignRendezvousState and
    are never unpickled (the state holder unpickles only what get_state/set_state
    return)."""

    def __init__(self, inner: C10dRendezvousBackend, secret: bytes, run_id: str, where: str):
        self._inner = inner
        self._key = _derive(secret, "rendezvous state")
        self._run_id = run_id.encode()
        self._where = where

    @property
    def name(self) -> str:
        return BACKEND

    def _mac(self, state: bytes) -> bytes:
        return hmac.new(self._key, self._run_id + b"\0" + state, hashlib.sha256).digest()

    def sign(self, state: bytes) -> bytes:
        return _TAG + self._mac(state) + state

    def verify(self, signed: bytes) -> bytes:
        head, tag = len(_TAG), len(_TAG) + _MAC_BYTES
        state = signed[tag:]
        if signed[:head] != _TAG or not hmac.compare_digest(signed[head:tag], self._mac(state)):
            raise ForeignRendezvousState(
                f"the rendezvous state at {self._where} is not signed with this run's secret: "
                f"another host wrote to the rendezvous store, or a node runs with another "
                f"secret; stopped without reading it. Keep the rendezvous port on a private "
                f"network (docs/security.md)"
            )
        return state

    def get_state(self) -> tuple[bytes, Token] | None:
        got = self._inner.get_state()
        if got is None:
            return None
        signed, token = got
        return self.verify(signed), token

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        got = self._inner.set_state(self.sign(state), token)
        if got is None:
            return None
        signed, new_token, has_set = got
        return self.verify(signed), new_token, has_set


# ---- the handler -----------------------------------------------------------------------


class _Handler(DynamicRendezvousHandler):
    """torch's handler, with the store it shares with the workers (created on the node
    that gets rank 0) listening on this node's address only."""

    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> dist.Store:
        if stores.own_address(master_addr) != master_addr:
            # A host name, not an address of ours: torch's own server (all interfaces).
            return super()._create_tcp_store_server(master_addr, master_port)
        return stores.serve_store(master_addr, master_port, WORKER_STORE_TIMEOUT)

    def next_rendezvous(self) -> RendezvousInfo:
        """torch's round, with the workers' store address published in every round.

        torch 2.13 builds that address (MASTER_ADDR/MASTER_PORT under the round's
        prefix) in a handler's first round only and reuses it after: when a host died
        and a new agent took its place, the node that stayed rank 0 never wrote the
        address for the new round, and the newcomer waited for it until it timed out
        (60 s), as did the restart (measured between two namespaces). So rank 0 writes
        its store's address in every round and every other node reads it from there."""
        info = super().next_rendezvous()
        # Every node of a round knows its number; restart counts differ between a node
        # that stayed and one that replaced a dead host (a new agent counts from 0).
        os.environ[ROUND_ENV] = str(self._state_holder.state.round)
        if os.getenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") == "1":
            return info  # torch then builds the address in every round itself
        server_port = None
        if info.rank == 0 and self._shared_tcp_store_server is not None:
            server_port = self._shared_tcp_store_server.port
        boot = RendezvousStoreInfo.build(info.rank, info.store, self._this_node.addr, server_port)
        self._bootstrap_store_info = boot
        return RendezvousInfo(info.store, info.rank, info.world_size, boot)


def _timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise MeshfitError(f"{TIMEOUT_ENV} must be a positive number of seconds, not {raw!r}")
    return value


def _challenge(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(_derive(secret, "challenge"), nonce, hashlib.sha256).digest()


def _host_store(address: str, port: int, secret: bytes) -> dist.Store:
    try:
        store = stores.serve_store(address, port, READ_TIMEOUT)
    except OSError as exc:
        raise MeshfitError(
            f"cannot host the rendezvous on {address}:{port} ({exc.strerror}); choose a free "
            f"port in --master"
        ) from None
    nonce = secrets.token_bytes(16)
    store.set(_CHECK_KEY, nonce + _challenge(secret, nonce))
    return store


def _join_store(host: str, port: int, secret: bytes) -> dist.Store:
    endpoint = f"{host}:{port}"
    timeout_s = _timeout_s()
    try:
        store = dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True
        )
        check = store.get(_CHECK_KEY)
    except (RuntimeError, ValueError, TimeoutError):
        raise MeshfitError(
            f"no meshfit rendezvous answered at {endpoint} within {timeout_s:.0f} s "
            f"({TIMEOUT_ENV}): check that node 0 runs meshfit with --master {endpoint}, that "
            f"{host} is node 0's address as this node reaches it, and that port {port} is "
            f"open between the nodes"
        ) from None
    nonce, answer = check[:16], check[16:]
    if not hmac.compare_digest(answer, _challenge(secret, nonce)):
        raise MeshfitError(
            f"refused by the rendezvous at {endpoint}: this node's run secret is not node "
            f"0's; give every node the same {SECRET_ENV} or {SECRET_FILE_ENV}"
        )
    store.set_timeout(READ_TIMEOUT)
    return store


def _open_store(params: RendezvousParameters, secret: bytes) -> tuple[dist.Store, str]:
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    mine = "127.0.0.1" if stores.is_loopback(host) else stores.own_address(host)
    is_host = params.get_as_bool("is_host")
    if is_host is None:
        is_host = mine is not None
    if is_host:
        if mine is None:
            raise MeshfitError(f"is_host is set but {host} is not an address of this node")
        try:
            return _host_store(mine, port, secret), f"{mine}:{port}"
        except MeshfitError:
            # Several nodes on one machine (tests, loopback) all find the address theirs;
            # the first binds the port and the others join it, as torch's c10d backend
            # does when it inferred is_host.
            if params.get_as_bool("is_host") or port == 0:
                raise
    return _join_store(host, port, secret), f"{host}:{port}"


def _seconds(params: RendezvousParameters, key: str) -> timedelta | None:
    value = params.get_as_int(key)
    return None if value is None else timedelta(seconds=value)


def create_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """The creator registered with torch's handler registry under "meshfit"."""
    secret = read_secret()
    store, where = _open_store(params, secret)
    if params.local_addr is None:
        # The address other nodes reach this one at (the MASTER_ADDR workers get when
        # this node has rank 0): the one on the route to the rendezvous, not the host
        # name, which may resolve to loopback inside a container.
        host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
        params.local_addr = stores.address_towards(host, port or 1)
    backend = SignedBackend(
        C10dRendezvousBackend(store, params.run_id), secret, params.run_id, where
    )
    timeout = RendezvousTimeout(
        *(
            _seconds(params, f"{name}_timeout")
            for name in ("join", "last_call", "close", "heartbeat")
        )
    )
    return _Handler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=params.get_as_int("keep_alive_interval", 5),
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 3),
    )


def register() -> None:
    """Make "meshfit" a rendezvous backend of torch's elastic launcher (idempotent)."""
    torch_registry.handler_registry.register(BACKEND, create_handler)
