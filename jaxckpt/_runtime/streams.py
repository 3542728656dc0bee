"""A stream of bytes from one process to another: peer to peer, or relayed by process 0.

The local tier moves bytes between processes over JAX's own runtime, never over a shared file
system: peer to peer through each process's ``jax.experimental.transfer`` server
(``jaxckpt._runtime.transfer``), with only small messages in the key-value store of
``jax.distributed`` (the coordination service, hosted by process 0). Where there is no transfer
server, or ``JAXCKPT_REPLICATION=kv``, the chunks themselves relay through the store. Its users:
``jaxckpt._runtime.replication`` (a part's directory, a head with its file list) and
``jaxckpt._tiers.elastic_restore`` (the boxes an elastic restore moves).

Why not device collectives: replication runs on a background thread while the training loop
issues its own collectives, and collectives must be issued in the same order on every process;
two threads issuing them would race. A transfer server's pull and the store need no order,
work with any backend (gloo on CPU included), and a stream is between two processes only.

One stream, :class:`Outgoing` on the sender and :class:`Incoming` on the receiver, under one
key prefix (unique to the stream; both sides derive it from what they both know):

1. ``head``: JSON ``{"bytes": n, ...what the user adds}``, plus ``"via": "transfer"``, the
   sender's server ``address``, the chunks' base ``uuid`` and ``chunk`` size when the bytes go
   peer to peer (the sender decides, so both sides agree); or ``{"error": why}`` when the
   sender has nothing to send (:func:`refuse`), which ends the stream at once.
2. Chunk ``i`` of the bytes, at most one chunk size: peer to peer, the sender offers it as
   ``uuid + i`` and the receiver pulls it; relayed, the sender posts it as ``c/<i>`` and the
   receiver reads and deletes it. Either way the receiver then posts ``ack/<i>``, and the
   sender offers or posts chunk ``i`` only once ``ack/<i - WINDOW>`` has arrived. So each side
   holds a few chunks of host memory at a time (at most :data:`WINDOW` offered or in the store
   per stream), whatever the stream's length.
3. ``tail``: JSON ``{"chunks": n, "crc32": [crc]}``; the receiver checks the length and the
   checksum and posts ``done`` (``"ok"`` or why not). The sender deletes the prefix.

What scales: peer to peer, each pair moves its bytes at the network's speed between the two
hosts, all pairs at once; process 0 carries one small acknowledgement per chunk. Relayed, every
byte goes through process 0's one gRPC server (tens to ~150 MiB/s in all here), which suits
tests and moderate states only (docs/tiers.md, docs/benchmarks.md "Multi-tier checkpoints").
"""

from __future__ import annotations

import itertools
import json
import time
import zlib
from collections.abc import Iterator
from typing import Any, NoReturn

from jaxckpt._errors import DistributedError
from jaxckpt._runtime import distributed as _distributed
from jaxckpt._runtime import heartbeat as _heartbeat
from jaxckpt._runtime import transfer as _transfer

CHUNK_BYTES = 4 << 20  # through the store: well under its gRPC message limit
# Pulled peer to peer. 4 MiB moved as fast as 16 or 64 here, and host memory grows less: the
# transfer threads' allocator arenas each keep a freed chunk (docs/benchmarks.md, "Multi-tier").
TRANSFER_CHUNK_BYTES = 4 << 20
_MAX_CHUNK = 1 << 30  # a head asking for bigger chunks is not jaxckpt's
WINDOW = 2
_MAX_HEAD = 16 << 20  # bytes of a head or tail: far above any real part's file list


def chunk_bytes() -> int:
    """The chunk size of a stream this process would send now (peer to peer or relayed)."""
    return CHUNK_BYTES if _transfer.mode() == "kv" else TRANSFER_CHUNK_BYTES


class Outgoing:
    """A stream of ``total`` bytes to the process that opens ``Incoming(prefix)``:
    :meth:`write` the bytes (in any pieces), then :meth:`close`.

    Args:
      prefix: the stream's key prefix (ends with ``/``), known to both processes.
      total: the bytes the stream carries.
      about: more for the head (JSON), e.g. a directory's file list.
      timeout: seconds to wait for each acknowledgement; default ``JAXCKPT_SYNC_TIMEOUT``.
      watch: the receiver's heartbeat (``jaxckpt._runtime.heartbeat``): where given, a
        receiver that died or gave up ends the waits within its deadline.

    Raises:
      DistributedError: the receiver did not acknowledge in time, died or refused the copy, or
        ``JAXCKPT_REPLICATION=transfer`` and this process has no transfer server (then the
        receiver hears why at once).
    """

    def __init__(
        self,
        prefix: str,
        total: int,
        *,
        about: dict[str, Any] | None = None,
        timeout: float | None = None,
        watch: _heartbeat.Watch | None = None,
    ) -> None:
        kv = _distributed.kv_client()
        timeout = _distributed.sync_timeout() if timeout is None else timeout
        try:
            server = _server()
        except DistributedError as e:
            refuse(prefix, str(e))
            raise
        self._stream = _Stream(kv, prefix, timeout, server, watch)
        self.total, self.crc = total, 0
        head = self._stream.head({**(about or {}), "bytes": total})
        kv.key_value_set_bytes(prefix + "head", head)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Queue ``data`` (C-contiguous); each full chunk goes at once."""
        self.crc = zlib.crc32(data, self.crc)
        self._stream.add(data)

    def close(self) -> int:
        """Send what is queued and the checksum; wait for the receiver's verdict; the bytes."""
        s = self._stream
        try:
            s.flush()
            if s.total != self.total:
                raise DistributedError(f"{s.prefix}: {s.total} bytes written, {self.total} due")
            tail = {"chunks": s.seq, "crc32": [self.crc]}
            s.kv.key_value_set_bytes(s.prefix + "tail", json.dumps(tail).encode())
            verdict = get(s.kv, s.prefix + "done", s.timeout, f"stream {s.prefix}", s.watch)
        finally:  # also when the receiver is gone: no chunk stays in the store
            self.abort()
        if verdict != b"ok":
            raise DistributedError(
                f"the stream {s.prefix} was refused by its receiver: {verdict.decode(errors='replace')}"
            )
        return s.total

    def abort(self) -> None:
        """Delete what this stream left in the store (a receiver still waiting times out)."""
        self._stream.kv.key_value_delete(self._stream.prefix.rstrip("/"))


def refuse(prefix: str, why: str) -> None:
    """Tell the receiver of the stream ``prefix`` that nothing comes, and why."""
    _distributed.kv_client().key_value_set_bytes(
        prefix + "head", json.dumps({"error": why}).encode()
    )


class Incoming:
    """The receiving end of an :class:`Outgoing` stream: :meth:`read` its bytes in order (in
    any pieces), then :meth:`close`, which checks them and answers the sender; on an error of
    its own the caller calls :meth:`fail` instead.

    Args:
      prefix: the stream's key prefix.
      total: the bytes expected (``None``: any number up to ``max_bytes``, read from the head).
      what: the stream's name in error messages.
      timeout: seconds to wait for each chunk; default ``JAXCKPT_SYNC_TIMEOUT``.
      watch: the sender's heartbeat (``jaxckpt._runtime.heartbeat``): where given, a
        sender that died or gave up ends the waits within its deadline.

    Raises:
      DistributedError: the sender refused (its reason), died, sent another length, or sent a
        bad copy.
    """

    def __init__(
        self,
        prefix: str,
        *,
        total: int | None = None,
        max_bytes: int | None = None,
        what: str = "",
        timeout: float | None = None,
        watch: _heartbeat.Watch | None = None,
    ) -> None:
        self.kv, self.prefix, self.what = _distributed.kv_client(), prefix, what or prefix
        self.timeout = _distributed.sync_timeout() if timeout is None else timeout
        self.watch = watch
        self.head = _json(get(self.kv, prefix + "head", self.timeout, self.what, watch), "head")
        if "error" in self.head:
            self.kv.key_value_delete(prefix.rstrip("/"))
            raise DistributedError(
                f"the sender of {self.what} has nothing to send: {self.head['error']}"
            )
        sent = self.head.get("bytes")
        if not isinstance(sent, int) or sent < 0 or total not in (None, sent):
            self._refuse(f"{self.what}: {total} bytes due, the sender sends {sent!r:.40}")
        self.total: int = sent
        if max_bytes is not None and self.total > max_bytes:
            self._refuse(f"{self.what}: {self.total} bytes, more than the {max_bytes} allowed")
        if self.head.get("via") == "transfer":
            self._chunks = _pulled(self, self.head)
        else:
            self._chunks = _relayed(self)
        self._chunk, self._at, self.crc, self.got = memoryview(b""), 0, 0, 0

    def _refuse(self, why: str) -> NoReturn:
        error = DistributedError(why)
        self.fail(error)
        raise error

    def read(self, n: int) -> bytearray:
        """The next ``n`` bytes of the stream."""
        if self.got + n > self.total:
            raise DistributedError(f"{self.what}: reading past the {self.total} bytes sent")
        out, filled = bytearray(n), 0
        while filled < n:
            if self._at == len(self._chunk):
                self._chunk, self._at = next(self._chunks), 0
            piece = self._chunk[self._at : self._at + n - filled]
            out[filled : filled + len(piece)] = piece
            filled, self._at = filled + len(piece), self._at + len(piece)
        self.crc, self.got = zlib.crc32(out, self.crc), self.got + n
        return out

    def close(self) -> None:
        """Check that every byte came, undamaged, and tell the sender."""
        try:
            raw = get(self.kv, self.prefix + "tail", self.timeout, self.what, self.watch)
            tail = _json(raw, "tail")
            if self.got != self.total or self._at != len(self._chunk):
                raise DistributedError(f"{self.what}: not read to its end")
            if tail.get("crc32") != [self.crc]:
                raise DistributedError(f"{self.what} arrived damaged: its crc32 differs")
        except DistributedError as e:
            self.fail(e)
            raise
        self.kv.key_value_set_bytes(self.prefix + "done", b"ok")

    def fail(self, error: BaseException) -> None:
        """Tell the sender the stream failed here (``error``); drop its relayed chunks."""
        self.kv.key_value_delete(self.prefix + "c")  # chunks a dead or refused sender left
        self.kv.key_value_set_bytes(self.prefix + "done", str(error)[:2000].encode())


def get(
    kv: _distributed.KeyValueClient,
    key: str,
    timeout: float,
    what: str,
    watch: _heartbeat.Watch | None = None,
) -> bytes:
    """The value of ``key`` once another process posts it, within ``timeout`` seconds; where
    ``watch`` (the heartbeat of the process that posts it) is given, waited for in slices
    between which it is checked, so a dead peer ends the wait within its I/O deadline.

    Raises:
      DistributedError: nothing came in time, or the watched process died (naming ``what``).
    """
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        wait = left if watch is None else min(left, _heartbeat.SLICE)
        try:
            return kv.blocking_key_value_get_bytes(key, max(1, int(wait * 1000)))
        except Exception as e:  # noqa: BLE001 - the client raises one runtime error type
            if watch is None or wait >= left or "DEADLINE_EXCEEDED" not in str(e):
                raise DistributedError(
                    f"{what}: no answer from the other process within {timeout:g} s ({key}: "
                    f"{str(e).splitlines()[0][:200]}). It crashed, hangs, or is slow: raise "
                    f"JAXCKPT_SYNC_TIMEOUT=SECONDS if transfers are just slow."
                ) from e
        watch.check(what)


def _server() -> _transfer.Server | None:
    """The transfer server the bytes go through; ``None``: through the store."""
    mode = _transfer.mode()
    server = None if mode == "kv" else _transfer.server()
    if server is None and mode == "transfer":
        raise DistributedError(
            f"{_transfer.ENV}=transfer but this process has no jax transfer server "
            f"({_transfer.failure()}); unset {_transfer.ENV} to relay replicas through the "
            f"coordination service."
        )
    return server


class _Stream:
    """The sender's side of the chunks: at most ``WINDOW`` unacknowledged at a time, in the
    store or offered by the transfer server (``server``)."""

    def __init__(
        self,
        kv: _distributed.KeyValueClient,
        prefix: str,
        timeout: float,
        server: _transfer.Server | None = None,
        watch: _heartbeat.Watch | None = None,
    ) -> None:
        self.kv, self.prefix, self.timeout, self.server = kv, prefix, timeout, server
        self.watch = watch
        self.chunk = CHUNK_BYTES if server is None else TRANSFER_CHUNK_BYTES
        self.base = 0 if server is None else _transfer.new_ids()
        self.buf = bytearray()
        self.seq = self.total = 0

    def head(self, what: dict[str, Any]) -> bytes:
        """The stream's head: ``what`` it carries, and how (the sender decides)."""
        if self.server is not None:
            what = {**what, "via": "transfer", "address": self.server.address}
            what.update(uuid=self.base, chunk=self.chunk)
        return json.dumps(what).encode()

    def add(self, block: bytes | bytearray | memoryview) -> None:
        view = memoryview(block).cast("B")
        while len(view):
            take = self.chunk - len(self.buf)
            self.buf += view[:take]
            view = view[take:]
            if len(self.buf) >= self.chunk:
                self.flush()

    def flush(self) -> None:
        if not self.buf:
            return
        if self.seq >= WINDOW:
            ack = f"{self.prefix}ack/{self.seq - WINDOW}"
            get(
                self.kv,
                ack,
                self.timeout,
                f"chunk {self.seq - WINDOW} of {self.prefix}",
                self.watch,
            )
            self.kv.key_value_delete(ack)
        if self.server is None:
            self.kv.key_value_set_bytes(f"{self.prefix}c/{self.seq}", bytes(self.buf))
        else:  # the server holds the buffer until the receiver pulls it: a new one follows
            self.server.offer(self.base + self.seq, self.buf)
        self.total += len(self.buf)
        self.seq += 1
        self.buf = bytearray()


def _relayed(stream: Incoming) -> Iterator[memoryview]:
    """The chunks from the store, each deleted and acknowledged once read."""
    kv, prefix = stream.kv, stream.prefix
    for seq in itertools.count():
        chunk = get(kv, f"{prefix}c/{seq}", stream.timeout, stream.what, stream.watch)
        kv.key_value_delete(f"{prefix}c/{seq}")
        kv.key_value_set(f"{prefix}ack/{seq}", "")
        yield memoryview(chunk)


def _pulled(stream: Incoming, head: dict[str, Any]) -> Iterator[memoryview]:
    """The chunks pulled from the sender's transfer server, each acknowledged once here."""
    kv, prefix, what, total = stream.kv, stream.prefix, stream.what, stream.total
    address, base, chunk = head.get("address"), head.get("uuid"), head.get("chunk")
    if not (
        isinstance(address, str)
        and isinstance(base, int)
        and isinstance(chunk, int)
        and 0 < chunk <= _MAX_CHUNK
    ):
        raise DistributedError(f"a transfer's head is not what jaxckpt sends ({what})")
    server = _transfer.server()
    if server is None:
        raise DistributedError(
            f"{what}: the sender offers its bytes over jax's transfer server, but this process "
            f"cannot start one ({_transfer.failure()}); set {_transfer.ENV}=kv on every process."
        )
    conn = server.connect(address)
    watch = stream.watch
    alive = None if watch is None else lambda: watch.check(what)
    for seq in range(-(-total // chunk)):
        data = conn.pull(base + seq, min(chunk, total - seq * chunk), stream.timeout, alive)
        kv.key_value_set(f"{prefix}ack/{seq}", "")  # the sender may offer the next one
        yield data.data  # memoryview(data), typed


def _json(raw: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(raw) if len(raw) <= _MAX_HEAD else None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise DistributedError(f"a transfer's {what} is not what jaxckpt sends")
    return value
