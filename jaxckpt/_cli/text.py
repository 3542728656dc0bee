"""Output helpers shared by the ``jaxckpt`` subcommands: sizes, plurals, usage errors, whether
progress shows (``jaxckpt._runtime.progress`` draws it), and the JSON every ``--json`` prints."""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable
from typing import Any

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
    (re.compile(r"\bbest='([^']*)'"), r"--best \1"),
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


# A float JSON cannot spell, as every --json output writes it (docs/cli.md, *JSON output*):
# the strings protobuf's JSON mapping uses, which float() in Python, Number() in JavaScript and
# strconv.ParseFloat in Go read back.
NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def strict(doc: Any) -> Any:
    """``doc`` with every NaN or infinite float (at any depth) as its string in
    :data:`NON_FINITE`; tuples become lists.

    Example:
      >>> strict({"loss": float("nan"), "max": [1.5, float("-inf")]})
      {'loss': 'NaN', 'max': [1.5, '-Infinity']}
    """
    if isinstance(doc, float):
        return doc if math.isfinite(doc) else NON_FINITE[repr(doc)]
    if isinstance(doc, dict):
        return {k: strict(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [strict(v) for v in doc]
    return doc


def json_text(doc: Any) -> str:
    """``doc`` as RFC 8259 JSON, as every ``--json`` output prints it: never a ``NaN`` or
    ``Infinity`` literal (JavaScript's ``JSON.parse`` and Go's encoding/json refuse those), but
    the strings of :func:`strict`.

    Example:
      >>> print(json_text({"max_abs": float("inf")}))
      {
       "max_abs": "Infinity"
      }
    """
    return json.dumps(strict(doc), indent=1, allow_nan=False)
