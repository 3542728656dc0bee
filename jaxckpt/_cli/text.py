"""Output helpers shared by the ``jaxckpt`` subcommands: sizes, plurals, usage errors, whether
progress shows (``jaxckpt._runtime.progress`` draws it)."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable

from jaxckpt._planning.display import plural as plural  # one rule, one place
from jaxckpt._runtime.progress import human_bytes as human_bytes


class UsageError(Exception):
    """A mistake on the command line: exit status 2, the message on one line."""


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# The library's messages name Python arguments and calls; on the command line the same advice
# names the flag or the command to run.
_FOR_CLI: list[tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]]] = [
    (re.compile(r"\boverwrite=True\b"), "--overwrite"),
    (re.compile(r", or jaxckpt\.CheckpointManager\('[^']*'\)\.restore\(\)"), ""),
    (re.compile(r"jaxckpt\.restore\('([^']*)'\)"), r"`jaxckpt inspect \1`"),
    (re.compile(r"\blocal_directory '([^']*)'"), r"--local \1"),
    # keys=['a', 'b/c'] (the list a selection repeats) -> --keys a b/c
    (re.compile(r"\bkeys=\[((?:'[^']*'(?:, )?)*)\]"), lambda m: "--keys " + _unquoted(m[1])),
]


def _unquoted(items: str) -> str:
    return " ".join(re.findall(r"'([^']*)'", items))


def for_cli(message: str) -> str:
    """A library message as the command line says it: flags, not Python arguments.

    Example:
      >>> for_cli("Pass overwrite=True to replace it")
      'Pass --overwrite to replace it'
      >>> for_cli("e.g. the latest: jaxckpt.restore('/r/00000002'), or "
      ...         "jaxckpt.CheckpointManager('/r').restore().")
      'e.g. the latest: `jaxckpt inspect /r/00000002`.'
      >>> for_cli("keys=['nosuchkey', 'opt/mu'] match no key in the checkpoint.")
      '--keys nosuchkey opt/mu match no key in the checkpoint.'
    """
    for pattern, replacement in _FOR_CLI:
        message = pattern.sub(replacement, message)
    return message


def progress_arg(asked: bool) -> bool | None:
    """The CLI's progress: shown when asked (``--progress``) or when stderr is a terminal."""
    return True if asked or sys.stderr.isatty() else None
