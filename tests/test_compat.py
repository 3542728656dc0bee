"""The compatibility promise (docs/compatibility.md): a checkpoint of every format version and
flavour that an earlier jaxckpt wrote, committed in tests/data (each by its make_*.py), restores
bit-exact. The expected values are written here, not taken from a re-run of the generators."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts

import jaxckpt
from jaxckpt._cli.main import main
from jaxckpt._storage.location import CONTEXT

DATA = Path(__file__).parent / "data"


def _key(seed: int) -> dict:
    return {"key_data": jax.random.key_data(jax.random.key(seed))}


def _v2_state() -> dict:
    return {
        "big": np.arange(1024, dtype=np.float32).reshape(32, 32),
        "huge": np.arange(8192, dtype=np.int32).reshape(128, 64),
        "bias": np.arange(6).astype(ml_dtypes.bfloat16) / 4,
        "q": np.arange(7, dtype=ml_dtypes.uint4),
        "i4": np.arange(-3, 3).astype(ml_dtypes.int4),
        "rng": _key(7),
        "empty": np.zeros((0, 3), np.float16),
        "flag": np.array([True, False, True]),
        "step": 12,
        "name": "v2",
    }


def _v1_state() -> dict:
    return {
        "params": {
            "w": np.arange(12.0, dtype=np.float32).reshape(4, 3),
            "b": np.array([1.5, -2.0, 3.25], dtype=ml_dtypes.bfloat16),
        },
        "q": np.arange(5, dtype=ml_dtypes.uint4),
        "rng": _key(42),
        "scalar": np.array(2.5, dtype=np.float32),
        "empty": np.zeros((0, 2), np.int32),
        "step": 12,
        "name": "v1",
    }


def _v3_state(step: int) -> dict:
    return {
        "w": np.arange(64, dtype=np.float32).reshape(8, 8),
        "b": np.full(3, step, dtype=np.int32),
        "q": np.arange(5).astype(ml_dtypes.bfloat16) / 2,
        "step": step,
    }


# fixture folder, its step under it ("" for a checkpoint), format version, expected tree,
# expected iterator states
FIXTURES = {
    "v1": ("v1_main", "", 1, _v1_state(), {}),
    "v2-packed": ("v2_packed", "", 2, _v2_state(), {}),
    "v3-incremental-base": ("v3_incremental", "00000001", 2, _v3_state(1), {}),
    "v3-incremental": ("v3_incremental", "00000002", 3, _v3_state(2), {}),
    "v4-compressed": ("v4_zstd", "", 4, _v2_state(), {}),
    "v5-data-objects": ("v5_objects", "", 5, _v2_state(), {}),
    "iterators": (
        "iterators",
        "",
        2,
        {"w": np.arange(6, dtype=np.float16).reshape(2, 3), "step": 12},
        {"train": {"next_index": 12, "epoch": 1}, "eval": b'{"last_seen_indices": {"0": 7}}'},
    ),
}


class _Position:
    state: object = None

    def get_state(self) -> object:
        return self.state

    def set_state(self, state: object) -> None:
        self.state = state


def _to_memory(folder: Path) -> str:
    """The fixture's files copied into a fresh ``memory://`` prefix (an object store: the one
    kind of store on which version 3's references are read)."""
    url = f"memory://compat-{uuid.uuid4().hex[:8]}"
    kv = ts.KvStore.open(
        {"driver": "memory", "path": url[len("memory://") :] + "/"}, context=CONTEXT
    )
    store = kv.result()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        store.write(f.relative_to(folder).as_posix(), f.read_bytes()).result()
    return url


def _assert_bit_exact(got: object, want: object, where: str) -> None:
    if isinstance(want, dict) and set(want) == {"key_data"}:  # a PRNG key array
        data = np.asarray(jax.random.key_data(got))
        assert data.tobytes() == np.asarray(want["key_data"]).tobytes(), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for k in want:
            _assert_bit_exact(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, np.ndarray):
        got = np.asarray(got)
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        assert got.tobytes() == want.tobytes(), where
    else:
        assert type(got) is type(want) and got == want, where


@pytest.mark.parametrize("flavour", list(FIXTURES))
def test_every_format_version_and_flavour_restores_bit_exact(flavour, tmp_path):
    folder, step, version, want, states = FIXTURES[flavour]
    manifest = DATA / folder / step / "manifest.json"
    assert json.loads(manifest.read_text())["version"] == version
    if folder in ("v3_incremental", "v5_objects"):  # object-store flavours, read there
        path: str | Path = f"{_to_memory(DATA / folder)}/{step}"
    else:
        path = tmp_path / folder  # a copy: nothing here may change the committed fixture
        shutil.copytree(DATA / folder, path)
    iterators = {name: _Position() for name in states}
    got = jaxckpt.restore(path, iterators=iterators or None)
    _assert_bit_exact(got, want, flavour)
    assert {n: it.state for n, it in iterators.items()} == states
    assert jaxckpt.metadata(path).version == version
    assert main(["verify", str(path)]) == 0
    if flavour in ("v2-packed", "v5-data-objects"):  # onto devices too, resharded
        onto = jax.sharding.NamedSharding(
            jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y")),
            jax.sharding.PartitionSpec("y", "x"),
        )
        back = jaxckpt.restore(path, {"big": onto, "huge": onto}, strict=False)
        assert back["big"].sharding == onto and back["big"].dtype == jnp.float32
        assert np.asarray(back["big"]).tobytes() == want["big"].tobytes()


def test_every_fixture_folder_is_covered():
    """A new fixture in tests/data is one more case above (and a line in docs/compatibility.md)."""
    folders = {
        p.name for p in DATA.iterdir() if p.is_dir() and not p.name.startswith(("orbax", "_"))
    }
    assert folders == {f[0] for f in FIXTURES.values()}
    doc = (Path(__file__).parents[1] / "docs" / "compatibility.md").read_text()
    for folder in folders:
        assert f"tests/data/{folder}" in doc, folder
