"""The vectorized layout agrees with JAX's own devices_indices_map, and balances writers."""

import itertools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxckpt._format.plan import index_to_box
from jaxckpt._planning import layout as _layout

MESHES = {
    "4x2": ((4, 2), ("a", "b")),
    "2x2x2": ((2, 2, 2), ("x", "y", "z")),
    "8": ((8,), ("x",)),
}
SPECS = {
    "4x2": [
        P(),
        P("a"),
        P("b"),
        P("a", "b"),
        P("b", "a"),
        P(("a", "b")),
        P(("b", "a")),
        P(None, "a"),
    ],
    "2x2x2": [P("x", ("y", "z")), P(("z", "x")), P(None, "y"), P("z", "x", "y"), P()],
    "8": [P("x"), P(None, "x"), P()],
}


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("permute", [False, True])
def test_named_layout_matches_devices_indices_map(mesh_name, permute):
    shape_m, names = MESHES[mesh_name]
    devs = np.array(jax.devices())
    if permute:  # meshes need not list devices in id order
        devs = devs[np.random.default_rng(0).permutation(8)]
    mesh = Mesh(devs.reshape(shape_m), names)
    for spec in SPECS[mesh_name]:
        shape = (16, 8, 4)[: max(len(spec), 1) + 1]
        s = NamedSharding(mesh, spec)
        lay = _layout.layout(shape, s)
        want = {d.id: index_to_box(idx, shape) for d, idx in s.devices_indices_map(shape).items()}
        got = {}
        for b, row in enumerate(lay.groups):
            for pos in row:
                sizes = tuple(min(x, n - o) for x, n, o in zip(lay.box, shape, lay.offsets[b]))
                got[int(lay.device_ids[pos])] = (tuple(lay.offsets[b].tolist()), sizes)
        assert got == want, spec
        generic = _layout._generic_layout(shape, s)
        assert generic.groups.shape == lay.groups.shape


def test_balancer_spreads_replicas_by_bytes_and_lowest_takes_first():
    ids = np.arange(8).reshape(4, 2)
    procs = ids // 2
    lay = _layout.named_layout((8,), (4, 2), ("a", "b"), P(), ids, procs)  # fully replicated
    bal = _layout.Balancer()
    writers = [int(lay.device_ids[bal.assign(lay, 100)[0]]) for _ in range(16)]
    assert sorted(writers) == sorted(list(range(8)) * 2)
    low = _layout.Balancer(lowest=True)
    assert {int(lay.device_ids[low.assign(lay, 100)[0]]) for _ in range(4)} == {0}


def test_synthetic_pod_scale_layout_is_exact():
    # 512 processes x 8 devices, FSDP x TP: every box has exactly one writer, no device
    # writes twice, and each process writes the same number of bytes.
    n_proc, per = 512, 8
    ids = np.arange(n_proc * per).reshape(n_proc * per // 8, 8)
    procs = ids // per
    bal = _layout.Balancer()
    load = np.zeros(n_proc, np.int64)
    for spec, shape in itertools.product([P("a", "b"), P("a"), P(None, "b"), P()], [(4096, 64)]):
        lay = _layout.named_layout(shape, ids.shape, ("a", "b"), spec, ids, procs)
        box_bytes = int(np.prod(lay.box)) * 4
        writers = bal.assign(lay, box_bytes)
        assert len(np.unique(writers)) == len(writers) == lay.groups.shape[0]
        np.add.at(load, lay.processes[writers], box_bytes)
    assert load.max() - load.min() <= 4096 * 64 * 4 // 1  # within one (replicated) box
