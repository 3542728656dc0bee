"""Which run a local tier directory belongs to.

The first manager on a persistent directory stores a random run id in it (``RUN_FILE``); the
local tier of that run lives in ``LOCAL_DIR/jaxckpt-<run>/``, with a marker (``MARKER``) naming
the run and its persistent directory for people. A local directory of another run (or of an
earlier run into a persistent directory since deleted) is never used and never deleted.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path

from jaxckpt._errors import CheckpointError
from jaxckpt._storage import location as _location

RUN_FILE = "local-tier.json"  # in the persistent directory
MARKER = "run.json"
_RUN = re.compile(r"[0-9a-f]{16}")


def run_id(persistent: _location.Location) -> str:
    """The run's id, stored in the persistent directory; made there by the first manager."""
    kv = _location.kvstore(persistent.kvstore)
    got = kv.read(RUN_FILE).result()
    if got.state != "value":
        fresh = json.dumps({"format": 1, "run": uuid.uuid4().hex[:16]}).encode()
        # only if still absent (the read's generation is "no value"): a racing one wins
        kv.write(RUN_FILE, fresh, if_equal=got.stamp.generation).result()
        got = kv.read(RUN_FILE).result()
    try:
        run = json.loads(got.value)["run"]
        if isinstance(run, str) and _RUN.fullmatch(run):
            return run
    except (ValueError, KeyError, TypeError):
        pass
    raise CheckpointError(
        f"{persistent}/{RUN_FILE} is not jaxckpt's (it names the run of the local tier). Move "
        f"it away, or use another persistent directory."
    )


def write_marker(path: Path, run: str, persistent: str) -> None:
    """Write ``LOCAL_DIR/jaxckpt-<run>/run.json`` (``path``), which names the run and its
    persistent directory, unless it already says so."""
    raw = json.dumps({"format": 1, "run": run, "persistent": persistent}, indent=1).encode()
    if path.is_file() and path.read_bytes() == raw:
        return
    tmp = path.with_name(f".{MARKER}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_bytes(raw)
    os.replace(tmp, path)
