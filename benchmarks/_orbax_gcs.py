"""Orbax on the same shaped GCS link as jaxckpt (``benchmarks/object_store.py``).

Orbax writes its arrays through tensorstore's ``gcs`` driver (``TENSORSTORE_GCS_HTTP_URL``,
the proxy) and its metadata through etils' ``epath``, which reaches ``gs://`` with gcsfs
(``STORAGE_EMULATOR_HOST``, the same proxy): both ride the one link. Needs gcsfs (the
``bench`` extra); without it ``available()`` is False and the table leaves Orbax out.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from collections.abc import Callable
from typing import Any


def available() -> bool:
    """Whether Orbax can reach ``gs://`` here (orbax-checkpoint and gcsfs installed)."""
    return all(importlib.util.find_spec(m) for m in ("orbax.checkpoint", "gcsfs"))


def one_round(store: Any, state: Any, timed: Callable[..., Any]) -> dict[str, Any]:
    """An Orbax ``StandardCheckpointer`` save (waited for) and restore of ``state`` at a fresh
    ``gs://`` path of ``store``, each timed with ``timed(store, fn)``."""
    import jax
    import orbax.checkpoint as ocp

    os.environ["STORAGE_EMULATOR_HOST"] = store.proxy.url
    url = store.url(f"orbax-{uuid.uuid4().hex[:8]}")
    ckpt = ocp.StandardCheckpointer()

    def save() -> None:
        ckpt.save(url, state)
        ckpt.wait_until_finished()

    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    saved = timed(store, save)
    restored = timed(store, lambda: ckpt.restore(url, abstract))
    ckpt.close()
    return {"orbax save": saved, "orbax restore": restored}
