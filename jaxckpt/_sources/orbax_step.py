"""Orbax paths as users pass them: an item, a ``CheckpointManager`` step, a step's JSON item.

A ``CheckpointManager`` step is ``STEP/_CHECKPOINT_METADATA`` (JSON naming each item's
handler) plus one folder per item::

    STEP/state/_METADATA   a PyTree/Standard item (StandardSave): arrays, read by :mod:`.orbax`
    STEP/metadata/metadata a JSON item (JsonSave): one JSON document, read as its value
    STEP/other/...         another handler's item: not read (a ManifestError names it)

A step with one item is read as that item; with several, its error names the item that holds
the arrays. A JSON item, passed by its folder, restores as its JSON value (dicts, lists and
scalars, as ``json.load`` gives them). A step is committed once Orbax has renamed it into
place (its temporary name holds ``.orbax-checkpoint-tmp``) or, on object stores, written
``commit_success.txt``.
"""

from __future__ import annotations

from typing import Any

from jaxckpt._errors import ManifestError
from jaxckpt._format.entries import Entry
from jaxckpt._format.manifest import Manifest, ValueEntry
from jaxckpt._format.manifest_check import MAX_DEPTH
from jaxckpt._format.names import SEP
from jaxckpt._sources import orbax as _orbax
from jaxckpt._sources.orbax_metadata import CHECKPOINT_METADATA, METADATA
from jaxckpt._storage import location as _location

JSON_FILE = "metadata"  # the file name JsonCheckpointHandler writes by default
COMMIT_FILE = "commit_success.txt"
_TMP = ".orbax-checkpoint-tmp"
_MAX_JSON_ITEM = 64 << 20
_ARRAY_HANDLERS = ("StandardCheckpointHandler", "PyTreeCheckpointHandler")
_JSON_HANDLERS = ("JsonCheckpointHandler",)


def open_source(loc: _location.Location) -> tuple[Manifest, _orbax.OrbaxReader] | None:
    """The manifest and reader for an Orbax item, step or step's item at ``loc``, or ``None``.

    Raises:
      ManifestError: the metadata is damaged, or names what jaxckpt does not read (a step of
        several items, another handler's item); the message says which item to restore.
    """
    if loc.local is not None and not loc.local.is_dir():
        return None
    kv = _location.kvstore(loc.kvstore)
    raw = _orbax.read_json(kv, loc, METADATA)
    if raw is not None:
        return _orbax.open_item(loc, kv, raw)
    step = _orbax.read_json(kv, loc, CHECKPOINT_METADATA)
    if step is not None:
        return _open_step(loc, step)
    up = _parent(loc)
    if up is None:
        return None
    parent, name = up
    try:
        handlers = _handlers(parent)
    except ManifestError:  # not an Orbax step: loc is nothing jaxckpt reads
        return None
    return _open_item(loc, handlers[name]) if name in handlers else None


def _open_step(loc: _location.Location, step: Any) -> tuple[Manifest, _orbax.OrbaxReader]:
    handlers = step.get("item_handlers") if isinstance(step, dict) else None
    if not isinstance(handlers, dict) or not handlers:
        raise ManifestError(
            f'{loc}/{CHECKPOINT_METADATA} names no items (no "item_handlers" object). The '
            f"Orbax step is damaged or of a layout jaxckpt does not know: restore one of its "
            f"item folders, e.g. jaxckpt.restore('{_below(loc, 'default')}')."
        )
    names = sorted(str(n) for n in handlers)
    bad = [n for n in names if not _is_name(n)]
    if bad:
        raise ManifestError(
            f"{loc}/{CHECKPOINT_METADATA} names an item {bad[0][:100]!r}, which is no folder name."
        )
    if len(names) == 1:
        return _open_item(loc.join(names[0]), handlers[names[0]])
    arrays = [n for n in names if _kind(loc.join(n), handlers[n]) == "arrays"]
    json_items = [n for n in names if _kind(loc.join(n), handlers[n]) == "json"]
    pick = arrays[0] if arrays else names[0]
    also = (
        f" The JSON item(s) {json_items} restore as their JSON value by their folder too, "
        f"e.g. jaxckpt.restore('{_below(loc, json_items[0])}')."
        if json_items
        else ""
    )
    which = (
        f"the arrays are in {pick!r}: restore that item"
        if len(arrays) == 1
        else (f"the arrays are in {arrays}: restore one item" if arrays else "restore one item")
    )
    raise ManifestError(
        f"{loc} is an Orbax CheckpointManager step with items {names}; {which} by its folder, "
        f"e.g. jaxckpt.restore('{_below(loc, pick)}').{also}"
    )


def _below(loc: _location.Location, name: str) -> str:
    """``loc``/``name`` as the user spelled ``loc``, for a message."""
    return f"{str(loc).rstrip('/')}/{name}"


def _handlers(step: _location.Location) -> dict[str, Any]:
    """The item handlers that the step at ``step`` names (``{}`` if it is no Orbax step)."""
    doc = _orbax.read_json(_location.kvstore(step.kvstore), step, CHECKPOINT_METADATA)
    handlers = doc.get("item_handlers") if isinstance(doc, dict) else None
    return handlers if isinstance(handlers, dict) else {}


def _is_name(name: str) -> bool:
    return bool(name) and "/" not in name and "\0" not in name and name not in (".", "..")


def _kind(item: _location.Location, handler: Any) -> str:
    """``"arrays"``, ``"json"`` or ``"other"``: by the handler's name, else by the files."""
    name = str(handler).rsplit(".", 1)[-1]
    if name in _ARRAY_HANDLERS:
        return "arrays"
    if name in _JSON_HANDLERS:
        return "json"
    kv = _location.kvstore(item.kvstore)
    found = _exists(item) and _orbax.listed(item, kv, METADATA, METADATA + "\0")
    return "arrays" if found else "other"


def _exists(loc: _location.Location) -> bool:
    return loc.local is None or loc.local.is_dir()


def _open_item(item: _location.Location, handler: Any) -> tuple[Manifest, _orbax.OrbaxReader]:
    kind = _kind(item, handler)
    kv = _location.kvstore(item.kvstore)
    if kind == "json":
        value = _orbax.read_json(kv, item, JSON_FILE, _MAX_JSON_ITEM)
        if value is None:
            raise ManifestError(
                f"{item} is an Orbax JSON item (JsonSave) without its file {JSON_FILE!r}: it was "
                f"saved under another file name, or not finished. Read it with json.load, or "
                f"restore another step."
            )
        return json_manifest(item, value), _orbax.OrbaxReader(item, {})
    raw = _orbax.read_json(kv, item, METADATA) if kind == "arrays" else None
    if raw is not None:
        return _orbax.open_item(item, kv, raw)
    name = str(handler).rsplit(".", 1)[-1] if handler else "an unknown handler"
    missing = f" but has no {METADATA} (an unfinished save?)" if kind == "arrays" else ""
    raise ManifestError(
        f"{item} is an Orbax item of {name}{missing}, which jaxckpt does not read (it reads "
        f"PyTree/Standard items, a folder with {METADATA}, and JSON items). Restore it with "
        f"orbax-checkpoint, or restore the other items by their folders."
    )


def json_manifest(item: _location.Location, value: Any) -> Manifest:
    """The manifest of an Orbax JSON item holding ``value`` (what ``json.loads`` gave): its
    dicts and lists as the tree, its scalars and strings as values; pure.

    Raises:
      ManifestError: a dict key that cannot be a key path part ('', or holding '/'), or
        nesting deeper than a jaxckpt tree.
    """
    entries: dict[str, Entry] = {}
    tree = _json_node(item, value, "", entries, 0)
    return Manifest(tree=tree, entries=entries, created={"source": "orbax", "item": "json"})


def _json_node(
    item: _location.Location, v: Any, key: str, entries: dict[str, Entry], depth: int
) -> dict[str, Any]:
    if depth > MAX_DEPTH:
        raise _bad_json(item, f"is nested deeper than {MAX_DEPTH} levels")
    if isinstance(v, dict):
        bad = [k for k in v if not k or SEP in k or "\0" in k]
        if bad:
            where = f" under {key!r}" if key else ""
            raise _bad_json(
                item, f"has the key {bad[0][:100]!r}{where}, which no key path can name"
            )
        keys = list(v)
    elif isinstance(v, list):
        keys = [str(i) for i in range(len(v))]
    else:
        entries[key] = ValueEntry(key, v)
        return {"type": "leaf", "key": key}
    values = list(v.values()) if isinstance(v, dict) else v
    kids = [
        _json_node(item, child, f"{key}{SEP}{k}" if key else k, entries, depth + 1)
        for k, child in zip(keys, values)
    ]
    if isinstance(v, dict):
        return {"type": "dict", "keys": keys, "children": kids}
    return {"type": "list", "children": kids}


def _bad_json(item: _location.Location, what: str) -> ManifestError:
    return ManifestError(
        f"{item}/{JSON_FILE}: this Orbax JSON item {what}. Read it with json.load instead."
    )


def _parent(loc: _location.Location) -> tuple[_location.Location, str] | None:
    """The folder above ``loc`` and ``loc``'s name in it (``None`` at a root or bucket)."""
    if loc.local is not None:
        return (_location.Location(loc.local.parent), loc.local.name) if loc.local.name else None
    scheme, _, rest = loc.url.partition("://")
    head, _, name = rest.rstrip("/").rpartition("/")
    return (_location.Location(f"{scheme}://{head}"), name) if head and name else None


def is_committed_step(loc: _location.Location) -> bool:
    """Whether ``loc`` is an Orbax step (or item) that Orbax finished saving."""
    name = loc.local.name if loc.local is not None else loc.url.rstrip("/").rsplit("/", 1)[-1]
    if _TMP in name or not _exists(loc):
        return False
    kv = _location.kvstore(loc.kvstore)
    if not any(_orbax.listed(loc, kv, f, f + "\0") for f in (CHECKPOINT_METADATA, METADATA)):
        return False
    return loc.local is not None or _orbax.listed(loc, kv, COMMIT_FILE, COMMIT_FILE + "\0")
