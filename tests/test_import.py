"""What importing jaxckpt does to the process (issue 62): it changes no environment variable,
and tensorstore's curl stall timeout, which jaxckpt no longer sets, still works when the user
sets it (docs/object_storage.md, "Abandoned requests")."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_and_a_save_change_no_environment_variable():
    code = (
        "import json, os\n"
        "before = dict(os.environ)\n"
        "import importlib, pkgutil, jaxckpt\n"
        "for m in pkgutil.walk_packages(jaxckpt.__path__, 'jaxckpt.'):\n"  # every module
        "    if m.name != 'jaxckpt.__main__':\n"
        "        importlib.import_module(m.name)\n"
        "after_import = dict(os.environ)\n"
        "jaxckpt.save('memory://env/1', {'w': [1.0, 2.0], 'step': 1})\n"
        "jaxckpt.restore('memory://env/1')\n"
        "print(json.dumps([before, after_import, dict(os.environ)]))\n"
    )
    full = {k: v for k, v in os.environ.items() if not k.startswith("TENSORSTORE_CURL_")}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**full, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    before, after_import, after_save = json.loads(done.stdout.splitlines()[-1])
    assert after_import == before
    assert after_save == before


class _Silent:
    """A TCP server on 127.0.0.1 that accepts connections and never answers: records how long
    each connection stayed open before the client closed it."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.lived: list[float] = []  # seconds from accept to the client's close
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._drain, args=(conn,), daemon=True).start()

    def _drain(self, conn: socket.socket) -> None:
        opened = time.monotonic()
        with conn:
            try:
                while conn.recv(65536):
                    pass
            except OSError:
                pass
        with self._lock:
            self.lived.append(time.monotonic() - opened)


# A client that gives up one read at its deadline (1 s), then lives LINGER s more.
LINGER = 8
_CLIENT = f"""
import time, jaxckpt
try:
    jaxckpt.metadata("s3://silent-bucket/run/1")
except jaxckpt.CheckpointError as e:
    assert "did not finish within" in str(e), e
    print("deadline missed", flush=True)
time.sleep({LINGER})
"""


def _abandoned_connections(curl_env: dict[str, str]) -> list[float]:
    """How long each connection of a client whose read missed its deadline stayed open."""
    server = _Silent()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORSTORE_CURL_")}
    env.pop("AWS_ENDPOINT_URL_S3", None)
    env.update(
        PYTHONPATH=str(ROOT),
        JAXCKPT_IO_TIMEOUT="1",
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{server.port}",
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_REGION="us-east-1",
        **curl_env,
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CLIENT], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
        assert "deadline missed" in done.stdout, done.stdout
        time.sleep(0.5)  # the last close seen
        assert server.lived, "the client never connected"
        return sorted(server.lived)
    finally:
        server.sock.close()


def test_an_abandoned_request_lingers_unless_the_user_sets_curls_stall_timeout():
    """Without the TENSORSTORE_CURL_LOW_SPEED_* variables (jaxckpt no longer sets them),
    jaxckpt's deadline still fails the read, but its connection stays open until the process
    ends; with them, set by the user as docs/object_storage.md says, curl drops it at once."""
    lived = _abandoned_connections({})
    assert lived[0] > LINGER - 1, lived  # open until the client exited
    stall = {
        "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES": "1",
        "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS": "1",
    }
    lived = _abandoned_connections(stall)
    assert lived[0] < LINGER / 2, lived  # dropped after 1 s of silence (and retried)


def _modules_after(code: str) -> dict:
    """Runs ``code`` (which sets ``rc``) in a fresh process; the jax modules loaded then."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, sys\n"
            + code
            + "\nprint(json.dumps({'rc': rc, 'jax': sorted(m for m in sys.modules"
            " if m == 'jax' or m.startswith(('jax.', 'jaxlib')))}))",
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_version_inspect_and_ls_import_no_jax(tmp_path):
    import numpy as np

    import jaxckpt

    run = tmp_path / "run"
    with jaxckpt.CheckpointManager(run, async_save=False) as mgr:
        mgr.save(1, {"w": np.arange(4.0), "b": np.ones((2, 3), np.int32)}, metrics={"loss": 1.0})
    ckpt = str(run / "00000001")
    for argv in (
        ["--version"],
        ["inspect", ckpt],
        ["inspect", ckpt, "--json"],
        ["ls", str(run)],
        ["ls", str(run), "--json", "--best", "loss"],
    ):
        got = _modules_after(f"from jaxckpt._cli.main import main\nrc = main({argv!r})")
        assert got == {"rc": 0, "jax": []}, argv
    # a command that restores arrays imports jax when it runs, and works
    got = _modules_after(f"from jaxckpt._cli.main import main\nrc = main(['verify', {ckpt!r}])")
    assert got["rc"] == 0 and "jax" in got["jax"]


def test_import_jaxckpt_imports_jax_on_first_use_of_a_name_that_needs_it(tmp_path):
    # the package and --version need not even numpy
    code = "import jaxckpt\nrc = jaxckpt.__version__ and ('numpy' in sys.modules)"
    assert _modules_after(code) == {"rc": False, "jax": []}
    code = "from jaxckpt._cli.main import main\nrc = main(['--version']) or 'numpy' in sys.modules"
    assert _modules_after(code) == {"rc": False, "jax": []}
    code = (
        "import jaxckpt\n"
        "from jaxckpt import CheckpointError, Manifest\n"  # loaded with the package
        "assert 'jax' not in sys.modules\n"
        "from jaxckpt import save\n"  # the first name that needs jax loads every one
        f"save({str(tmp_path / 'c')!r}, {{'w': [1.0]}})\n"
        "assert set(jaxckpt.__all__) <= set(vars(jaxckpt)) and set(jaxckpt.__all__) <= set(dir(jaxckpt))\n"
        "try:\n    jaxckpt.no_such_name\nexcept AttributeError as e:\n    rc = 0 if 'no_such_name' in str(e) else 1\n"
    )
    got = _modules_after(code)
    assert got["rc"] == 0 and "jax" in got["jax"]


class _SilentOnce(_Silent):
    """Silent on its first connection; answers every request of later ones 404 (no such key)."""

    def _drain(self, conn: socket.socket) -> None:
        with self._lock:
            first = not getattr(self, "_had_one", False)
            self._had_one = True
        if first:
            return super()._drain(conn)
        with conn:
            data = b""
            try:
                while True:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                    while b"\r\n\r\n" in data:  # one request (no body): one answer
                        _, data = data.split(b"\r\n\r\n", 1)
                        conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            except OSError:
                return


_AFTER_A_STALL = """
import jaxckpt
for _ in range(2):
    try:
        jaxckpt.metadata("s3://silent-bucket/run/1")
    except jaxckpt.CheckpointNotFoundError:
        print("answered", flush=True)
    except jaxckpt.CheckpointError as e:
        assert "did not finish within" in str(e), e
        print("deadline missed", flush=True)
"""


def test_a_request_abandoned_at_its_deadline_does_not_block_later_ones():
    """With one request slot (JAXCKPT_REQUEST_CONCURRENCY=1) and no curl stall timeout, the
    request abandoned at its deadline keeps its slot; the next operation goes out on fresh
    queues and gets the server's answer instead of missing its own deadline behind it."""
    server = _SilentOnce()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORSTORE_CURL_")}
    env.pop("AWS_ENDPOINT_URL_S3", None)
    env.update(
        PYTHONPATH=str(ROOT),
        JAXCKPT_IO_TIMEOUT="1",
        JAXCKPT_REQUEST_CONCURRENCY="1",
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{server.port}",
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_REGION="us-east-1",
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", _AFTER_A_STALL],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        server.sock.close()
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["deadline missed", "answered"], done.stdout
