"""Progress of long work (save, restore, verify, convert, export, diff): bytes done, rate, time
left, shown by one implementation.

A call that may run for minutes takes ``progress=``: ``None``/``False`` (the library's default:
nothing is shown), ``True`` (a bar on stderr: tqdm's, through ``tqdm.auto`` so that a notebook
gets its widget, when tqdm is installed; else one plain line redrawn with ``\\r``), or a
callable ``fn(done_bytes, total_bytes)`` called as the work goes (also at the end). The command
line passes ``True`` when stderr is a terminal (or with ``--progress``).

The hot path is :meth:`Progress.add`, once per chunk or box: an addition and, a few times a
second at most, a redraw. tqdm is optional (the ``test`` extra installs it): a missing tqdm,
or a notebook without ipywidgets, falls back to the plain line.

May import: the standard library only (``tqdm`` when present).
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

ProgressArg = bool | Callable[[int, int], None] | None
_REDRAW_S = 0.25  # the plain line and callbacks: at most this often (and at the end)


def check_arg(progress: Any, call: str) -> ProgressArg:
    """``progress`` as given, or a ``TypeError`` naming ``call``'s argument.

    Example:
      >>> check_arg(True, "save"), check_arg(None, "save")
      (True, None)
    """
    if progress is None or isinstance(progress, bool) or callable(progress):
        return progress  # type: ignore[no-any-return]
    raise TypeError(
        f"{call}: progress must be True, False, None or a callable fn(done_bytes, total_bytes); "
        f"got a {type(progress).__name__}."
    )


def human_bytes(n: float) -> str:
    """``n`` bytes as people read them.

    Example:
      >>> human_bytes(512), human_bytes(3 << 20)
      ('512 B', '3.0 MiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{int(n)} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


def _clock(seconds: float) -> str:
    s = int(seconds)
    return (
        f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
    )


class Progress:
    """Bytes done out of ``total`` for the work named ``label``; see the module docstring.

    Example:
      >>> import io
      >>> seen = []
      >>> p = Progress("verify", 100, lambda done, total: seen.append((done, total)))
      >>> p.add(40); p.add(60); p.finish()
      >>> seen[-1]
      (100, 100)
      >>> line = Progress("verify", 2048, True, stream=io.StringIO(), use_tqdm=False)
      >>> line.add(1024); line.close()
      >>> "verify: 1.0/2.0 KiB (50%)" in line.stream.getvalue().replace("\\r", "")
      True
    """

    def __init__(
        self,
        label: str,
        total: int,
        progress: ProgressArg,
        *,
        stream: TextIO | None = None,
        use_tqdm: bool = True,
    ) -> None:
        self.label, self.total, self.done = label, max(0, int(total)), 0
        self.stream = stream if stream is not None else sys.stderr
        self.callback = None if isinstance(progress, bool) or progress is None else progress
        self.shown = progress is True
        self.t0 = self.last = time.monotonic()
        self.drawn = self.closed = False
        self.bar: Any = (
            _tqdm_bar(label, self.total, self.stream) if self.shown and use_tqdm else None
        )

    @property
    def active(self) -> bool:
        """Whether anything is shown or called (else :meth:`add` only counts)."""
        return self.shown or self.callback is not None

    def add(self, nbytes: int) -> None:
        """Count ``nbytes`` more done (once per chunk or box)."""
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
            return
        if self.callback is None and not self.shown:
            return
        now = time.monotonic()
        if now - self.last >= _REDRAW_S:
            self.last = now
            self._report(now)

    def _report(self, now: float) -> None:
        if self.callback is not None:
            self.callback(self.done, self.total)
        elif self.shown:
            self.stream.write(f"\r{self.line(now)}".ljust(72))
            self.stream.flush()
            self.drawn = True

    def line(self, now: float | None = None) -> str:
        """The plain progress line: bytes done and total, percent, rate, time left."""
        elapsed = (time.monotonic() if now is None else now) - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        pct = 100 * self.done / self.total if self.total else 100.0
        done, total = human_bytes(self.done), human_bytes(self.total)
        unit = total.split()[1]
        if done.split()[1] == unit and unit != "B":  # "1.0/2.0 KiB": one unit for both
            done = done.split()[0]
        left = (self.total - self.done) / rate if rate > 0 else None
        eta = "" if left is None else f", {_clock(left)} left"
        return f"{self.label}: {done}/{total} ({pct:.0f}%), {human_bytes(rate)}/s{eta}"

    def finish(self) -> None:
        """The work is done: count what was skipped (linked, known equal) as done, then close."""
        if self.bar is not None and self.total > self.done:
            self.bar.update(self.total - self.done)
        self.done = max(self.done, self.total)
        self.close()

    def close(self) -> None:
        """The last report (a callback sees ``done == total`` after :meth:`finish`); ends the
        line. Once only: a second call does nothing."""
        if self.closed:
            return
        self.closed = True
        if self.bar is not None:
            self.bar.close()
            return
        if self.callback is not None or self.shown:
            self._report(time.monotonic())
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tqdm_bar(label: str, total: int, stream: TextIO) -> Any:
    """A tqdm bar in bytes (``tqdm.auto``: a widget in a notebook), or ``None`` without tqdm
    (or without the widgets a notebook bar needs)."""
    try:  # by name: tqdm ships no type information, and may be absent
        tqdm = importlib.import_module("tqdm.auto").tqdm
    except ImportError:
        return None
    try:
        return tqdm(
            total=total,
            desc=label,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=stream,
            leave=True,
            dynamic_ncols=True,
        )
    except ImportError:  # tqdm.notebook without ipywidgets
        return None
