"""The zarr v3 array of a manifest entry: the spec tensorstore opens it with
(:func:`array_spec`), and the ``zarr.json`` tensorstore writes when it creates it
(:func:`zarr_json`). The writer creates and opens arrays with them, the reader and
``jaxckpt verify`` open them; the manifest alone decides both, so no ``zarr.json`` is read
first.
"""

from __future__ import annotations

import json
from typing import Any

import tensorstore as ts

from jaxckpt._format import codecs as _codecs
from jaxckpt._format.manifest import ArrayEntry, dtype_from_name


def array_spec(kvstore: dict[str, Any], entry: ArrayEntry) -> dict[str, Any]:
    codecs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if entry.compression is not None:  # the manifest checked the name
        itemsize = dtype_from_name(entry.storage_dtype).itemsize
        codecs.append(_codecs.zarr_codec(entry.compression, itemsize))
    if entry.checksum == "crc32c":
        codecs.append({"name": "crc32c"})
    return {
        "driver": "zarr3",
        "kvstore": kvstore,
        "metadata": {
            "shape": list(entry.shape),
            "data_type": entry.storage_dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(entry.chunks)}},
            "codecs": codecs,
        },
    }


_ZARR_JSON: dict[str, bytes] = {}  # by the array spec's metadata (as JSON)


def zarr_json(entry: ArrayEntry) -> bytes:
    """The ``zarr.json`` tensorstore writes when it creates ``entry``'s array (made once per
    kind of array, in memory): written beside the data on object stores, where the arrays are
    opened from the manifest's metadata without a round trip."""
    spec = array_spec({"driver": "memory"}, entry)
    key = json.dumps(spec["metadata"], sort_keys=True)
    data = _ZARR_JSON.get(key)
    if data is None:
        scratch = ts.Context()
        ts.open(spec, create=True, context=scratch).result()
        got = ts.KvStore.open({"driver": "memory"}, context=scratch).result().read("zarr.json")
        if len(_ZARR_JSON) >= 4096:  # one per shape: bounded for runs of many shapes
            _ZARR_JSON.clear()
        data = _ZARR_JSON[key] = got.result().value
    return data
