"""What is at a path: a jaxckpt checkpoint, an Orbax checkpoint or safetensors weights.

:func:`open_source` picks the reader by what it finds and returns a :class:`Manifest` plus a
reader with ``_reader.Reader``'s interface, so restore's pipeline (plan -> read -> transform
-> commit -> finish) is the same for every format::

    PATH/manifest.json                      jaxckpt (checked first)
    PATH/_METADATA                          an Orbax PyTree/Standard item (see _orbax)
    PATH/_CHECKPOINT_METADATA + one item    an Orbax CheckpointManager step (its only item)
    PATH.safetensors, PATH/*.safetensors,
    PATH/model.safetensors.index.json       safetensors weights (see _safetensors)
"""

from __future__ import annotations

import os
from typing import Any

from jaxckpt._errors import CheckpointNotFoundError, ManifestError
from jaxckpt._format.manifest import MANIFEST, Manifest
from jaxckpt._storage import location as _location
from jaxckpt._storage import reader as _reader
from jaxckpt._storage import writer as _storage

MAX_INFLIGHT_BYTES = _storage.MAX_INFLIGHT_BYTES


def open_source(loc: _location.Location) -> tuple[Manifest, Any]:
    """The manifest and a reader (``read(entries, items)``) for whatever is at ``loc``.

    Raises:
      CheckpointNotFoundError: nothing jaxckpt reads is there.
      ManifestError: a foreign checkpoint's metadata is malformed, unsafe or unsupported.
    """
    from jaxckpt._sources import orbax as _orbax  # late: each is needed only for its format
    from jaxckpt._sources import safetensors as _safetensors

    try:
        raw, stamp = _location.read_stamped(loc)
    except CheckpointNotFoundError as missing:
        for module in (_orbax, _safetensors):
            try:
                found = module.open_source(loc)
            except ValueError:  # the store itself cannot be read (e.g. no such bucket)
                break
            if found is not None:
                return found
        raise missing from None
    manifest = Manifest.from_json(raw, where=f"{loc}/{MANIFEST}")
    return manifest, _reader.Reader(loc, stamp)


def source_kind(reader: Any) -> str:
    """``"jaxckpt"``, ``"orbax"`` or ``"safetensors"``: what a reader of open_source reads."""
    return getattr(reader, "kind", "jaxckpt")


def read_small(kv: Any, loc: _location.Location, name: str, limit: int) -> bytes | None:
    """The bytes of a metadata file ``name`` under ``loc`` (``None`` if absent), at most ``limit``.

    Raises:
      ManifestError: the file is larger than ``limit`` (treated as damage, never allocated).
    """
    size = None
    if loc.local is not None:
        try:
            size = os.stat(loc.local / name).st_size
        except OSError:
            return None
    if size is None or size <= limit:
        got = kv.read(name).result()
        data = got.value if got.state == "value" else None
        if data is None or len(data) <= limit:
            return data
    raise ManifestError(
        f"{loc}/{name} is larger than {limit} bytes, more than any real one: it is damaged or "
        f"not what its name says. Nothing was read."
    )
