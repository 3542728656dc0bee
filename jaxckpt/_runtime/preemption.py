"""Preemption: notice a SIGTERM and agree, across processes, on the step to save at.

A scheduler that evicts a job (a spot VM, a TPU maintenance event, ``kill``) first sends
SIGTERM and waits a grace period. Nothing may be saved from inside a signal handler (the
training step may be halfway through updating, or donating, the state), so the handler only
sets a flag; the training loop asks :meth:`PreemptionWatcher.reached` at every step and saves
when it says so, between steps, where the state is whole.

* One process (no ``jax.distributed``): a SIGTERM handler sets the flag, and the step at which
  the loop next asks is the step to save at.
* Several processes: all of them must save the *same* step, so the answer comes from JAX's
  preemption sync manager (``multihost_utils.reached_preemption_sync_point``), which hears the
  notice on any host and picks a step every host has not yet passed. jaxckpt installs no
  handler of its own there, since it would replace the one JAX's notifier relies on.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import jax

from jaxckpt._errors import CheckpointError


class PreemptionWatcher:
    """Turns a SIGTERM (or JAX's multi-host preemption notice) into "save at this step".

    Args:
      signals: the signals that announce a preemption (single process only).

    Raises:
      CheckpointError: created outside the main thread on a single process (Python lets
        only the main thread install signal handlers).
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)) -> None:
        self._flag = threading.Event()
        self._previous: dict[signal.Signals, Any] = {}
        self._last: tuple[int, bool] | None = None
        self.multihost = jax.distributed.is_initialized()
        if self.multihost:
            return
        if threading.current_thread() is not threading.main_thread():
            raise CheckpointError(
                "save_on_preemption=True needs a SIGTERM handler, and Python installs signal "
                "handlers only from the main thread. Create the CheckpointManager in the main "
                "thread, or pass save_on_preemption=False and save on your own signal."
            )
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        del signum, frame
        self._flag.set()  # nothing else: the loop saves at its next step

    def reached(self, step: int) -> bool:
        """Whether ``step`` is the step to save at before the process is stopped.

        Asks JAX's sync manager at most once per step (every process must ask at every step).
        """
        if self._last is not None and self._last[0] == step:
            return self._last[1]
        if self.multihost:
            from jax.experimental import multihost_utils

            hit = bool(multihost_utils.reached_preemption_sync_point(step))
        else:
            hit = self._flag.is_set()
        self._last = (step, hit)
        return hit

    def close(self) -> None:
        """Put back the signal handlers that were there before."""
        for sig, previous in self._previous.items():
            if previous is not None:
                signal.signal(sig, previous)
        self._previous.clear()
