"""Throttling is slowness, not failure: what this process knows of a store answering "slow down".

Object stores answer a client over their request rate with 429 (GCS), 503 ``SlowDown`` (S3)
or a plain 503, often with ``Retry-After``. tensorstore retries those answers itself, with the
policy ``jaxckpt._storage.urls.retries`` gives it (exponential backoff with jitter, the first
retry no sooner than its initial delay, which covers the ``Retry-After: 1`` stores send:
tensorstore does not read the header). Between the retries jaxckpt sees nothing of the
request, so its deadlines (``jaxckpt._storage.location.wait``) would take a throttled store for
a dead one. :func:`answers` counts the throttling answers this process has had, from
tensorstore's own HTTP metrics: a deadline is counted from the last of them too, as from any
other answer (a store that answers, even "slow down", is not dead).
"""

from __future__ import annotations

import tensorstore as ts

# The HTTP statuses of a store asking its client to slow down (S3's SlowDown is a 503).
THROTTLED = (429, 503)
_METRIC = "/tensorstore/http/response_codes"


def answers() -> int:
    """How many throttling answers (:data:`THROTTLED`) this process's HTTP requests have had.

    Example:
      >>> answers() >= 0
      True
    """
    found = ts.experimental_collect_matching_metrics(_METRIC)
    total = 0
    for metric in found:
        for value in metric.get("values", ()):
            if _code(value) in THROTTLED:
                total += int(value.get("value", 0))
    return total


def _code(value: dict[str, object]) -> int | None:
    code = value.get("code")
    try:
        return int(str(code))
    except ValueError:
        return None
