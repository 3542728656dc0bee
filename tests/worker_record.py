"""What a process of a test group (tests/groups.py) reports: each named check's outcome and
any data, rewritten atomically after each check so a killed process leaves what it reached."""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path


class Record:
    def __init__(self, out: Path) -> None:
        self.out, self.checks, self.data = out, {}, {}
        self.flush()

    @property
    def result(self) -> dict:
        return {"checks": self.checks, "data": self.data}

    def flush(self) -> None:
        tmp = self.out.with_suffix(".part")
        tmp.write_text(json.dumps(self.result))
        os.replace(tmp, self.out)

    def run(self, name: str, fn) -> None:
        try:
            fn()
            self.checks[name] = "ok"
        except BaseException:  # noqa: BLE001 - recorded for the test to report
            self.checks[name] = traceback.format_exc()
        self.flush()
