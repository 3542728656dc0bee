"""The manifest: what a checkpoint holds, as frozen dataclasses and versioned JSON.

``manifest.json`` is written last and is the commit point of a checkpoint; its exact layout is
specified in ``docs/format.md``. This module owns the ``Manifest``, the format's versions and
its JSON: ``Manifest.to_json`` writes it, ``Manifest.from_json`` checks its header (format,
version) and ``manifest_check`` every other field, so that reading one never runs code or
escapes the checkpoint. The entries are ``entries``' dataclasses and their dtypes are named by
``dtypes``; the names of both that other layers use are importable from here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from jaxckpt._errors import ManifestError
from jaxckpt._format import codecs, manifest_check
from jaxckpt._format import iterators as _iterators
from jaxckpt._format import objects as _objects
from jaxckpt._format.dtypes import dtype_from_name as dtype_from_name
from jaxckpt._format.dtypes import is_supported_dtype as is_supported_dtype
from jaxckpt._format.dtypes import storage_dtype_name as storage_dtype_name
from jaxckpt._format.entries import ArrayEntry as ArrayEntry
from jaxckpt._format.entries import Entry
from jaxckpt._format.entries import PackEntry as PackEntry
from jaxckpt._format.entries import ValueEntry as ValueEntry
from jaxckpt._format.names import MANIFEST

FORMAT = "jaxckpt"
VERSION = 2  # 2 adds packed small arrays; a checkpoint without packs is still written as 1
REFS_VERSION = 3  # 3 adds references to another step's arrays (incremental, object stores)
COMPRESSION_VERSION = codecs.VERSION  # 4 adds compressed chunks ("compression")
OBJECTS_VERSION = _objects.VERSION  # 5 adds data objects ("objects": records, not chunk files)
VERSIONS = (1, 2, 3, 4, 5)  # the versions this jaxckpt reads


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Everything about a checkpoint except the array bytes."""

    tree: dict[str, Any]
    entries: dict[str, Entry]
    created: dict[str, Any] = dataclasses.field(default_factory=dict)
    version: int = VERSION
    packs: dict[str, PackEntry] = dataclasses.field(default_factory=dict)  # by path
    # Content digests of the stored boxes, by storage path then box (``manifest_check.box_key``):
    # what an incremental save compares its bytes with. Optional; readers never need them.
    digests: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    # Digests of a fixed sample of each large box, same layout: a box whose probe differs from
    # the base's changed, and is written without computing its full digest.
    probes: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    # Arrays (by storage path) whose data lives in a sibling step: ``../STEP/arrays/NAME``.
    refs: dict[str, str] = dataclasses.field(default_factory=dict)
    # The states of data iterators saved with the step, by name (``iterators``): no paths.
    iterators: dict[str, _iterators.SavedIterator] = dataclasses.field(default_factory=dict)
    # Version 5: the chunks are records in a few data objects per process (``objects``).
    objects: _objects.DataObjects | None = None

    def relocated(self, prefix: str) -> Manifest:
        """This manifest with every storage path it holds moved under ``prefix`` (an
        object-store generation ``gXXXXXXXX/``): the entries' and packs' paths and the keys of
        ``packs``, ``digests``, ``probes`` and ``refs``. A reference's target names another
        step's array and stays as it is. The one place that knows which fields hold paths.

        Example:
          >>> m = Manifest(tree={"type": "leaf", "key": "w"}, entries={"w": ArrayEntry(
          ...     "w", (2,), "float32", "float32", (2,), "arrays/w")}, digests={"arrays/w": {}})
          >>> r = m.relocated("g0a1b2c3d/")
          >>> r.entries["w"].path, list(r.digests)
          ('g0a1b2c3d/arrays/w', ['g0a1b2c3d/arrays/w'])
        """
        if not prefix:
            return self
        packs = {
            prefix + p: dataclasses.replace(e, path=prefix + e.path) for p, e in self.packs.items()
        }

        def move(e: Entry) -> Entry:
            if not isinstance(e, ArrayEntry):
                return e
            pack = None if e.pack is None else packs[prefix + e.pack.path]
            return dataclasses.replace(e, path=prefix + e.path, pack=pack)

        def rekey(d: dict[str, Any]) -> dict[str, Any]:
            return {prefix + path: v for path, v in d.items()}

        objects = self.objects
        if objects is not None:
            objects = dataclasses.replace(
                objects, folder=prefix + objects.folder, owners=rekey(objects.owners)
            )
        return dataclasses.replace(
            self,
            entries={k: move(e) for k, e in self.entries.items()},
            packs=packs,
            digests=rekey(self.digests),
            probes=rekey(self.probes),
            refs=rekey(self.refs),
            objects=objects,
        )

    def compressed(self, name: str | None) -> Manifest:
        """This manifest with every array and pack compressed with ``name`` (``codecs.CODECS``;
        ``None``: as it is), and the version that says so. Packed arrays point at their
        compressed pack and have no codec of their own."""
        if name is None:
            return self
        packs = {p: dataclasses.replace(e, compression=name) for p, e in self.packs.items()}

        def one(e: Entry) -> Entry:
            if not isinstance(e, ArrayEntry):  # an inline value
                return e
            if e.pack is not None:
                return dataclasses.replace(e, pack=packs[e.pack.path])
            return dataclasses.replace(e, compression=name)

        return dataclasses.replace(
            self,
            entries={k: one(e) for k, e in self.entries.items()},
            packs=packs,
            version=max(self.version, COMPRESSION_VERSION),
        )

    def to_json(self) -> bytes:
        """``manifest.json``'s bytes: one line per top-level field and per entry."""
        # One line per top-level field and per entry: readable with `less`, diffable, and
        # encoded by json's C encoder (indent= would switch to the much slower Python one).
        dump = functools.partial(json.dumps, allow_nan=False)
        head = {
            "format": FORMAT,
            "version": self.version,
            "created": self.created,
            "tree": self.tree,
        }
        if self.packs:
            head["packs"] = {p: _pack_to_json(e) for p, e in self.packs.items()}
        if self.refs:
            head["refs"] = self.refs
        if self.digests:
            head["digests"] = self.digests
        if self.probes:
            head["probes"] = self.probes
        if self.objects is not None:
            head["objects"] = self.objects.to_json()
        if self.iterators:
            head["iterators"] = {n: it.to_json() for n, it in self.iterators.items()}
        lines = [f" {dump(k)}: {dump(v)}," for k, v in head.items()]
        entries = ",\n".join(
            f"  {dump(k)}: {dump(_entry_to_json(e))}" for k, e in self.entries.items()
        )
        return ("{\n" + "\n".join(lines) + '\n "entries": {\n' + entries + "\n }\n}\n").encode()

    @classmethod
    def from_json(cls, data: bytes, where: str = MANIFEST) -> Manifest:
        """Parse and validate ``manifest.json``; nothing in it can run code or escape.

        The header (format, version) is checked here, every other field by
        ``manifest_check.fields_from_json``.
        """
        try:
            doc = json.loads(data)
        except RecursionError:  # nested deeper than the decoder allows: never a real tree
            raise ManifestError(
                f"{where}: nested too deeply to be a jaxckpt manifest. The checkpoint is "
                f"damaged or was not written by jaxckpt: restore an earlier one, or re-save."
            ) from None
        except (ValueError, UnicodeDecodeError) as e:
            raise ManifestError(
                f"{where} is not valid JSON ({e}). The checkpoint is damaged: restore an "
                f"earlier one, or re-save."
            ) from e
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ManifestError(f'{where} is not a jaxckpt manifest (no "format": "{FORMAT}").')
        version = doc.get("version")
        if type(version) is not int or version not in VERSIONS:
            raise ManifestError(
                f"{where} has format version {version!r}; this jaxckpt reads version "
                f"{' or '.join(map(str, VERSIONS))}. Upgrade jaxckpt to read newer checkpoints."
            )
        fields = manifest_check.fields_from_json(
            doc,
            where,
            with_packs=version >= 2,
            with_refs=version >= REFS_VERSION,
            with_compression=version >= COMPRESSION_VERSION,
        )
        objects = None
        if version >= OBJECTS_VERSION and "objects" in doc:
            stored = {e.path: e for e in storage_entries_of(fields.entries, fields.packs).values()}
            objects = _objects.from_json(doc["objects"], stored, where)
        return cls(
            tree=fields.tree,
            entries=fields.entries,
            created=fields.created,
            version=version,
            packs=fields.packs,
            digests=fields.digests,
            probes=fields.probes,
            refs=fields.refs,
            iterators=_iterators.from_json(doc.get("iterators", {}), where),
            objects=objects,
        )


def storage_entries(manifest: Manifest) -> dict[str, ArrayEntry]:
    """What storage writes: every unpacked array, and each pack as a 1-D array (by key)."""
    return storage_entries_of(manifest.entries, manifest.packs)


def storage_entries_of(
    entries: dict[str, Entry], packs: dict[str, PackEntry]
) -> dict[str, ArrayEntry]:
    """:func:`storage_entries` of a manifest's entries and packs."""
    out = {k: e for k, e in entries.items() if isinstance(e, ArrayEntry) and e.pack is None}
    out.update((p.key, p.as_array()) for p in packs.values())
    return out


def _entry_to_json(e: Entry) -> dict[str, Any]:
    if isinstance(e, ValueEntry):
        v = e.value
        if isinstance(v, float):  # repr round-trips exactly and spells nan/inf
            return {"kind": "value", "type": "float", "value": repr(v)}
        if isinstance(v, complex):  # each part as a float
            return {"kind": "value", "type": "complex", "value": [repr(v.real), repr(v.imag)]}
        kind = "none" if v is None else type(v).__name__
        return {"kind": "value", "type": kind, "value": v}
    d: dict[str, Any] = {
        "kind": "array",
        "shape": list(e.shape),
        "dtype": e.dtype,
        "storage_dtype": e.storage_dtype,
        "chunks": list(e.chunks),
        "path": e.path,
        "checksum": e.checksum,
    }
    if e.pack is not None:
        d["offset"] = e.offset
    if e.compression:
        d["compression"] = e.compression
    if e.prng_impl:
        d["prng_impl"] = e.prng_impl
    if e.sharding:
        d["sharding"] = e.sharding
    return d


def _pack_to_json(p: PackEntry) -> dict[str, Any]:
    d: dict[str, Any] = {
        "shape": [p.size],
        "storage_dtype": p.storage_dtype,
        "chunks": [p.chunks],
        "checksum": p.checksum,
    }
    if p.compression:
        d["compression"] = p.compression
    return d
