"""This process's memory as Linux reports it (``/proc/self``), for the benchmarks' RSS rows."""

from __future__ import annotations


def vm(field: str) -> int:
    """A ``Vm*`` line of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
