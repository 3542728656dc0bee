"""The errors storage raises about a save's target: each names the path and the next step.

One place for the rules they share: what "the storage is full" looks like (:func:`is_full`,
also used by the ``CheckpointManager``), and how a save that lost a race is reported.
"""

from __future__ import annotations

import errno

from jaxckpt._errors import CheckpointError, CheckpointExistsError

_FULL_WORDS = ("No space left", "RESOURCE_EXHAUSTED", "too large", "quota exceeded")


def is_full(e: BaseException) -> bool:
    """Whether ``e`` says the storage is full: the kernel's ENOSPC/EFBIG/EDQUOT, or the words
    tensorstore and object stores use for them.

    Example:
      >>> is_full(OSError(28, "No space left on device")), is_full(ValueError("bad"))
      (True, False)
    """
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        return True
    return any(w in str(e) for w in _FULL_WORDS)


FULL_HINT = "The disk is full: free space, lower max_to_keep, or save elsewhere. "


def write_error(where: object, what: str, e: BaseException) -> CheckpointError:
    """A failed save: what failed, and (for a full disk) what to do."""
    hint = FULL_HINT if is_full(e) else ""
    return CheckpointError(
        f"Save to {where} failed {what}: {e}. {hint}Nothing was committed; the last committed "
        f"checkpoint is intact."
    )


def typed_os_error(e: BaseException, where: object) -> BaseException:
    """An OS error (e.g. ``EIO`` from a flush) as the ``CheckpointError`` a caller catches;
    any other error as it is."""
    if not isinstance(e, OSError) or isinstance(e, CheckpointError):
        return e
    err = CheckpointError(
        f"Save to {where} failed: {type(e).__name__}: {e}. Check the storage (disk errors, "
        f"permissions, free space), then save again."
    )
    err.__cause__ = e
    return err


def exists_error(where: object) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"A checkpoint already exists at {where}. Pass overwrite=True to replace it (the old "
        f"one stays intact until the new one is committed), or save to a new path."
    )


def not_ours_to_replace(where: object, name: str, *, committed: bool) -> CheckpointExistsError:
    """A save refused: ``name`` at the target is not jaxckpt's."""
    what = "a checkpoint and also" if committed else "no checkpoint but"
    return CheckpointExistsError(
        f"{where} holds {what} {name!r}, which jaxckpt did not write; jaxckpt never replaces "
        f"data it did not write, even with overwrite=True. Save to a new or empty path, or "
        f"move {name!r} away first."
    )


def not_ours_to_delete(where: object, name: str) -> CheckpointError:
    """A delete refused: ``name`` is not jaxckpt's, so ``where`` is not a single checkpoint."""
    return CheckpointError(
        f"Refusing to delete {where}: it holds {name!r}, which jaxckpt did not write, so it is "
        f"not a single checkpoint. Pass the checkpoint's own path (e.g. DIR/00000100), or "
        f"delete it by hand."
    )


def lost_error(where: object, *, committed: bool, writing: bool = False) -> CheckpointExistsError:
    """A save that lost the race to one path to another save (this save's data is gone)."""
    if writing:
        what = "another save is writing its arrays"
    elif committed:
        what = "another save committed a checkpoint"
    else:
        what = "files jaxckpt did not write appeared"
    fix = (
        "save again with overwrite=True to replace it" if committed or writing else "move them away"
    )
    return CheckpointExistsError(
        f"Save to {where} lost the race to one path: {what} there while this one was writing. "
        f"This save's own data was removed; the other's is untouched. Give each concurrent save "
        f"its own path, or {fix}."
    )
