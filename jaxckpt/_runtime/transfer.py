"""One transfer server per process: a peer pulls bytes straight from this host's memory.

``jax.experimental.transfer`` runs a server in each process that holds arrays offered with an
id (``await_pull``) until a peer that knows the id pulls them (``pull``), over a socket between
the two hosts: no relay through process 0, and no device collective, so it is safe on a
background thread while the training loop issues its own collectives. The replication of the
local tier (``jaxckpt._runtime.replication``) moves its bulk bytes this way and keeps only small
messages (file list, acknowledgements, verdict) in the coordination service's key-value store.

The server is started on first use on the **CPU** backend's client, so on a GPU or TPU host the
bytes stay in host memory and never take device memory. It listens on this host's address as
seen from the coordinator (the source address of a UDP socket "connected" to the coordinator:
the interface the peers reach this host through, never ``[::]`` or a loopback the others cannot
use), on a port the system picks.

``JAXCKPT_REPLICATION`` chooses the transport: ``auto`` (default: this server, or the key-value
relay where it cannot start), ``transfer`` (this server or an error) or ``kv`` (the relay).

Known limits of ``jax.experimental.transfer`` (jax 0.6.2 to 0.10.2, measured here): ``pull``
ignores its timeout when the peer dies, so :meth:`Connection.pull` runs it on a daemon thread
and gives it up at the deadline; an array offered to a peer that never pulls it stays in the
server (the replication offers at most a window of chunks, so such a loss is bounded).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import numpy.typing as npt

from jaxckpt._errors import DistributedError
from jaxckpt._runtime import distributed as _distributed
from jaxckpt._runtime import pools

if TYPE_CHECKING:
    from jax.experimental.transfer import TransferConnection

logger = logging.getLogger(__name__)

ENV = "JAXCKPT_REPLICATION"
MODES = ("auto", "transfer", "kv")
_lock = threading.Lock()
_server: Server | None = None
_failure = ""  # why the server could not start: it is not tried again
_ids = itertools.count(1)


def mode() -> str:
    """``JAXCKPT_REPLICATION``: ``auto`` (default), ``transfer`` or ``kv``."""
    text = os.environ.get(ENV, "").strip().lower() or "auto"
    if text not in MODES:
        raise DistributedError(f"{ENV}={text!r} is not one of {', '.join(MODES)}; unset it.")
    return text


def server() -> Server | None:
    """This process's transfer server, started on first use; ``None`` where it cannot start
    (``jax.experimental.transfer`` missing, no CPU backend, no address): the reason is logged
    once and :func:`failure` returns it."""
    global _server, _failure
    with _lock:
        if _server is None and not _failure:
            try:
                _server = Server()
            except Exception as e:  # noqa: BLE001 - any failure means: use the relay
                _failure = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                logger.info("no jax transfer server (%s): replicas go through the relay", _failure)
        return _server


def failure() -> str:
    """Why :func:`server` returned ``None``; empty before it was called or when it started."""
    return _failure


def new_ids() -> int:
    """A base id for one transfer's chunks (``base + i`` for chunk ``i``), unique in this
    process's server: the server is this process's alone, so a counter suffices."""
    return next(_ids) << 32


def host_address() -> str:
    """This host's IP address toward the coordinator (loopback only where the coordinator is)."""
    host = _distributed.coordinator_address().rsplit(":", 1)[0].strip("[]")
    if not host:
        raise DistributedError("jax.distributed has no coordinator address")
    family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)  # UDP: no packet is sent, the kernel only picks the route
        ip = s.getsockname()[0]
    return f"[{ip}]" if family == socket.AF_INET6 else ip


class Server:
    """The process's ``jax.experimental.transfer`` server on the CPU backend."""

    def __init__(self) -> None:
        from jax.experimental import transfer

        self.device = jax.local_devices(backend="cpu")[0]
        bind = f"{host_address()}:0"
        # The transport addresses carry the bulk bytes between processes; without them the
        # server moves arrays only within its own process.
        self._server = transfer.start_transfer_server(self.device.client, bind, [bind])
        self.address: str = self._server.address()

    def offer(self, uuid: int, data: bytearray) -> None:
        """Hold ``data`` for one pull of ``uuid`` by a peer. The caller must not change ``data``
        afterwards: the CPU backend may share its memory."""
        array = jax.device_put(np.frombuffer(data, np.uint8), self.device)
        self._server.await_pull(uuid, [array])

    def connect(self, address: str) -> Connection:
        """A connection to the peer server at ``address`` (another process's ``address``)."""
        return Connection(self._server.connect(address), self.device, address)


class Connection:
    """Pulls from one peer's server."""

    def __init__(self, conn: TransferConnection, device: jax.Device, address: str) -> None:
        self.address = address
        self._sharding = jax.sharding.SingleDeviceSharding(device)
        self._conn = conn

    def pull(
        self,
        uuid: int,
        nbytes: int,
        timeout: float,
        alive: Callable[[], None] | None = None,
    ) -> npt.NDArray[Any]:
        """The ``nbytes`` bytes the peer offered as ``uuid``, within ``timeout`` seconds;
        ``alive`` (if given) is called every second of the wait and raises once the peer is
        known dead, which gives the pull up at once.

        Raises:
          DistributedError: the peer failed, is unreachable or did not offer them in time.
        """
        future = pools.abandonable(self._pull, uuid, nbytes)
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                try:
                    return future.result(left if alive is None else min(left, 1.0))
                except concurrent.futures.TimeoutError:
                    if time.monotonic() >= deadline:
                        raise
                    if alive is not None:
                        alive()
        except concurrent.futures.TimeoutError:
            why = f"nothing within {timeout:g} s"
        except DistributedError:
            raise
        except Exception as e:  # noqa: BLE001 - the transfer library raises its runtime errors
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        raise DistributedError(
            f"pulling {nbytes} bytes from the transfer server at {self.address} failed: {why}. "
            f"The peer died, or this host cannot reach it: set {ENV}=kv to relay replicas "
            f"through the coordination service, or raise JAXCKPT_SYNC_TIMEOUT if it is slow."
        )

    def _pull(self, uuid: int, nbytes: int) -> npt.NDArray[Any]:
        spec = jax.ShapeDtypeStruct((nbytes,), np.uint8, sharding=self._sharding)
        [array] = self._conn.pull(uuid, [spec])
        return np.asarray(array)
