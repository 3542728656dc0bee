"""Names jaxckpt makes on storage: the arrays' storage paths and the hidden staging siblings.

One rule per kind of name, used by every side that makes or checks one:

* **storage paths** ``arrays/NAME``: the save side makes them with :func:`storage_name`, the
  restore side accepts them with :func:`is_storage_path`. A generated NAME is ASCII letters,
  digits, ``_``, ``.`` and ``-`` only (so no Unicode normalisation can change it), at most
  :data:`MAX_NAME` bytes (far below the 255-byte file name limit), unique ignoring case (safe
  on case-insensitive file systems), and a pure function of the key paths in tree order (every
  process of a multi-host save, and the plan cache, compute the same names).
* **staging names** ``.NAME.tmp-TAG``: the hidden sibling a local save writes into, and a
  delete renames into; long NAMEs are shortened and hashed so the name always fits.
  :func:`parse_staging` recognises them (and their ``-old``/``-deleted`` forms).
* **step names** ``00000100``: a ``CheckpointManager`` step, zero-padded to :data:`STEP_DIGITS`
  digits so that ``ls`` lists them in order; :func:`step_name` makes one, :func:`parse_step`
  accepts exactly those (a folder ``100`` is not step 100).
* **what jaxckpt wrote** inside a checkpoint: :func:`is_own_key` (``manifest.json``,
  ``arrays/``, an object-store generation's ``gXXXXXXXX/arrays/`` and ``gXXXXXXXX/writer.json``,
  ``writer.json`` and ``held-by/NAME``). An overwrite or a delete removes nothing else.
"""

from __future__ import annotations

import hashlib
import os
import re
import string

ARRAYS = "arrays"
MANIFEST = "manifest.json"  # the commit: a checkpoint is a folder or prefix holding one
SEP = "/"  # joins the parts of a key path: "params/w"
TMP = ".tmp-"  # marks a save's (or a delete's) hidden sibling: .NAME.tmp-XXXXXXXX
MAX_NAME = 200  # bytes of a generated storage name, de-duplication suffix included
FILE_NAME_BYTES = 255  # the usual limit on one file name (ext4, xfs, btrfs, APFS, NTFS)
SUFFIX_ROOM = len("-deleted")  # what may be appended to a staging name (e.g. "-old")
LOCK_SUFFIX = ".__lock"  # tensorstore's file driver reserves names ending in this
STEP_DIGITS = 8  # step folders are zero-padded to this many digits
WRITER = "writer.json"  # an object-store save in progress: who writes, and when it last said so
DATA = "data"  # DATA/PROCESS.K: format v5's data objects (jaxckpt._format.objects)
HELD_BY = "held-by"  # HELD_BY/NAME: the arrays sibling step NAME references in this checkpoint

_SAFE = frozenset(string.ascii_letters + string.digits + "_.-")
_STEM = 180  # characters kept of a key before its hash: 180 + "-" + 8 + "-NNNNNNN" < MAX_NAME
# arrays/NAME, or gXXXXXXXX/arrays/NAME for a generation written by an object-store overwrite.
# Everything jaxckpt ever wrote matches, so old checkpoints keep reading.
_PATH_RE = re.compile(r"(g[0-9a-f]{8}/)?arrays/[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")  # fullmatch


def storage_name(key: str, taken: set[str]) -> str:
    """The storage path under ``arrays/`` for the array at ``key``; records it in ``taken``.

    A key whose parts are already safe keeps its spelling (``"params/w"`` ->
    ``arrays/params.w``). Any other key is spelled safely and gets 8 hex digits of its hash,
    so that distinct keys rarely need the de-duplication suffix (``-1``, ``-2``, ... in tree
    order), which resolves every remaining clash, also clashes that differ only in case.

    Args:
      key: the key path (``"/"``-joined).
      taken: the lower-cased names already given in this checkpoint; updated.

    Returns:
      ``"arrays/NAME"``, which :func:`is_storage_path` accepts.

    Example:
      >>> taken = set()
      >>> storage_name("params/w", taken), storage_name("Params/W", taken)
      ('arrays/params.w', 'arrays/Params.W-1')
      >>> storage_name("ünï©ødé", taken)
      'arrays/_n___d_-cd219d66'
    """
    plain = key.replace("/", ".")
    safe = "".join(c if c in _SAFE else "_" for c in plain)
    safe = re.sub(r"\.{2,}", ".", safe).lstrip(".-").rstrip(".")
    if not safe or safe != plain or len(safe) > _STEM or safe.endswith(LOCK_SUFFIX):
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        safe = f"{safe[:_STEM].rstrip('.') or '_'}-{digest}"
    base = name = f"{ARRAYS}/{safe}"
    n = 1
    while name.lower() in taken:
        name, n = f"{base}-{n}", n + 1
    taken.add(name.lower())
    return name


def is_storage_path(path: object) -> bool:
    """Whether a manifest's storage ``path`` is one jaxckpt writes: inside ``arrays/``.

    Example:
      >>> is_storage_path("arrays/params.w"), is_storage_path("arrays/../../etc")
      (True, False)
    """
    return isinstance(path, str) and bool(_PATH_RE.fullmatch(path)) and ".." not in path


_STEP_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}"
_REF_RE = re.compile(
    rf"\.\./{_STEP_NAME}/(g[0-9a-f]{{8}}/)?arrays/[A-Za-z0-9_][A-Za-z0-9_.-]{{0,254}}"
)


def is_reference(path: object) -> bool:
    """Whether ``path`` names an array of a sibling step: ``../STEP/arrays/NAME`` (what an
    incremental step on an object store records instead of copying an unchanged array).

    Example:
      >>> is_reference("../00000100/arrays/w"), is_reference("../../etc/arrays/w")
      (True, False)
    """
    return isinstance(path, str) and bool(_REF_RE.fullmatch(path))


def staging_name(name: str, tag: str) -> str:
    """The hidden sibling ``.NAME.tmp-TAG`` of ``name``, short enough for any legal name.

    It leaves :data:`SUFFIX_ROOM` bytes free under the 255-byte limit for a suffix such as
    ``-old``; a longer NAME is cut (at a character boundary) and followed by ``~`` and 8 hex
    digits of its hash. Both forms contain ``.tmp-``, the mark of jaxckpt's temporaries.

    Example:
      >>> staging_name("ckpt", "0a1b2c3d")
      '.ckpt.tmp-0a1b2c3d'
      >>> len(staging_name("x" * 255, "0a1b2c3d"))
      247
    """
    plain = f".{name}{TMP}{tag}"
    limit = FILE_NAME_BYTES - SUFFIX_ROOM
    if len(os.fsencode(plain)) <= limit:
        return plain
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:8]
    room = limit - len(os.fsencode(f".~{digest}{TMP}{tag}"))
    short = name
    while len(os.fsencode(short)) > room:
        short = short[:-1]
    return f".{short}~{digest}{TMP}{tag}"


_STEP_NAME_RE = re.compile(rf"[0-9]{{{STEP_DIGITS},20}}")
_STAGING_RE = re.compile(r"\.(.+)" + re.escape(TMP) + r"([0-9a-f]{8})(-old|-deleted)?")
_GENERATION = r"g[0-9a-f]{8}/"
_OWN_KEY_RE = re.compile(
    rf"({_GENERATION})?(arrays/.+|{DATA}/[0-9]+\.[0-9]+|{re.escape(WRITER)})"
    rf"|{re.escape(HELD_BY)}/{_STEP_NAME}"
)


def step_name(step: int) -> str:
    """The folder of ``step`` in a ``CheckpointManager`` directory.

    Example:
      >>> step_name(100), step_name(123456789)
      ('00000100', '123456789')
    """
    return f"{step:0{STEP_DIGITS}d}"


def parse_step(name: str) -> int | None:
    """The step a folder ``name`` holds, or ``None`` if ``name`` is not exactly
    ``step_name(step)`` (``"100"`` and ``"000000100"`` are no steps: one step, one name).

    Example:
      >>> parse_step("00000100"), parse_step("100"), parse_step(".00000100.tmp-0a1b2c3d")
      (100, None, None)
    """
    if not _STEP_NAME_RE.fullmatch(name):
        return None
    step = int(name)
    return step if step_name(step) == name else None


def part_name(process: int, count: int) -> str:
    """The folder of process ``process``'s part (of ``count``) in a local step."""
    return f"part-{process}-of-{count}"


_PART_RE = re.compile(r"part-([0-9]+)-of-([0-9]+)")


def parse_part(name: str) -> tuple[int, int] | None:
    """``(process, count)`` of a part's folder ``name``; ``None`` for any other name.

    Example:
      >>> parse_part("part-1-of-4"), parse_part(".part-1-of-4.tmp-0a1b2c3d")
      ((1, 4), None)
    """
    m = _PART_RE.fullmatch(name)
    return None if m is None else (int(m[1]), int(m[2]))


def parse_staging(name: str) -> tuple[str, str, str] | None:
    """``(NAME, TAG, suffix)`` of a hidden sibling ``.NAME.tmp-TAG`` (``suffix``: ``""``,
    ``"-old"`` for a checkpoint an overwrite moved aside, ``"-deleted"`` for one being
    deleted), or ``None`` for any other name. NAME is as written (shortened if it was long).

    Example:
      >>> parse_staging(".00000100.tmp-0a1b2c3d-old"), parse_staging("00000100")
      (('00000100', '0a1b2c3d', '-old'), None)
    """
    m = _STAGING_RE.fullmatch(name)
    return None if m is None else (m[1], m[2], m[3] or "")


def is_own_key(key: str) -> bool:
    """Whether ``key`` (relative to a checkpoint; ``/`` separated) is one jaxckpt writes there.

    Example:
      >>> [is_own_key(k) for k in ("manifest.json", "arrays/w/c/0", "g0a1b2c3d/writer.json",
      ...                         "held-by/00000002", "notes.txt", "manifest.json\\n", "g0a1b2c3d/data/3.0")]
      [True, True, True, True, False, False, True]
    """
    return key == MANIFEST or bool(_OWN_KEY_RE.fullmatch(key))
