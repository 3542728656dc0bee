"""A collective call made on one process alone says so at once.

Some calls meet every process at the coordination service: ``jaxckpt.save`` and
``save_async`` (``jaxckpt._runtime.distributed.SaveSync``), a restore onto arrays of several
processes (``jaxckpt._runtime.shared_restore``), and the manager's saves, deletes, rollbacks and
local-tier decisions (``jaxckpt._runtime.agreement``). A process that makes one alone (the
others never come) would wait ``JAXCKPT_SYNC_TIMEOUT`` (600 s by default) in silence. Instead
its first wait for the others logs once, :data:`NOTICE_S` seconds in, on the waiting process
(:class:`Notice`): which call, that every process must make it, and whom it waits for. The
deadline error says the same (:func:`must_be_collective`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

logger = logging.getLogger("jaxckpt")
NOTICE_S = 2.0  # a first wait for the others this long is logged once: maybe a call made alone


def must_be_collective(call: str) -> str:
    """What a deadline error says of ``call``.

    Example:
      >>> must_be_collective("jaxckpt.save(/c)")
      'jaxckpt.save(/c) is a collective call: it must be called on every process'
    """
    return f"{call} is a collective call: it must be called on every process"


def processes(procs: Iterable[int]) -> str:
    """``procs`` as messages name them (at most 16 shown).

    Example:
      >>> processes([3]), processes([17, 3])
      ('process 3', 'processes [3, 17]')
    """
    procs = sorted(procs)
    shown = ", ".join(map(str, procs[:16])) + (", ..." if len(procs) > 16 else "")
    return f"process {shown}" if len(procs) == 1 else f"processes [{shown}]"


class Notice:
    """Logs once, on the first wait of ``call`` for the others that lasts :data:`NOTICE_S`.

    Args:
      call: the call as users wrote it, with its path or step (``jaxckpt.save(/ckpt/7)``).
      deadline: the seconds the wait may last, named in the log line.
      quiet: never log (a wait that is not the call's first: every process has called it).

    Example:
      >>> n = Notice("jaxckpt.save(/c)", 600)
      >>> n.check("process 1")  # too early: nothing logged
      >>> 0 < n.left() <= NOTICE_S
      True
    """

    def __init__(self, call: str, deadline: float, quiet: bool = False) -> None:
        self.call, self.deadline = call, deadline
        self.start = time.monotonic()
        self.given = quiet

    def left(self) -> float:
        """Seconds until the notice is due (a wait should not block past it); ``inf`` once
        given."""
        return float("inf") if self.given else max(self.start + NOTICE_S - time.monotonic(), 0)

    def check(self, waiting_for: str) -> None:
        """Log the notice if it is due: this process waits for ``waiting_for`` (e.g.
        ``"processes [1, 2] to call it"``)."""
        if self.given or time.monotonic() - self.start < NOTICE_S:
            return
        self.given = True
        logger.warning(
            "%s is a collective call: every process must make it; waiting for %s "
            "(%.0f s so far, deadline %g s: JAXCKPT_SYNC_TIMEOUT)",
            self.call,
            waiting_for,
            time.monotonic() - self.start,
            self.deadline,
        )
