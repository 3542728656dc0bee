"""Copying a directory from one process to another, and one decision for all processes.

The multi-tier manager (``jaxckpt._manager.tiers``) keeps each process's local checkpoint
part on ``local_replicas`` other processes, and at a restore moves a part from the process
that holds it to the one that needs it. The bytes travel over JAX's own runtime, never over a
shared file system: peer to peer through each process's ``jax.experimental.transfer`` server
(``jaxckpt._runtime.transfer``), with only small messages in the key-value store of
``jax.distributed`` (the coordination service, hosted by process 0). Where there is no transfer
server, or ``JAXCKPT_REPLICATION=kv``, the chunks themselves relay through the store.

Why not device collectives: replication runs on a background thread while the training loop
issues its own collectives, and collectives must be issued in the same order on every process;
two threads issuing them would race. A transfer server's pull and the store need no order,
work with any backend (gloo on CPU included), and a transfer is between two processes only.

One transfer, ``send_dir`` on the sender and ``receive_dir`` on the receiver, under one key
prefix (unique to the transfer; both sides derive it from what they both know):

1. ``head``: JSON ``{"files": [[relative path, size], ...]}``, plus ``"via": "transfer"``, the
   sender's server ``address``, the chunks' base ``uuid`` and ``chunk`` size when the bytes go
   peer to peer (the sender decides, so both sides agree); or ``{"error": why}`` when the
   sender has nothing to send (its own save failed), which ends the transfer at once.
2. Chunk ``i`` of the files' bytes end to end, at most one chunk size: peer to peer, the sender
   offers it as ``uuid + i`` and the receiver pulls it; relayed, the sender posts it as
   ``c/<i>`` and the receiver reads and deletes it. Either way the receiver then posts
   ``ack/<i>``, and the sender offers or posts chunk ``i`` only once ``ack/<i - WINDOW>`` has
   arrived. So each side holds a few chunks of host memory at a time (at most :data:`WINDOW`
   offered or in the store per transfer), whatever the part's size.
3. ``tail``: JSON ``{"chunks": n, "crc32": [per file]}``; the receiver checks every size and
   checksum, fsyncs, and posts ``done`` (``"ok"`` or why not). The sender deletes the prefix.

What scales: peer to peer, each pair moves its part at the network's speed between the two
hosts, all pairs at once; process 0 carries one small acknowledgement per chunk. Relayed, every
byte goes through process 0's one gRPC server (tens to ~150 MiB/s in all here), which suits
tests and moderate states only (docs/tiers.md, docs/benchmarks.md "Multi-tier checkpoints").

:func:`decide`: every process posts a value, process 0 applies a function to all of them and
every process gets its answer: one agreement, computed once.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from jaxckpt._errors import DistributedError
from jaxckpt._runtime import distributed as _distributed
from jaxckpt._runtime import transfer as _transfer

CHUNK_BYTES = 4 << 20  # through the store: well under its gRPC message limit
# Pulled peer to peer. 4 MiB moved as fast as 16 or 64 here, and host memory grows less: the
# transfer threads' allocator arenas each keep a freed chunk (docs/benchmarks.md, "Multi-tier").
TRANSFER_CHUNK_BYTES = 4 << 20
_MAX_CHUNK = 1 << 30  # a head asking for bigger chunks is not jaxckpt's
WINDOW = 2
PREFIX = "jaxckpt/tiers"
_MAX_HEAD = 16 << 20  # bytes of a head or tail: far above any real part's file list
_POLL_S = 0.2
_decisions = itertools.count()
_lock = threading.Lock()


def _get(kv: _distributed.KeyValueClient, key: str, timeout: float, what: str) -> bytes:
    try:
        return kv.blocking_key_value_get_bytes(key, max(1, int(timeout * 1000)))
    except Exception as e:  # noqa: BLE001 - the client raises one runtime error type
        raise DistributedError(
            f"{what}: no answer from the other process within {timeout:g} s ({key}: "
            f"{str(e).splitlines()[0][:200]}). It crashed, hangs, or is slow: raise "
            f"JAXCKPT_SYNC_TIMEOUT=SECONDS if transfers are just slow."
        ) from e


def files_of(root: Path) -> list[tuple[str, int]]:
    """The regular files under ``root`` (symbolic links are skipped), relative, sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.is_file() and not path.is_symlink():
                out.append((path.relative_to(root).as_posix(), path.stat().st_size))
    return out


def send_dir(
    prefix: str, root: Path | None, *, error: str = "", timeout: float | None = None
) -> int:
    """Send the files under ``root`` to the process that calls ``receive_dir(prefix, ...)``.

    The bytes go peer to peer over this process's transfer server, or through the key-value
    store where there is none (``JAXCKPT_REPLICATION``, see ``jaxckpt._runtime.transfer``);
    the head tells the receiver which.

    Args:
      prefix: the transfer's key prefix (ends with ``/``), known to both processes.
      root: the directory to send; ``None`` with ``error`` tells the receiver why not.
      timeout: seconds to wait for each acknowledgement; default ``JAXCKPT_SYNC_TIMEOUT``.

    Returns:
      The bytes sent.

    Raises:
      DistributedError: the receiver did not acknowledge in time, or reported a bad copy, or
        ``JAXCKPT_REPLICATION=transfer`` and this process has no transfer server.
    """
    kv = _distributed.kv_client()
    timeout = _distributed.sync_timeout() if timeout is None else timeout
    try:
        server = _server() if root is not None else None
    except DistributedError as e:  # the receiver hears why at once
        kv.key_value_set_bytes(prefix + "head", json.dumps({"error": str(e)}).encode())
        raise
    if root is None:
        kv.key_value_set_bytes(prefix + "head", json.dumps({"error": error}).encode())
        return 0
    try:
        sent = _send_files(kv, prefix, root, timeout, server)
        verdict = _get(kv, prefix + "done", timeout, f"copy of {root}").decode()
    finally:  # also when the receiver is gone: no chunk stays in the store
        kv.key_value_delete(prefix.rstrip("/"))
    if verdict != "ok":
        raise DistributedError(f"the copy of {root} was refused by its receiver: {verdict}")
    return sent.total


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


def _send_files(
    kv: _distributed.KeyValueClient,
    prefix: str,
    root: Path,
    timeout: float,
    server: _transfer.Server | None,
) -> _Stream:
    """Post the head, every file's bytes in chunks, then the tail with their crc32s."""
    files = files_of(root)
    sent = _Stream(kv, prefix, timeout, server)
    head: dict[str, Any] = {"files": files}
    if server is not None:
        head.update(via="transfer", address=server.address, uuid=sent.base, chunk=sent.chunk)
    kv.key_value_set_bytes(prefix + "head", json.dumps(head).encode())
    crcs = []
    for rel, size in files:
        crc, left = 0, size
        with open(root / rel, "rb") as f:
            while left:
                block = f.read(min(left, sent.chunk - len(sent.buf)))
                if not block:
                    raise DistributedError(f"{root / rel} shrank while it was being sent")
                crc, left = zlib.crc32(block, crc), left - len(block)
                sent.add(block)
        crcs.append(crc)
    sent.flush()
    tail = json.dumps({"chunks": sent.seq, "crc32": crcs}).encode()
    kv.key_value_set_bytes(prefix + "tail", tail)
    return sent


class _Stream:
    """The sender's side of the chunks: at most ``WINDOW`` unacknowledged at a time, in the
    store or offered by the transfer server (``server``)."""

    def __init__(
        self,
        kv: _distributed.KeyValueClient,
        prefix: str,
        timeout: float,
        server: _transfer.Server | None = None,
    ) -> None:
        self.kv, self.prefix, self.timeout, self.server = kv, prefix, timeout, server
        self.chunk = CHUNK_BYTES if server is None else TRANSFER_CHUNK_BYTES
        self.base = 0 if server is None else _transfer.new_ids()
        self.buf = bytearray()
        self.seq = self.total = 0

    def add(self, block: bytes) -> None:
        self.buf += block
        if len(self.buf) >= self.chunk:
            self.flush()

    def flush(self) -> None:
        if not self.buf:
            return
        if self.seq >= WINDOW:
            ack = f"{self.prefix}ack/{self.seq - WINDOW}"
            _get(self.kv, ack, self.timeout, f"chunk {self.seq - WINDOW} of {self.prefix}")
            self.kv.key_value_delete(ack)
        if self.server is None:
            self.kv.key_value_set_bytes(f"{self.prefix}c/{self.seq}", bytes(self.buf))
        else:  # the server holds the buffer until the receiver pulls it: a new one follows
            self.server.offer(self.base + self.seq, self.buf)
        self.total += len(self.buf)
        self.seq += 1
        self.buf = bytearray()


def receive_dir(prefix: str, dest: Path, *, max_bytes: int, timeout: float | None = None) -> None:
    """Receive what ``send_dir(prefix, ...)`` sends into the new directory ``dest``.

    The sender is another process: its file list is checked (relative paths inside ``dest``,
    at most ``max_bytes`` in all) before anything is written, and every file's size and crc32
    after.

    Raises:
      DistributedError: the sender sent nothing (its reason), failed, or sent a bad copy;
        ``dest`` may then hold a partial copy, which the caller removes.
    """
    kv = _distributed.kv_client()
    timeout = _distributed.sync_timeout() if timeout is None else timeout
    head = _json(_get(kv, prefix + "head", timeout, f"receiving {dest.name}"), "head")
    if "error" in head:
        kv.key_value_delete(prefix.rstrip("/"))
        raise DistributedError(f"the sender of {dest.name} has nothing to send: {head['error']}")
    try:
        files = _check_files(head.get("files"), max_bytes)
        total, what = sum(size for _, size in files), f"receiving {dest.name}"
        if head.get("via") == "transfer":
            chunks = _pulled(kv, prefix, head, total, timeout, what)
        else:
            chunks = _relayed(kv, prefix, timeout, what)
        crcs = _receive_files(dest, files, chunks)
        tail = _json(_get(kv, prefix + "tail", timeout, what), "tail")
        if tail.get("crc32") != crcs:
            raise DistributedError(f"{dest.name} arrived damaged: a file's crc32 differs")
    except DistributedError as e:
        kv.key_value_delete(prefix + "c")  # chunks a dead or refused sender left in the store
        kv.key_value_set_bytes(prefix + "done", str(e)[:2000].encode())
        raise
    kv.key_value_set_bytes(prefix + "done", b"ok")


def _relayed(
    kv: _distributed.KeyValueClient, prefix: str, timeout: float, what: str
) -> Iterator[memoryview]:
    """The chunks from the store, each deleted and acknowledged once read."""
    for seq in itertools.count():
        chunk = _get(kv, f"{prefix}c/{seq}", timeout, what)
        kv.key_value_delete(f"{prefix}c/{seq}")
        kv.key_value_set(f"{prefix}ack/{seq}", "")
        yield memoryview(chunk)


def _pulled(
    kv: _distributed.KeyValueClient,
    prefix: str,
    head: dict[str, Any],
    total: int,
    timeout: float,
    what: str,
) -> Iterator[memoryview]:
    """The chunks pulled from the sender's transfer server, each acknowledged once here."""
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
    for seq in range(-(-total // chunk)):
        data = conn.pull(base + seq, min(chunk, total - seq * chunk), timeout)
        kv.key_value_set(f"{prefix}ack/{seq}", "")  # the sender may offer the next one
        yield data.data  # memoryview(data), typed


def _receive_files(
    dest: Path, files: list[tuple[str, int]], chunks: Iterator[memoryview]
) -> list[int]:
    """Write the chunks into ``files`` under ``dest`` (each fsynced); their crc32s."""
    dest.mkdir(parents=True)
    chunk, at, crcs = memoryview(b""), 0, []
    for rel, size in files:
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        crc, left = 0, size
        with open(path, "wb") as f:
            while left:
                if at == len(chunk):
                    chunk, at = next(chunks), 0
                piece = chunk[at : at + left]
                f.write(piece)
                crc, left, at = zlib.crc32(piece, crc), left - len(piece), at + len(piece)
            f.flush()
            os.fsync(f.fileno())
        crcs.append(crc)
    if at != len(chunk):
        raise DistributedError(f"{dest.name} arrived with more bytes than its file list")
    return crcs


def _json(raw: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(raw) if len(raw) <= _MAX_HEAD else None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise DistributedError(f"a transfer's {what} is not what jaxckpt sends")
    return value


def _check_files(files: object, max_bytes: int) -> list[tuple[str, int]]:
    """The sender's file list, refused unless every path stays inside and the sizes fit."""
    ok = isinstance(files, list)
    out: list[tuple[str, int]] = []
    for entry in files if isinstance(files, list) else []:
        if not (isinstance(entry, list) and len(entry) == 2):
            ok = False
            break
        rel, size = entry
        parts = rel.split("/") if isinstance(rel, str) else [""]
        if any(p in ("", ".", "..") or "\0" in p or "\\" in p for p in parts) or not (
            isinstance(size, int) and size >= 0
        ):
            ok = False
            break
        out.append((rel, size))
    if not ok or sum(s for _, s in out) > max_bytes:
        raise DistributedError("a transfer's file list is not what jaxckpt sends, or too large")
    return out


def decide(name: str, value: str, fn: Callable[[dict[int, str]], str]) -> str:
    """``fn`` of every process's ``value``, computed on process 0, returned on every process.

    Every process must call ``decide`` the same number of times in the same order (like a
    save). ``fn`` runs once; if it raises, every process raises.

    Raises:
      DistributedError: a process did not post its value within ``JAXCKPT_SYNC_TIMEOUT``.
    """
    process, count = _distributed.process_index(), _distributed.process_count()
    if count == 1:
        return fn({0: value})
    kv = _distributed.kv_client()
    timeout = _distributed.sync_timeout()
    with _lock:
        key = f"{PREFIX}/decide/{next(_decisions)}-{name}"
    kv.key_value_set(f"{key}/at/{process}", value)
    if process != 0:
        got = _get(kv, f"{key}/go", timeout + 5, f"agreeing on {name}").decode()
        if got.startswith("!"):
            raise DistributedError(got[1:])
        return got
    deadline, delay = time.monotonic() + timeout, 0.002
    while True:
        posted = {int(k.rsplit("/", 1)[1]): v for k, v in kv.key_value_dir_get(f"{key}/at/")}
        if len(posted) == count:
            break
        if time.monotonic() > deadline:
            missing = sorted(set(range(count)) - set(posted))
            message = f"agreeing on {name}: processes {missing} did not answer in {timeout:g} s"
            kv.key_value_set(f"{key}/go", "!" + message)
            raise DistributedError(message)
        time.sleep(delay)
        delay = min(delay * 1.5, _POLL_S)
    try:
        verdict = fn(posted)
    except Exception as e:
        kv.key_value_set(f"{key}/go", f"!agreeing on {name} failed on process 0: {e}")
        raise
    kv.key_value_set(f"{key}/go", verdict)
    kv.key_value_delete(f"{key}/at")
    return verdict
