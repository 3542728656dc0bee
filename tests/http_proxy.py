"""A small HTTP reverse proxy on 127.0.0.1 for the object-store tests: a real hop between
tensorstore and a real server (moto, fake-gcs-server) that a test can make misbehave.

Each request is passed to ``rule(method, path_and_query)``, which answers one of:

* ``"pass"``: forward it and return the server's answer;
* ``"hold"``: never forward it and never answer (a request lost on a stalled link);
* ``"forward-then-hold"``: forward it (the server acts on it) but never answer (the answer lost);
* ``"forward-then-drop"``: forward it, then close the connection unanswered (the answer lost
  at once: the client sees a broken connection and retries);
* an ``int`` status (e.g. 403): answer that at once without forwarding;
* a callable ``(method, path, headers, body) -> (status, headers, body) | None``: answer for the
  server (``None``: forward as usual), e.g. to enforce a precondition an emulator ignores.

A :class:`Shaping` (``proxy.shaping``, settable at any time) makes the link slow as a real one
is: a round-trip latency per request, a rate per request's body and answer, an optional rate of
the whole link (shared by all the requests in flight), an optional cap on the requests served
at once. Every request is logged in :attr:`Proxy.log` (a :class:`Request`:
what, when it arrived and when it was answered, its bytes), from which
:func:`sequential_round_trips` counts how many requests waited one on another.

:class:`Throttle` is a rule that answers 429 with ``Retry-After`` above a request rate, as a
store that throttles does, and records when each throttled request came back.

Held requests are released (their connections closed) by :meth:`Proxy.release`, which lets
the proxy go on serving (one proxy for a whole session, its ``rule`` set per test), or
:meth:`Proxy.stop`. A callable answer may ask the server itself through :meth:`Proxy.ask`.
"""

from __future__ import annotations

import bisect
import dataclasses
import http.client
import http.server
import json
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host"}


@dataclasses.dataclass(frozen=True)
class Shaping:
    """A slow link: ``latency`` seconds added to each request (one round trip), each body and
    answer passed at ``rate`` bytes/s (``None``: at once), at most ``max_concurrent`` requests
    served at once (``None``: any number; the rest queue, as at a connection limit).

    ``link_rate``: bytes/s of the whole link in each direction (``None``: no limit), shared by
    every request, as a machine's network link is: the bodies (uploads) of all requests
    together pass at most this fast, and so do the answers (downloads). Bodies take turns in
    order of arrival, each whole, so a batch of requests is done when the link has carried all
    their bytes, as on a fairly shared link (though a small request behind a big one waits
    longer than it would over TCP). With ``rate`` too, a body passes at the slower of the two.
    """

    latency: float = 0.0
    rate: float | None = None
    max_concurrent: int | None = None
    link_rate: float | None = None


class _Link:
    """One direction of a shared link: the time until which it is busy with what it was given."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free = 0.0

    def carry(self, nbytes: int, rate: float) -> float:
        """Queue ``nbytes`` at ``rate`` bytes/s; the ``time.monotonic()`` they will have passed."""
        with self._lock:
            self._free = max(time.monotonic(), self._free) + nbytes / rate
            return self._free


@dataclasses.dataclass(frozen=True)
class Request:
    """One request the proxy answered: ``start`` when it arrived, ``end`` when its answer went
    out (``time.monotonic``, just before it is written), ``up``/``down`` the bytes of its body
    and its answer."""

    method: str
    path: str
    start: float
    end: float
    up: int
    down: int
    status: int


def sequential_round_trips(log: Sequence[Request]) -> list[Request]:
    """The longest chain of requests in ``log`` each of which arrived after the one before was
    answered: the round trips the client waited on one after another (its length is their
    count; requests issued together overlap and count once). With a latency on the link each
    round trip lasts at least that long, so requests that one waited for cannot overlap it."""
    reqs = sorted(log, key=lambda r: r.end)
    ends = [r.end for r in reqs]
    best: list[tuple[int, int]] = []  # by index in reqs: (chain length, previous index)
    top: list[int] = []  # running argmax of chain length over reqs[: i + 1]
    for r in reqs:
        k = bisect.bisect_right(ends, r.start)  # reqs[:k] ended before r arrived
        prev = top[k - 1] if k else -1
        best.append((best[prev][0] + 1 if prev >= 0 else 1, prev))
        i = len(best) - 1
        top.append(i if not top or best[i][0] > best[top[-1]][0] else top[-1])
    chain, i = [], top[-1] if top else -1
    while i >= 0:
        chain.append(reqs[i])
        i = best[i][1]
    return chain[::-1]


class _Server(http.server.ThreadingHTTPServer):
    # The default backlog (5) refuses connections when a client opens dozens at once
    # (tensorstore does, for a save's chunks); curl then retries after a back-off, which
    # would count as the link's time.
    request_queue_size = 1024

    def handle_error(self, request, client_address) -> None:
        # A client that hangs up before its answer is sent (gcsfs does, for Orbax) is its own
        # business; anything else is printed as before.
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class Proxy:
    """Forwards to ``upstream`` (``http://HOST:PORT``) by ``rule``; ``url`` is its own address."""

    def __init__(self, upstream: str, rule: Callable[[str, str], Any] | None = None) -> None:
        self.rule: Callable[[str, str], Any] = rule or (lambda method, path: "pass")
        self.seen: list[tuple[str, str, Any]] = []  # (method, path, action) of every request
        self.log: list[Request] = []  # every request answered (see Shaping)
        self.shaping = Shaping()
        self._slots: tuple[int, threading.Semaphore] | None = None
        self._up_link, self._down_link = _Link(), _Link()
        self._up = urllib.parse.urlsplit(upstream)
        self._released = threading.Event()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # The answer goes out in two writes (headers, then body): with Nagle's algorithm
            # the body waits for the client's delayed ACK of the headers (~40 ms), a delay on
            # every sequential small answer that no real object store adds.
            disable_nagle_algorithm = True

            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _any

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def _slot(self) -> threading.Semaphore | None:
        cap = self.shaping.max_concurrent
        if cap is None:
            return None
        if self._slots is None or self._slots[0] != cap:
            self._slots = (cap, threading.Semaphore(cap))
        return self._slots[1]

    def _handle(self, h: http.server.BaseHTTPRequestHandler) -> None:
        start = time.monotonic()
        slot = self._slot()
        if slot is None:
            self._shaped(h, start)
            return
        with slot:
            self._shaped(h, start)

    def _shaped(self, h: http.server.BaseHTTPRequestHandler, start: float) -> None:
        shape = self.shaping
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        if shape.latency:
            time.sleep(shape.latency)
        self._pass(shape, self._up_link, len(body))
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
        if action == "forward-then-drop":
            h.close_connection = True
            return
        self._pass(shape, self._down_link, len(answer[2]))
        # Logged as the answer goes out, not after: a client that has its answer (with Nagle's
        # delay gone, at once) finds the request in the log, and its end is no later than that.
        self.log.append(
            Request(
                h.command, h.path, start, time.monotonic(), len(body), len(answer[2]), answer[0]
            )
        )
        self._answer(h, *answer)

    @staticmethod
    def _pass(shape: Shaping, link: _Link, nbytes: int) -> None:
        """Wait while ``nbytes`` pass at the request's ``rate`` and their turn on ``link``."""
        if not nbytes or not (shape.rate or shape.link_rate):
            return
        now = time.monotonic()
        done = now + nbytes / shape.rate if shape.rate else now
        if shape.link_rate:
            done = max(done, link.carry(nbytes, shape.link_rate))
        time.sleep(max(0.0, done - time.monotonic()))

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


class Throttle:
    """A ``rule`` answering 429 (with ``Retry-After: retry_after``) to every request beyond
    ``rate`` per second (counted over the last second), as GCS and S3 throttle; ``passed``
    (a rule, default: forward) decides the rest. :attr:`early` lists the requests that came
    back sooner than the ``Retry-After`` they were given (by (method, path), the seconds)."""

    def __init__(
        self,
        rate: float,
        retry_after: float = 1.0,
        passed: Callable[[str, str], Any] | None = None,
    ) -> None:
        self.rate, self.retry_after = rate, retry_after
        self.passed = passed or (lambda method, path: "pass")
        self.throttled = 0  # answers of 429 given
        self.early: list[tuple[str, str, float]] = []
        self._times: list[float] = []  # arrivals of the requests passed in the last second
        self._told: dict[tuple[str, str], float] = {}  # when each throttled request was told
        self._lock = threading.Lock()

    def __call__(self, method: str, path: str) -> Any:
        now = time.monotonic()
        with self._lock:
            told = self._told.pop((method, path), None)
            if told is not None and now - told < self.retry_after:
                self.early.append((method, path, now - told))
            self._times = [t for t in self._times if t > now - 1.0]
            if len(self._times) >= self.rate:
                self.throttled += 1
                self._told[(method, path)] = now
                return self._answer
            self._times.append(now)
        return self.passed(method, path)

    def _answer(self, method: str, path: str, headers: Any, body: bytes) -> tuple:
        error = {"error": {"code": 429, "message": "rate limit exceeded (test throttle)"}}
        hdrs = {"Retry-After": f"{self.retry_after:g}", "Content-Type": "application/json"}
        return 429, hdrs, json.dumps(error).encode()
