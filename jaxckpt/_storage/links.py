"""Hard links of an incremental save: a box the base already holds becomes links to its files.

A link is another name for the same file: deleting the base later leaves the new checkpoint
whole, and a write never changes a linked file (tensorstore replaces files by rename). Only
regular files reached through real folders of the base are linked, so nothing outside the
base becomes part of a step.
"""

from __future__ import annotations

import os
import stat

from jaxckpt._format.grid import chunk_key, chunks_touching


class Linker:
    """Links the chunk files of boxes of a base checkpoint (a folder) into a staging folder.

    Args:
      base: the base checkpoint's folder.
      staging: the folder the new checkpoint is written into.
    """

    def __init__(self, base: str, staging: str) -> None:
        self.base, self.staging = base, staging
        self._plain: dict[str, bool] = {}  # base folders reached without a link
        self._folders: set[str] = set()  # chunk folders made in the staging folder
        self._regular: dict[str, frozenset[str]] = {}  # base chunk folder: its regular files

    def link(
        self,
        base_path: str,
        path: str,
        chunks: tuple[int, ...],
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
    ) -> bool:
        """Link the chunk files of the box ``offsets``/``sizes`` of the base's array at
        ``base_path`` (chunk shape ``chunks``) to the array at ``path``; ``False`` where that
        cannot be done (another file system, a chunk file that is missing or not a regular
        file, a link on the way), and the caller writes the box instead."""
        src_dir = os.path.join(self.base, base_path)
        dst_dir = os.path.join(self.staging, path)
        try:
            for idx in chunks_touching(offsets, sizes, chunks):
                name = chunk_key(idx)
                src, dst = os.path.join(src_dir, name), os.path.join(dst_dir, name)
                src_folder = os.path.dirname(src)
                if not self._plain_folder(src_folder):
                    return False  # a folder on the way is a link: it may lead out of the base
                if os.path.basename(src) not in self._regular_files(src_folder):
                    return False
                folder = os.path.dirname(dst)
                if folder not in self._folders:
                    os.makedirs(folder, exist_ok=True)
                    self._folders.add(folder)
                os.link(src, dst, follow_symlinks=False)
        except OSError:  # a link made already is replaced by the write
            return False
        return True

    def _plain_folder(self, folder: str) -> bool:
        """Whether every folder from below the base down to ``folder`` is a directory, not a
        link to one, so that what is linked from it lies inside the base. One ``lstat`` per
        folder of the base, remembered."""
        plain = self._plain.get(folder)
        if plain is None:
            parent = os.path.dirname(folder)
            if not folder.startswith(self.base + os.sep) or parent == folder:
                plain = False
            else:
                above = parent == self.base or self._plain_folder(parent)
                plain = above and stat.S_ISDIR(os.lstat(folder).st_mode)
            self._plain[folder] = plain
        return plain

    def _regular_files(self, folder: str) -> frozenset[str]:
        """The names of the regular files in ``folder`` (not links), listed once: one
        ``scandir`` per chunk folder instead of an ``lstat`` per chunk."""
        names = self._regular.get(folder)
        if names is None:
            with os.scandir(folder) as it:
                names = frozenset(e.name for e in it if e.is_file(follow_symlinks=False))
            self._regular[folder] = names
        return names
