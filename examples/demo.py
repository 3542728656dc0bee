"""Train a small transformer on 8 simulated devices, get preempted, resume on other meshes.

What it shows, in one process:

1. training with ``jax.jit`` over a (4, 2) ``("data", "model")`` mesh (pure jax + optax) on
   batches from a Grain pipeline (a shuffling ``grain.DataLoader``), with an asynchronous
   checkpoint every ``--save-every`` steps, or every ``--save-secs`` seconds (``0``: continuously,
   whenever the last save has committed), through a ``CheckpointManager``; each checkpoint holds
   the state and the pipeline's position (``iterators=``);
2. a preemption: the demo sends itself SIGTERM; the manager saves that very step and the loop
   stops, as it would before a spot VM or a TPU slice goes away;
3. a restart that restores the state onto a *different* mesh, (2, 4), and a fresh pipeline to
   the saved position, trains on, is preempted again, and restores onto a single device to
   finish;
4. the loss of every step equals, bit for bit, that of an uninterrupted run which follows the
   same meshes but moves its state between them in memory and reads one pipeline from start
   to end, never through a checkpoint: the resumed run trained on the same batches.

Run: ``make demo`` or ``python examples/demo.py --steps 60 --mesh 4x2 --dir /tmp/run``.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import logging  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import grain  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402

VOCAB, SEQ, BATCH, D, HEADS, LAYERS = 64, 32, 16, 64, 4, 2
# How each parameter (and its Adam moments, which share its name) is split over the mesh.
SPECS = {
    "tok": P(None, "model"), "pos": P(None, "model"),
    "qkv": P(None, None, "model"), "proj": P("model", None),
    "up": P(None, "model"), "down": P("model", None),
    "scale": P(), "head": P(None, "model"),
}  # fmt: skip


# -- the model: a pre-norm decoder-only transformer in pure jax ------------------------------


def init_params(key: jax.Array) -> dict:
    ks = iter(jax.random.split(key, 3 + 4 * LAYERS))

    def dense(shape: tuple[int, ...]) -> jax.Array:
        return jax.random.normal(next(ks), shape) / np.sqrt(shape[0])

    blocks = [
        {"ln1": {"scale": jnp.ones(D)}, "qkv": dense((D, 3, D)), "proj": dense((D, D)),
         "ln2": {"scale": jnp.ones(D)}, "up": dense((D, 4 * D)), "down": dense((4 * D, D))}
        for _ in range(LAYERS)
    ]  # fmt: skip
    return {"tok": dense((VOCAB, D)), "pos": dense((SEQ, D)) * 0.1, "blocks": blocks,
            "ln": {"scale": jnp.ones(D)}, "head": dense((D, VOCAB))}  # fmt: skip


def _norm(x: jax.Array, p: dict) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * p["scale"]


def forward(params: dict, tokens: jax.Array) -> jax.Array:
    x = params["tok"][tokens] + params["pos"]
    mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))
    for b in params["blocks"]:
        q, k, v = jnp.einsum("btd,dke->kbte", _norm(x, b["ln1"]), b["qkv"])
        q, k, v = (t.reshape(*t.shape[:2], HEADS, D // HEADS) for t in (q, k, v))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // HEADS)
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), -1)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(x.shape) @ b["proj"]
        x = x + jax.nn.gelu(_norm(x, b["ln2"]) @ b["up"]) @ b["down"]
    return _norm(x, params["ln"]) @ params["head"]


# -- the data: a Grain pipeline, whose position is saved with each step -----------------------


class Sequences:
    """A random-access source of learnable token sequences: record ``i`` is a function of ``i``."""

    def __len__(self) -> int:
        return 1 << 16  # 4096 batches: enough for long runs (benchmarks/lost_work.py)

    def __getitem__(self, i: int) -> np.ndarray:
        start = (i * 2654435761) % VOCAB
        return ((start * np.arange(1, SEQ + 2) * 5 + np.arange(SEQ + 1) ** 2) % VOCAB).astype(
            np.int32
        )

    def __repr__(self) -> str:  # Grain checks a restored position against the source's repr
        return f"Sequences(vocab={VOCAB}, seq={SEQ})"


def batches() -> grain.DataLoaderIterator:
    """A fresh pipeline: shuffled records, batched. Its position is what a checkpoint keeps."""
    sampler = grain.samplers.IndexSampler(len(Sequences()), grain.sharding.NoSharding(),
                                          shuffle=True, seed=1, num_epochs=1)  # fmt: skip
    loader = grain.DataLoader(data_source=Sequences(), sampler=sampler, worker_count=0,
                              operations=[grain.transforms.Batch(BATCH, drop_remainder=True)])  # fmt: skip
    return iter(loader)


def split(batch: np.ndarray, layout: Layout) -> tuple[jax.Array, jax.Array]:
    """Inputs and next-token targets of a batch, sharded over the layout's data axis."""
    return jax.device_put(batch[:, :-1], layout.data), jax.device_put(batch[:, 1:], layout.data)


OPT = optax.adamw(3e-3, weight_decay=1e-4)


def train_step(state: dict, tokens: jax.Array, targets: jax.Array) -> tuple[dict, jax.Array]:
    def loss_fn(params: dict) -> jax.Array:
        logits = forward(params, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = OPT.update(grads, state["opt"], state["params"])
    new = {
        "params": optax.apply_updates(state["params"], updates),
        "opt": opt,
        "step": state["step"] + 1,
    }
    return new, loss


# -- layouts: a mesh, or one device ----------------------------------------------------------


class Layout:
    """Where the state lives: a ("data", "model") mesh of the given shape, or one device."""

    def __init__(self, text: str) -> None:
        self.text = text
        shape = tuple(int(n) for n in text.lower().split("x"))
        if shape == (1,):
            self.place: Callable[[P], Any] = lambda spec: SingleDeviceSharding(jax.devices()[0])
        else:
            if len(shape) != 2 or np.prod(shape) > jax.device_count():
                raise SystemExit(f"--mesh {text}: want DATAxMODEL with at most "
                                 f"{jax.device_count()} devices, e.g. 4x2, or 1")  # fmt: skip
            mesh = Mesh(
                np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), ("data", "model")
            )
            self.place = lambda spec: NamedSharding(mesh, spec)
        self.data = self.place(P("data", None) if shape != (1,) else P())

    def shardings(self, state: Any) -> Any:
        """A sharding for every leaf: by parameter name (Adam's moments share it), else replicated."""

        def one(path: tuple, leaf: Any) -> Any:
            names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
            spec = SPECS.get(names[-1], P()) if names and np.ndim(leaf) > 0 else P()
            return self.place(spec)

        return jax.tree_util.tree_map_with_path(one, state)


def initial_state(layout: Layout) -> dict:
    """A fresh state, made directly in its shards."""
    abstract = jax.eval_shape(_fresh, jax.random.key(0))
    return jax.jit(_fresh, out_shardings=layout.shardings(abstract))(jax.random.key(0))


def abstract_state(layout: Layout) -> dict:
    """Shapes, dtypes and shardings of the state, no data: what a restore needs to know."""
    abstract = jax.eval_shape(_fresh, jax.random.key(0))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, layout.shardings(abstract))  # fmt: skip


def _fresh(key: jax.Array) -> dict:
    params = init_params(key)
    return {"params": params, "opt": OPT.init(params), "step": jnp.zeros((), jnp.int32)}


_STEP_FNS: dict[str, Callable] = {}


def step_fn(layout: Layout, state: dict) -> Callable:
    """The jitted step for a layout; it donates the old state (the checkpoint must not care)."""
    if layout.text not in _STEP_FNS:
        out = (layout.shardings(state), layout.place(P()))
        _STEP_FNS[layout.text] = jax.jit(train_step, out_shardings=out, donate_argnums=0)
    return _STEP_FNS[layout.text]


# -- the run ----------------------------------------------------------------------------------


def run_segment(mgr: jaxckpt.CheckpointManager, layout: Layout, state: dict, data: Any,
                start: int, end: int, preempt_at: int | None, losses: list[float],
                quiet: bool) -> tuple[dict, int]:  # fmt: skip
    """Train steps ``start..end-1`` on ``data`` saving through ``mgr``; stop at a preemption."""
    fn = step_fn(layout, state)
    reported: set[int] = set()
    for step in range(start, end):
        state, loss = fn(state, *split(next(data), layout))
        losses.append(float(loss))
        if step + 1 == preempt_at:
            os.kill(os.getpid(), signal.SIGTERM)  # what the scheduler would send
        # Saved if due, or preempted: the state and the pipeline's position, as one step.
        mgr.save(step + 1, state, metrics={"loss": losses[-1]}, iterators={"train": data})
        _report(mgr, reported, quiet)
        if not quiet:
            _progress(step + 1, end, losses[-1], layout)
        if mgr.reached_preemption(step + 1):
            if not quiet:
                print(f"\n  SIGTERM: saved step {step + 1} and stopped")
            return state, step + 1
    return state, end


def _report(mgr: jaxckpt.CheckpointManager, reported: set[int], quiet: bool) -> None:
    h = mgr.last_save
    if quiet or h is None or id(h) in reported or not h.done():
        return
    reported.add(id(h))
    t = h.timings
    print(f"\r  checkpoint {os.path.basename(h.path)}: {h.nbytes / 1e6:5.2f} MB, stage "
          f"{t['stage'] * 1e3:5.1f} ms, write {t['write'] * 1e3:6.1f} ms, commit "
          f"{t['commit'] * 1e3:5.1f} ms, {h.gbps:5.3f} GB/s" + " " * 10)  # fmt: skip


def _progress(step: int, end: int, loss: float, layout: Layout) -> None:
    done = int(30 * step / end)
    bar = "#" * done + "." * (30 - done)
    sys.stdout.write(f"\r  [{bar}] step {step:4d}/{end}  loss {loss:.4f}  on {layout.text:<4}")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> dict:
    """Run the demo; return the per-step losses of the resumed and the uninterrupted runs."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="training steps in all (default 60)")
    ap.add_argument("--save-every", type=int, default=10, help="checkpoint interval (default 10)")
    ap.add_argument("--save-secs", type=float, default=None,
                    help="save by time instead: seconds between saves (0: continuously)")  # fmt: skip
    ap.add_argument("--mesh", default="4x2", help="first mesh, DATAxMODEL (default 4x2)")
    ap.add_argument("--resume-on", default="2x4,1",
                    help="meshes to resume on after each preemption (default 2x4,1; 1 = one device)")  # fmt: skip
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one)")
    ap.add_argument("--quiet", action="store_true", help="print nothing; exit 1 if a loss differs")
    ap.add_argument("--verbose", action="store_true", help="also log jaxckpt's INFO lines")
    args = ap.parse_args(argv)
    # The demo prints its own line per checkpoint and preemption; --verbose adds the library's.
    logging.basicConfig(stream=sys.stdout, format="\n  [%(name)s] %(message)s")
    logging.getLogger("jaxckpt").setLevel(logging.INFO if args.verbose else logging.ERROR)
    layouts = [Layout(t) for t in [args.mesh, *args.resume_on.split(",")] if t]
    # Preempt evenly: segment i runs on layouts[i] up to preempts[i].
    preempts = [round(args.steps * (i + 1) / len(layouts)) for i in range(len(layouts) - 1)]
    directory = args.dir or tempfile.mkdtemp(prefix="jaxckpt-demo-")
    if os.path.isdir(directory) and os.listdir(directory):
        raise SystemExit(f"--dir {directory} is not empty; give a new or empty directory")
    say = (lambda *a: None) if args.quiet else print
    say(
        f"jaxckpt demo: {args.steps} steps, {jax.device_count()} devices, checkpoints in {directory}"
    )

    every = args.save_every if args.save_secs is None else None  # by steps, or by time
    resumed: list[float] = []
    stops: list[int] = []  # where each segment really stopped (the step it saved at)
    step, state = 0, None
    t0 = time.perf_counter()
    for i, layout in enumerate(layouts):
        end = preempts[i] if i < len(preempts) else args.steps
        with jaxckpt.CheckpointManager(directory, max_to_keep=3, save_interval_steps=every,
                                       save_interval_secs=args.save_secs,
                                       save_on_preemption=True) as mgr:  # fmt: skip
            data = batches()  # a new process would build its pipeline afresh too
            if mgr.latest_step() is None:
                say(f"start on mesh {layout.text}")
                state = initial_state(layout)
            else:
                step = mgr.latest_step()
                state = mgr.restore(step, abstract_state(layout), iterators={"train": data})
                say(f"restart: restored step {step} and its pipeline position from {directory} "
                    f"onto {layout.text} (committed steps {mgr.all_steps()})")  # fmt: skip
            state, step = run_segment(mgr, layout, state, data, step, args.steps,
                                      end if i < len(preempts) else None, resumed, args.quiet)  # fmt: skip
        stops.append(step)
        say("")
    t_train = time.perf_counter() - t0

    say("uninterrupted reference run (same meshes, state moved in memory, one pipeline) ...")
    reference: list[float] = []
    state, data = initial_state(layouts[0]), batches()
    for i, layout in enumerate(layouts):
        start, end = (stops[i - 1] if i else 0), stops[i]
        state = jax.device_put(state, layout.shardings(state))
        fn = step_fn(layout, state)
        for _ in range(start, end):
            state, loss = fn(state, *split(next(data), layout))
            reference.append(float(loss))
    same = resumed == reference
    say(
        f"loss around the resumes (after step {', '.join(str(p) for p in stops[:-1])}) and at the end:"
    )
    for s in sorted({*(p - 1 for p in stops[:-1]), *stops[:-1], args.steps - 1}):
        say(f"  step {s + 1:4d}: resumed {resumed[s]:.7f}  uninterrupted {reference[s]:.7f}")
    say(
        f"every step's loss identical to the uninterrupted run: {same}  "
        f"(first {reference[0]:.3f} -> last {reference[-1]:.3f}; trained in {t_train:.1f} s)"
    )
    if args.dir is None:
        shutil.rmtree(directory, ignore_errors=True)
    return {"resumed": resumed, "uninterrupted": reference, "preempted_at": stops[:-1]}


if __name__ == "__main__":
    result = main()
    sys.exit(0 if result["resumed"] == result["uninterrupted"] else 1)
