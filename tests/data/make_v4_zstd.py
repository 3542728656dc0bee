"""Writes tests/data/v4_zstd: a format-version-4 checkpoint (compressed chunks: blosc zstd
after a byte shuffle) of make_v2_packed's state, as jaxckpt wrote it on 2026-12-07 when
compression was added (issue 52). Committed once, so that every later version is tested
against compressed bytes it did not write itself (tests/test_compression.py compares it with
tests/data/v2_packed, whose values tests/test_pack.py checks).

Run from the repository root: ``.venv/bin/python tests/data/make_v4_zstd.py`` (only to make
it again on purpose).
"""

import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import make_v2_packed  # noqa: E402  (sets XLA_FLAGS before jax is imported)

import jaxckpt  # noqa: E402

if __name__ == "__main__":
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "v4_zstd")
    shutil.rmtree(out, ignore_errors=True)
    planner = jaxckpt.DefaultSavePlanner(pack_bytes=4096)
    jaxckpt.save(out, make_v2_packed.state(), planner=planner, compression="zstd")
