"""The exception hierarchy of jaxckpt.

Every error a user can meet is a :class:`CheckpointError`; each message says what was
expected, what was found, where (path, key, chunk) and what to do about it::

    CheckpointError
    ├── CheckpointNotFoundError   no committed checkpoint at the path
    ├── CheckpointExistsError     a checkpoint is there and overwrite=False
    ├── InvalidArgumentError      an argument's value is out of range (also a ValueError)
    ├── ArgumentTypeError         an argument is of the wrong type (also a TypeError)
    ├── ManifestError             manifest.json is malformed, unsafe or of an unknown version
    ├── KeyMismatchError          missing / unexpected keys under strict=True
    ├── ShapeMismatchError        target shape differs from the saved shape
    ├── DtypeMismatchError        target dtype differs and casting was not asked for
    ├── UnsupportedLeafError      a leaf jaxckpt cannot store
    ├── CorruptChunkError         a chunk fails its checksum or is missing
    │   └── CheckpointChangedError    the checkpoint was replaced while it was being read
    ├── PlanValidationError       a save plan is out of bounds, overlaps or leaves gaps
    └── DistributedError          processes disagree, time out, or one of them failed
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error raised by jaxckpt."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint (a directory with ``manifest.json``) exists at the path."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A checkpoint already exists at the path and ``overwrite=False``."""


class InvalidArgumentError(CheckpointError, ValueError):
    """An argument's value is out of range (``max_to_keep=-1``, ``best_mode="median"``, a
    negative step); the message names the argument and what it takes. Also a ``ValueError``,
    so ``except ValueError`` catches it as before."""


class ArgumentTypeError(CheckpointError, TypeError):
    """An argument is of a type the call does not take (a float step, an iterator without
    ``get_state()``); the message names the argument and what it takes. Also a
    ``TypeError``."""


class ManifestError(CheckpointError):
    """``manifest.json`` cannot be trusted: malformed, unsafe, or of an unknown version."""


class KeyMismatchError(CheckpointError, KeyError):
    """Keys of the target and the checkpoint differ under ``strict=True``."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ShapeMismatchError(CheckpointError, ValueError):
    """A target leaf's shape differs from the saved shape."""


class DtypeMismatchError(CheckpointError, TypeError):
    """A target leaf's dtype differs from the saved dtype and casting was not asked for."""


class UnsupportedLeafError(CheckpointError, TypeError):
    """A leaf of the tree is of a type jaxckpt cannot store."""


class CorruptChunkError(CheckpointError):
    """Chunk data is missing or fails its checksum."""


class CheckpointChangedError(CorruptChunkError):
    """The checkpoint was overwritten while it was read; retrying reads the new one whole."""


class PlanValidationError(CheckpointError, ValueError):
    """A global save plan is invalid (out of bounds, overlapping, incomplete, mixed dtypes)."""


class DistributedError(CheckpointError):
    """Processes disagree on the plan, miss a deadline, or one of them failed."""
