"""A real optax AdamW state over a sharded pure-jax model round-trips, NamedTuples included."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import assert_tree_equal, mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt


def _setup(m):
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "dense": {"kernel": jax.random.normal(k1, (16, 8)), "bias": jnp.zeros(8)},
        "out": {"kernel": jax.random.normal(k2, (8, 4))},
    }
    specs = {
        "dense": {"kernel": P("data", "model"), "bias": P("model")},
        "out": {"kernel": P("model")},
    }
    params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(m, s)), params, specs)
    opt = optax.adamw(1e-2, weight_decay=1e-3)
    return params, opt


def _loss(params, x, y):
    h = jax.nn.relu(x @ params["dense"]["kernel"] + params["dense"]["bias"])
    return jnp.mean((h @ params["out"]["kernel"] - y) ** 2)


def _step(opt):
    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def test_adamw_state_round_trips_and_training_continues(tmp_path):
    m = mesh((4, 2), ("data", "model"))
    params, opt = _setup(m)
    opt_state = opt.init(params)
    step = _step(opt)
    x = jax.random.normal(jax.random.key(1), (32, 16))
    y = jax.random.normal(jax.random.key(2), (32, 4))
    for _ in range(3):
        params, opt_state, _ = step(params, opt_state, x, y)
    state = {"params": params, "opt_state": opt_state, "step": 3}
    jaxckpt.save(tmp_path / "c", state)

    back = jaxckpt.restore(tmp_path / "c", state)
    assert_tree_equal(back, state)
    assert type(back["opt_state"][0]) is type(opt_state[0])  # ScaleByAdamState
    assert int(back["opt_state"][0].count) == 3

    # Training continues identically from the restored state (same shardings: bit-exact).
    p, s, q, t = params, opt_state, back["params"], back["opt_state"]
    for _ in range(3):
        p, s, la = step(p, s, x, y)
        q, t, lb = step(q, t, x, y)
        assert float(la) == float(lb)
    np.testing.assert_array_equal(p["dense"]["kernel"], q["dense"]["kernel"])

    # Onto another mesh: same values; the step's reductions may reorder, so losses are close.
    m2 = mesh((2, 4), ("data", "model"))
    target = jax.tree.map(
        lambda a: NamedSharding(m2, a.sharding.spec) if isinstance(a, jax.Array) else None, state
    )
    moved = jaxckpt.restore(tmp_path / "c", target)
    assert_tree_equal(jax.device_get(moved), jax.device_get(state))
    assert moved["params"]["dense"]["kernel"].sharding.mesh == m2
    _, _, lm = step(moved["params"], moved["opt_state"], x, y)
    _, _, l0 = step(params, opt_state, x, y)
    np.testing.assert_allclose(float(lm), float(l0), rtol=1e-5)


def test_keys_returns_only_what_was_asked_for_not_empty_optax_states(tmp_path):
    # optax.sgd's state is (EmptyState(), EmptyState()): leafless subtrees outside keys=[...]
    # must not leak into the result (issue 31.5), those inside it stay.
    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    sgd = optax.sgd(0.1).init(params)
    adam = optax.chain(optax.scale_by_adam(), optax.scale(-0.1)).init(params)
    jaxckpt.save(tmp_path / "c", {"params": params, "opt": sgd, "adam": adam, "step": 3})
    back = jaxckpt.restore(tmp_path / "c", keys=["params"])
    assert set(back) == {"params"} and set(back["params"]) == {"w", "b"}
    back = jaxckpt.restore(tmp_path / "c", keys=["params/w", "step"])
    assert back == {"params": {"w": back["params"]["w"]}, "step": 3}
    back = jaxckpt.restore(tmp_path / "c", keys=["adam"])
    assert set(back) == {"adam"} and back["adam"][1] == {}  # scale's EmptyState, asked for
    assert int(back["adam"][0]["count"]) == 0
