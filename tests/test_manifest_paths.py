"""Every storage path a manifest holds moves together: ``Manifest.relocated`` (issue 41.1).

An object-store save into a prefix that holds anything writes its arrays under a generation
``gXXXXXXXX/`` and moves every path of its manifest there before the commit. A field left
behind makes the committed manifest name arrays that do not exist (before this rule had one
place, ``digests`` was left behind and an overwrite lost both checkpoints). The property test
builds manifests with every path-keyed field filled, and a field added to ``Manifest`` later
must be classified here first.
"""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxckpt._format.manifest import ArrayEntry, Manifest, PackEntry, ValueEntry
from jaxckpt._format.manifest_check import box_key
from jaxckpt._format.names import is_storage_path
from jaxckpt._format.objects import DataObjects

PATHS = {"entries", "packs", "digests", "probes", "refs", "objects"}  # hold storage paths
OTHER = {"tree", "created", "version", "iterators"}  # iterators: JSON states, no paths

_name = st.text("abcdefghij_.-0123456789", min_size=1, max_size=12).filter(
    lambda s: is_storage_path(f"arrays/{s}")
)
_hex = st.text("0123456789abcdef", min_size=32, max_size=32)
_gen = st.text("0123456789abcdef", min_size=8, max_size=8).map(lambda h: f"g{h}/")


@st.composite
def manifests(draw) -> Manifest:
    names = draw(st.lists(_name, min_size=1, max_size=6, unique_by=str.lower))
    packed = draw(st.integers(0, len(names)))
    pack = PackEntry(
        "arrays/pack.float32.0", size=4 * packed or 1, storage_dtype="float32", chunks=1
    )
    entries: dict = {}
    for i, n in enumerate(names):
        if i < packed:
            entries[n] = ArrayEntry(
                n, (4,), "float32", "float32", (4,), pack.path, pack=pack, offset=4 * i
            )
        else:
            entries[n] = ArrayEntry(n, (4,), "float32", "float32", (2,), f"arrays/{n}")
    entries["v"] = ValueEntry("v", 1)
    stored = [e.path for e in entries.values() if isinstance(e, ArrayEntry) and not e.pack]
    stored += [pack.path] if packed else []
    box = box_key((0,), (4,))
    digests = {p: {box: draw(_hex)} for p in stored if draw(st.booleans())}
    probes = {p: {box: draw(_hex)} for p in stored if draw(st.booleans())}
    own = [p for p in stored if p != pack.path]
    refs = {p: f"../00000001/{p}" for p in own if draw(st.booleans())}
    tree = {
        "type": "dict",
        "keys": sorted(entries),
        "children": [{"type": "leaf", "key": k} for k in sorted(entries)],
    }
    objects = None
    if draw(st.booleans()):  # version 5: every stored array's chunks in data objects
        grids = {p: 2 for p in stored if p != pack.path} | (
            {pack.path: 4 * packed} if packed else {}
        )
        objects = DataObjects("data", 1, 1 << 20, {p: ((0, n),) for p, n in grids.items()})
    return Manifest(
        tree=tree,
        entries=entries,
        packs={pack.path: pack} if packed else {},
        digests=digests,
        probes=probes,
        refs=refs,
        version=5 if objects else 3 if refs else 2,
        objects=objects,
    )


def test_every_manifest_field_is_classified():
    assert {f.name for f in dataclasses.fields(Manifest)} == PATHS | OTHER, (
        "a new Manifest field: does it hold storage paths? Classify it here and move it in "
        "Manifest.relocated"
    )


def _paths(m: Manifest) -> dict[str, set[str]]:
    """Every storage path of ``m``, by field."""
    arrays = {e.path for e in m.entries.values() if isinstance(e, ArrayEntry)}
    arrays |= {e.pack.path for e in m.entries.values() if isinstance(e, ArrayEntry) and e.pack}
    return {
        "entries": arrays,
        "packs": set(m.packs) | {p.path for p in m.packs.values()},
        "digests": set(m.digests),
        "probes": set(m.probes),
        "refs": set(m.refs),
        "objects": set() if m.objects is None else {m.objects.folder, *m.objects.owners},
    }


@settings(max_examples=200, deadline=None)
@given(m=manifests(), gen=_gen)
def test_relocated_moves_every_path_and_parses(m, gen):
    Manifest.from_json(m.to_json())  # a valid manifest to begin with
    moved = Manifest.from_json(m.relocated(gen).to_json())
    before, after = _paths(m), _paths(moved)
    assert set(after) == PATHS
    for field in PATHS:
        assert after[field] == {gen + p for p in before[field]}, field
    assert moved.refs == {gen + p: t for p, t in m.refs.items()}  # targets name other steps
    assert moved.relocated("") == moved
