"""Writes tests/data/iterators: a checkpoint that holds the states of two data iterators (a
JSON state and a bytes state, as Grain's ``DataLoader`` gives) beside its arrays, as jaxckpt
wrote it on 2026-12-07 (issue 62). Committed once, so that every later version is tested
against iterator records it did not write itself (tests/test_compat.py).

Run from the repository root: ``.venv/bin/python tests/data/make_iterators.py`` (only to make
it again on purpose: the test compares with values of its own, not with this script's).
"""

import os
import shutil

import numpy as np

import jaxckpt


class Position:
    """A data iterator's position: ``get_state()``/``set_state()`` as Grain's have."""

    def __init__(self, state: object) -> None:
        self.state = state

    def get_state(self) -> object:
        return self.state

    def set_state(self, state: object) -> None:
        self.state = state


if __name__ == "__main__":
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "iterators")
    shutil.rmtree(out, ignore_errors=True)
    iterators = {
        "train": Position({"next_index": 12, "epoch": 1}),
        "eval": Position(b'{"last_seen_indices": {"0": 7}}'),
    }
    tree = {"w": np.arange(6, dtype=np.float16).reshape(2, 3), "step": 12}
    jaxckpt.save(out, tree, iterators=iterators)
