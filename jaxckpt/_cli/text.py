"""Output helpers shared by the ``jaxckpt`` subcommands: sizes, plurals, progress, usage errors."""

from __future__ import annotations

import re
from typing import TextIO


class UsageError(Exception):
    """A mistake on the command line: exit status 2, the message on one line."""


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# The library's messages name Python arguments and calls; on the command line the same advice
# names the flag or the command to run.
_FOR_CLI = [
    (re.compile(r"\boverwrite=True\b"), "--overwrite"),
    (re.compile(r", or jaxckpt\.CheckpointManager\('[^']*'\)\.restore\(\)"), ""),
    (re.compile(r"jaxckpt\.restore\('([^']*)'\)"), r"`jaxckpt inspect \1`"),
]


def for_cli(message: str) -> str:
    """A library message as the command line says it: flags, not Python arguments.

    Example:
      >>> for_cli("Pass overwrite=True to replace it")
      'Pass --overwrite to replace it'
      >>> for_cli("e.g. the latest: jaxckpt.restore('/r/00000002'), or "
      ...         "jaxckpt.CheckpointManager('/r').restore().")
      'e.g. the latest: `jaxckpt inspect /r/00000002`.'
    """
    for pattern, replacement in _FOR_CLI:
        message = pattern.sub(replacement, message)
    return message


def plural(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


class Progress:
    """``\\r``-updated status on stderr, when it is a terminal or asked for."""

    def __init__(self, label: str, total: int, enabled: bool, stream: TextIO) -> None:
        self.label, self.total, self.done, self.stream = label, total, 0, stream
        self.enabled = enabled or stream.isatty()

    def step(self, what: str = "") -> None:
        self.done += 1
        if self.enabled:
            self.stream.write(f"\r{self.label}: {self.done}/{self.total} {what}"[:120].ljust(60))
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
