"""What is at a path: a jaxckpt checkpoint, an Orbax checkpoint or safetensors weights.

:func:`open_source` picks the reader by what it finds and returns a :class:`Manifest` plus a
reader of the ``jaxckpt._storage.reader.Reader`` protocol, so restore's pipeline (plan -> read -> transform
-> commit -> finish) is the same for every format::

    PATH/manifest.json                      jaxckpt (checked first)
    PATH/_METADATA                          an Orbax PyTree/Standard item (see orbax)
    PATH/_CHECKPOINT_METADATA + one item    an Orbax CheckpointManager step (its only item)
    STEP/ITEM/metadata                      an Orbax step's JSON item (see orbax_step)
    PATH.safetensors, PATH/*.safetensors,
    PATH/model.safetensors.index.json       safetensors weights (see _safetensors)
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxckpt._errors import CheckpointError, CheckpointNotFoundError
from jaxckpt._format.manifest import Manifest, storage_entries
from jaxckpt._format.names import ARRAYS, DATA, MANIFEST, is_own_key
from jaxckpt._storage import catalog as _catalog
from jaxckpt._storage import location as _location
from jaxckpt._storage import objects as _objects
from jaxckpt._storage import reader as _reader


def open_source(loc: _location.Location) -> tuple[Manifest, _reader.Reader]:
    """The manifest and a reader (``read(entries, items)``) for whatever is at ``loc``.

    On object stores this reads the manifest and nothing else: no listing (the reads' own
    answers say what is missing).

    Raises:
      CheckpointNotFoundError: nothing jaxckpt reads is there.
      ManifestError: a foreign checkpoint's metadata is malformed, unsafe or unsupported.
    """
    from jaxckpt._sources import orbax_step as _orbax  # late: each is needed only for its format
    from jaxckpt._sources import safetensors as _safetensors

    if loc.name == MANIFEST:  # CKPT/manifest.json: the checkpoint is the folder holding it
        loc = loc.parent()
    try:
        raw, stamp = _location.read_stamped(loc)
    except CheckpointNotFoundError:
        for open_format in (_orbax.open_source, _safetensors.open_source):
            try:
                found: tuple[Manifest, _reader.Reader] | None = open_format(loc)
            except ValueError:  # the store itself cannot be read (e.g. no such bucket)
                break
            if found is not None:
                return found
        raise _not_found(loc) from None
    manifest = Manifest.from_json(raw, where=f"{loc}/{MANIFEST}")
    marked = manifest.created.get("held_by") is True
    records = None
    if manifest.objects is not None:  # format v5: boxes are byte ranges of data objects
        stored = {e.path: e for e in storage_entries(manifest).values()}
        records = _objects.RecordReader.of(loc, manifest.objects, stored)
    reader = _reader.CheckpointReader(
        loc,
        stamp,
        manifest.refs,
        marked=marked,
        records=records,
    )
    return manifest, reader


_LOOKED_FOR = (
    "a jaxckpt checkpoint (manifest.json), an Orbax checkpoint (_METADATA or "
    "_CHECKPOINT_METADATA) or safetensors weights (*.safetensors, model.safetensors.index.json)"
)


def _not_found(loc: _location.Location) -> CheckpointNotFoundError:
    """What is at ``loc`` instead of a checkpoint, and what jaxckpt looked for."""
    run = _run_directory_error(loc)
    if run is not None:
        return run
    if loc.local is None:
        return _not_found_in_store(loc)
    path = loc.local
    if not path.exists() and not path.is_symlink():
        return CheckpointNotFoundError(
            f"{path} does not exist. Check the path (a CheckpointManager's steps are "
            f"DIR/00000100, ...)."
        )
    if path.suffix == ".npz" and path.is_file():
        return CheckpointNotFoundError(
            f"{path} is an .npz archive (what `jaxckpt export` writes, for numpy.load), not a "
            f"checkpoint: restore or convert the checkpoint it was exported from."
        )
    if not path.is_dir():
        return CheckpointNotFoundError(
            f"{path} is a file, not a checkpoint: jaxckpt looked for {_LOOKED_FOR}. Pass the "
            f"folder a save wrote (or the .safetensors file)."
        )
    if (path / ARRAYS).is_dir() or (path / DATA).is_dir():
        return CheckpointNotFoundError(
            f"No checkpoint at {path}: {MANIFEST} is missing, so this is an unfinished or failed "
            f"save (a save writes its manifest last). Restore a committed checkpoint instead."
        )
    return CheckpointNotFoundError(
        f"{path} is a folder without a checkpoint: jaxckpt looked for {_LOOKED_FOR}. Pass the "
        f"folder a save wrote."
    )


def _is_data_object(key: str) -> bool:
    """Whether ``key`` is a format v5 data object (``data/P.K``, maybe in a generation)."""
    return DATA in key.split("/")[:2] and is_own_key(key)


def _not_found_in_store(loc: _location.Location) -> CheckpointNotFoundError:
    try:
        keys = _catalog.list_keys(loc)
    except CheckpointError as e:  # no such bucket, no access
        return CheckpointNotFoundError(f"No checkpoint at {loc}: {e}")
    if any(_catalog.array_of(k) or _is_data_object(k) for k in keys):
        return CheckpointNotFoundError(
            f"No checkpoint at {loc}: {MANIFEST} is missing, so this is an unfinished or failed "
            f"save (a save writes its manifest last). Restore a committed checkpoint instead."
        )
    what = "nothing is there" if not keys else "nothing there is a checkpoint"
    return CheckpointNotFoundError(
        f"No checkpoint at {loc}: {what} (jaxckpt looked for {_LOOKED_FOR}). Check the URL."
    )


def _run_directory_error(loc: _location.Location) -> CheckpointNotFoundError | None:
    """What to say when ``loc`` is a local directory of numbered checkpoints (the steps of a
    ``CheckpointManager``) rather than one; ``None`` when it is not."""
    if loc.local is None or not loc.local.is_dir():
        return None  # an object store would have to be listed whole: keep the plain message
    from jaxckpt._sources import orbax_step as _orbax  # late, as in open_source

    steps = [
        name
        for name, ok in _catalog.children(loc)
        if name.isdigit() and (ok or _orbax.is_committed_step(loc.join(name)))
    ]
    if not steps:
        return None
    nums = [int(n) for n in steps]
    few: Sequence[int | str] = nums
    if len(nums) > 8:
        few = [*nums[:3], "...", *nums[-3:]]
    shown = ", ".join(map(str, few))
    manager = f", or jaxckpt.CheckpointManager({str(loc)!r}).restore()"
    return CheckpointNotFoundError(
        f"{loc} is a run directory (e.g. of a CheckpointManager), not a checkpoint: it holds "
        f"{len(nums)} committed step(s): [{shown}]. Use one step, e.g. the latest: "
        f"jaxckpt.restore({str(loc.join(steps[-1]))!r})"
        f"{manager if len(steps[-1]) == 8 else ''}."  # the manager's names: 8 digits
    )
