"""A small HTTP reverse proxy on 127.0.0.1 for the object-store tests: a real hop between
tensorstore and a real server (moto, fake-gcs-server) that a test can make misbehave.

Each request is passed to ``rule(method, path_and_query)``, which answers one of:

* ``"pass"``: forward it and return the server's answer;
* ``"hold"``: never forward it and never answer (a request lost on a stalled link);
* ``"forward-then-hold"``: forward it (the server acts on it) but never answer (the answer lost);
* an ``int`` status (e.g. 403): answer that at once without forwarding;
* a callable ``(method, path, headers, body) -> (status, headers, body) | None``: answer for the
  server (``None``: forward as usual), e.g. to enforce a precondition an emulator ignores.

Held requests are released (their connections closed) by :meth:`Proxy.release`, which lets
the proxy go on serving (one proxy for a whole session, its ``rule`` set per test), or
:meth:`Proxy.stop`. A callable answer may ask the server itself through :meth:`Proxy.ask`.
"""

from __future__ import annotations

import http.client
import http.server
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any

_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host"}


class Proxy:
    """Forwards to ``upstream`` (``http://HOST:PORT``) by ``rule``; ``url`` is its own address."""

    def __init__(self, upstream: str, rule: Callable[[str, str], Any] | None = None) -> None:
        self.rule: Callable[[str, str], Any] = rule or (lambda method, path: "pass")
        self.seen: list[tuple[str, str, Any]] = []  # (method, path, action) of every request
        self._up = urllib.parse.urlsplit(upstream)
        self._released = threading.Event()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _any

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def _handle(self, h: http.server.BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        action = self.rule(h.command, h.path)
        self.seen.append((h.command, h.path, action))
        released = self._released  # the release that ends this request's hold
        if action == "hold":
            released.wait()
            h.close_connection = True
            return
        if isinstance(action, int):
            self._answer(h, action, {}, b"")
            return
        try:
            answer = action(h.command, h.path, h.headers, body) if callable(action) else None
            if answer is None:
                answer = self._forward(h, body)
        except OSError:  # the server is unreachable (stopped first): drop, as it would
            h.close_connection = True
            return
        if action == "forward-then-hold":
            released.wait()
            h.close_connection = True
            return
        self._answer(h, *answer)

    def _forward(self, h: http.server.BaseHTTPRequestHandler, body: bytes) -> tuple:
        return self.ask(h.command, h.path, body, dict(h.headers.items()))

    def ask(
        self, method: str, path: str, body: bytes = b"", headers: dict | None = None
    ) -> tuple[int, dict, bytes]:
        """Send one request to the server (not through ``rule``); its (status, headers, body)."""
        conn = http.client.HTTPConnection(self._up.hostname, self._up.port, timeout=120)
        sent = {k: v for k, v in (headers or {}).items() if k.lower() not in _HOP}
        sent["Host"] = self._up.netloc
        conn.request(method, path, body=body if body or method != "GET" else None, headers=sent)
        r = conn.getresponse()
        data = r.read()
        conn.close()
        return r.status, {k: v for k, v in r.getheaders() if k.lower() not in _HOP}, data

    @staticmethod
    def _answer(h: http.server.BaseHTTPRequestHandler, status: int, headers: dict, body: bytes):
        h.send_response(status)
        for k, v in headers.items():
            if k.lower() != "content-length":
                h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)

    def release(self) -> None:
        """Release every request held so far (their connections close); later ones hold anew."""
        released, self._released = self._released, threading.Event()
        released.set()

    def stop(self) -> None:
        self._released.set()
        self._server.shutdown()
        self._server.server_close()
