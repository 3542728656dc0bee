"""Why a restore's target, or this jax, cannot take what is on disk: the checks and their errors.

Each message names the key, says what ``target`` holds and what the checkpoint holds, the usual
cause and the fix: keys missing or unexpected (with a "did you mean" where the keys differ only
by a wrapper's suffix), shapes, dtypes (and those that jax would narrow while
``jax_enable_x64`` is off), saved Python values restored into scalar array targets, and PRNG
key arrays (on one side only, or with an implementation this jax does not know).
``DefaultLoadPlanner.set_up_planner`` (``jaxckpt._planning.load_planner``) calls them as it
matches a target to a manifest; ``jaxckpt.restore``, ``verify`` and ``export`` call
:func:`check_prng_keys` before they read.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from jaxckpt._errors import (
    CheckpointError,
    DtypeMismatchError,
    ManifestError,
    ShapeMismatchError,
)
from jaxckpt._format import manifest_check
from jaxckpt._format.manifest import ArrayEntry, Manifest, ValueEntry
from jaxckpt._planning import tree as _tree

# -- keys ---------------------------------------------------------------------------------------


def empty_alike(
    missing: list[str],
    unexpected: list[str],
    manifest: Manifest,
    target: Any,
    leaves: dict[str, Any],
) -> tuple[list[str], list[str]]:
    """``missing`` and ``unexpected`` less the keys where one side holds ``None`` and the
    other an empty node (optax's ``EmptyState()``, ``{}``, ``()``).

    Both hold no data, and JAX itself treats ``None`` as an empty subtree; Orbax records every
    empty node as a ``None`` placeholder and restores it into whichever the target holds.
    """
    saved = manifest.entries
    unexpected = [
        k
        for k in unexpected
        if isinstance(e := saved[k], ArrayEntry)
        or e.value is not None
        or not _tree.is_empty_at(target, k)
    ]
    if missing:
        empty = _tree.empty_paths(manifest.tree)
        missing = [k for k in missing if not (leaves[k] is None and k in empty)]
    return missing, unexpected


def saved_none(keys: Iterable[str], manifest: Manifest, leaves: dict[str, Any]) -> list[str]:
    """The ``keys`` the checkpoint holds as ``None`` (no leaf: Levanter's and Orbax's
    placeholder of a leaf left out) where the target holds a leaf; ``restore(strict=False)``
    keeps the target's there, as for a key the checkpoint lacks."""
    saved = manifest.entries
    return sorted(
        k
        for k in keys
        if isinstance(e := saved[k], ValueEntry) and e.value is None and leaves[k] is not None
    )


def key_message(missing: list[str], unexpected: list[str]) -> str:
    """The message of a :class:`KeyMismatchError`: the keys on one side only, and the fix.

    Example:
      >>> print(key_message(["opt/mu"], []))
      1 key(s) in `target` missing from the checkpoint: ['opt/mu']. Pass strict=False to ...
    """
    parts = []
    if missing:
        parts.append(
            f"{len(missing)} key(s) in `target` missing from the checkpoint: {missing[:5]!r}"
        )
    if unexpected:
        parts.append(
            f"{len(unexpected)} key(s) in the checkpoint not in `target`: {unexpected[:5]!r}"
        )
    fix = _wrapper_hint(missing, unexpected) or (
        "Pass strict=False to restore the keys both have (others keep the target's leaf), "
        "or keys=[...] to pick a subset."
    )
    return "; ".join(parts) + ". " + fix


def kept_message(missing: list[str], unexpected: list[str], targets: dict[str, Any]) -> str:
    """The warning of ``restore(strict=False)``: the target's keys that are not on disk come
    back as the target holds them (and which of them are abstract, not arrays)."""
    kinds = (jax.ShapeDtypeStruct, jax.sharding.Sharding)
    abstract = [k for k in missing if isinstance(targets[k], kinds)]
    msg = (
        f"restore(strict=False): {len(missing)} key(s) in `target` are not in the checkpoint (or "
        f"saved as None) and come back as the target holds them: {missing[:5]!r}."
    )
    if abstract:
        msg += (
            f" {len(abstract)} of them are abstract (ShapeDtypeStruct or Sharding), not arrays: "
            f"{abstract[:5]!r}; initialise them before use."
        )
    hint = _wrapper_hint(missing, unexpected)
    return f"{msg} {hint}" if hint else msg


def _wrapper_hint(missing: list[str], unexpected: list[str]) -> str:
    """'Did you mean' when every mismatched key differs by one wrapper suffix ('' otherwise)."""
    found = _tree.wrapper_suffix(missing, unexpected)
    if found is None:
        return ""
    suffix, saved_wrapped = found
    more = f", and {len(missing) - 1} more alike" if len(missing) > 1 else ""
    m = missing[0]
    pair = f"{m!r} -> {m + suffix!r}" if saved_wrapped else f"{m!r} -> {m[: -len(suffix)]!r}"
    boxes = (
        "flax's nn.Partitioned and nnx Variables keep the array at '.../value'"
        if suffix.endswith("value")
        else f"a wrapper node keeps the array at '...{suffix}'"
    )
    if saved_wrapped:
        return (
            f"Did you mean (target -> checkpoint) {pair}{more}? The keys differ only by the "
            f"suffix {suffix!r}: the checkpoint holds wrapped leaves ({boxes}), the target plain "
            f"ones. Restore into a target wrapped the same way (e.g. jax.eval_shape(model.init, "
            f"...) before nn.unbox, or nnx.state(nnx.eval_shape(...))), then unwrap the result "
            f"(nn.unbox, nnx.to_pure_dict); strict=False would restore none of these keys."
        )
    return (
        f"Did you mean (target -> checkpoint) {pair}{more}? The keys differ only by the suffix "
        f"{suffix!r}: the target holds wrapped leaves ({boxes}), the checkpoint plain ones. "
        f"Restore into the plain form (nn.unbox(target), or nnx.to_pure_dict(state)), then put "
        f"the result back (nnx.replace_by_pure_dict(state, restored)); strict=False would "
        f"restore none of these keys."
    )


# -- shapes and dtypes --------------------------------------------------------------------------


def shape_error(key: str, target: tuple[int, ...], saved: tuple[int, ...]) -> ShapeMismatchError:
    """The target's leaf at ``key`` has shape ``target``, the checkpoint's array ``saved``.

    Example:
      >>> print(shape_error("params/w", (4, 8), (8, 4)))
      Key 'params/w': shape in `target`: (4, 8), on disk: (8, 4). Restore with a target of ...
    """
    return ShapeMismatchError(
        f"Key {key!r}: shape in `target`: {target}, on disk: {tuple(saved)}. Restore with a "
        f"target of the saved shape (or a bare Sharding, which takes shape from the checkpoint)."
    )


def check_divides(key: str, sharding: Any, shape: tuple[int, ...]) -> None:
    """Raise :class:`ShapeMismatchError` naming ``key`` if ``sharding`` cannot lay out an array
    of ``shape`` (a mesh axis that does not divide its dimension)."""
    try:
        sharding.shard_shape(shape)
    except ValueError as e:
        raise ShapeMismatchError(
            f"Key {key!r}: the target's sharding cannot hold the saved shape {tuple(shape)}: "
            f"{e}. Choose a PartitionSpec whose mesh axes divide each dimension they shard, or "
            f"restore this key onto another sharding (or None for the host)."
        ) from e


MAX_LISTED = 10  # mismatches listed in one error


def one_error(errors: list[CheckpointError]) -> CheckpointError:
    """Every mismatch of a target in one error, of the first one's type (at most
    :data:`MAX_LISTED` listed): a user fixes them all at once, not one run at a time.

    Example:
      >>> e = one_error([shape_error("w", (2,), (3,)), shape_error("b", (1,), (4,))])
      >>> type(e).__name__, str(e).split(":")[0]
      ('ShapeMismatchError', '2 leaves of `target` do not fit the checkpoint')
    """
    if len(errors) == 1:
        return errors[0]
    shown = errors[:MAX_LISTED]
    listed = "; ".join(f"({n}) {str(e).rstrip('.')}" for n, e in enumerate(shown, start=1))
    more = f"; and {len(errors) - MAX_LISTED} more" if len(errors) > MAX_LISTED else ""
    return type(errors[0])(
        f"{len(errors)} leaves of `target` do not fit the checkpoint: {listed}{more}."
    )


def dtype_error(key: str, target: np.dtype[Any], saved: np.dtype[Any]) -> DtypeMismatchError:
    """The target asks for ``target``, the checkpoint holds ``saved``; where the target is
    what jax made of ``saved`` with ``jax_enable_x64`` off, say so."""
    x64 = ""
    if target == jax.dtypes.canonicalize_dtype(saved) != saved:
        x64 = (
            f" A {target.name} target for {saved.name} data is what jax makes while "
            f"jax_enable_x64 is off: enable it with jax.config.update('jax_enable_x64', True) "
            f"before creating the target to restore {saved.name} exactly."
        )
    return DtypeMismatchError(
        f"Key {key!r}: dtype in `target`: {target.name}, on disk: {saved.name}. Pass "
        f"planner=jaxckpt.DefaultLoadPlanner(allow_dtype_cast=True) to cast, or fix the "
        f"target's dtype.{x64}"
    )


def device_dtype(key: str, dtype: np.dtype[Any], found: str, cast: bool) -> np.dtype[Any]:
    """The dtype an array of ``dtype`` has on a device: jax's canonical one (``int64`` becomes
    ``int32``, ``float64`` ``float32``, ... while ``jax_enable_x64`` is off), where ``cast`` is
    asked for; else ``dtype`` itself, which jax must place as it is.

    Raises:
      DtypeMismatchError: jax would place ``dtype`` as another (the values would change
        silently: wrap around, overflow to inf, lose precision), and ``cast`` is false.
    """
    placed = np.dtype(jax.dtypes.canonicalize_dtype(dtype))
    if placed == dtype or cast:
        return placed
    raise DtypeMismatchError(
        f"Key {key!r}: dtype {found}, but jax would place it on the device as {placed.name} "
        f"(jax_enable_x64 is off, so jax has no {dtype.name} arrays): the values would change "
        f"silently. Enable it with jax.config.update('jax_enable_x64', True) before creating "
        f"arrays to restore {dtype.name} exactly, or pass "
        f"planner=jaxckpt.DefaultLoadPlanner(allow_dtype_cast=True) to cast to {placed.name} "
        f"deliberately (None at this key restores it on the host, unchanged)."
    )


# -- saved Python values ------------------------------------------------------------------------


def value_shape_error(key: str, shape: tuple[int, ...], value: Any) -> ShapeMismatchError:
    """The target holds an array of ``shape`` where the checkpoint holds the Python ``value``
    that no array of that shape can take (only a number fits, and only a scalar array)."""
    if value is None:
        return ShapeMismatchError(
            f"Key {key!r}: the target holds an array of shape {shape} but the checkpoint None "
            f"(no leaf was saved there). Pass strict=False to keep the target's array where "
            f"the checkpoint holds None, or put None at this key in `target`."
        )
    return ShapeMismatchError(
        f"Key {key!r}: the target holds an array of shape {shape} but the "
        f"checkpoint a Python value ({value!r}). Use a Python value or None at this key "
        f"in `target` (a number also restores into a scalar array target, shape ())."
    )


def check_scalar(
    key: str, value: Any, asked: np.dtype[Any], dtype: np.dtype[Any], cast: bool
) -> None:
    """Refuse a saved Python scalar ``value`` that cannot become a 0-d array of ``dtype``: the
    target's ``asked`` dtype, or what jax places of it.

    Raises:
      DtypeMismatchError: the value is not of ``dtype``'s kind (without ``cast``), or does not
        fit in it.
    """
    problem = _scalar_problem(value, dtype, cast)
    if problem and dtype != asked:  # cast to what jax places (jax_enable_x64 off)
        problem += f" (jax places {asked.name} as {dtype.name} while jax_enable_x64 is off)"
    if problem:
        fix = "pass planner=jaxckpt.DefaultLoadPlanner(allow_dtype_cast=True) to cast, or "
        raise DtypeMismatchError(
            f"Key {key!r}: on disk the Python {type(value).__name__} {value!r}, in `target` a "
            f"scalar array of dtype {asked.name}: {problem}. Use a target dtype of the value's "
            f"kind, {'' if cast else fix}a Python value or None at this key."
        )


def _scalar_problem(value: Any, dtype: np.dtype[Any], cast: bool) -> str | None:
    """Why a saved Python scalar cannot become a 0-d array of ``dtype`` (``None``: it can).

    Of the value's kind it always can (bool -> bool, int -> any integer dtype that holds it,
    float -> any float or complex dtype); across kinds only with ``cast``.
    """
    if dtype.kind not in "biufc":
        return "not a numeric dtype"
    if isinstance(value, bool):
        ok, kind = dtype.kind == "b", "bool"
    elif isinstance(value, int):
        if dtype.kind in "iu" and not np.iinfo(dtype).min <= value <= np.iinfo(dtype).max:
            return f"{value} does not fit in {dtype.name}"
        ok, kind = dtype.kind in "iu", "an integer dtype"
    else:
        ok, kind = dtype.kind in "fc", "a float or complex dtype"
    return None if ok or cast else f"{dtype.name} is not {kind}"


# -- PRNG keys ----------------------------------------------------------------------------------


def check_prng_target(key: str, entry: ArrayEntry, shape: tuple[int, ...], dtype: Any) -> None:
    """Refuse a PRNG key array on one side only (the target's leaf of ``shape`` and ``dtype``,
    or ``entry`` on disk), or keys of another shape than the saved ones.

    Raises:
      DtypeMismatchError: key arrays on one side only.
      ShapeMismatchError: key arrays of another shape (the key data's last dimension aside).
    """
    is_key = jax.numpy.issubdtype(dtype, jax.dtypes.prng_key)
    if not entry.prng_impl:
        if is_key:
            raise DtypeMismatchError(
                f"Key {key!r}: in `target` a PRNG key array, on disk plain {entry.dtype}"
                f"{list(entry.shape)} data with no key implementation recorded (key data saved "
                f"as an array, or an Orbax checkpoint without array metadata). Restore it with "
                f"None at this key and wrap it: jax.random.wrap_key_data(x, impl=...)."
            )
        return
    if not is_key:
        raise DtypeMismatchError(
            f"Key {key!r}: on disk a PRNG key array ({entry.prng_impl}), in `target` "
            f"dtype {dtype}. Use a key array (jax.random.key) or None as the target."
        )
    if shape != entry.shape[: len(shape)] or len(entry.shape) != len(shape) + 1:
        raise shape_error(key, shape, entry.shape[:-1])


def check_prng_keys(manifest: Manifest, where: str) -> None:
    """Refuse PRNG key entries whose ``prng_impl`` jax does not know, or whose key data does not
    fit it (``jaxckpt._format`` checks the impls jax ships without importing jax).

    Raises:
      ManifestError: naming the key and the impl.
    """
    for key, e in manifest.entries.items():
        if not isinstance(e, ArrayEntry) or not e.prng_impl:
            continue
        impl = e.prng_impl
        key_shape = _prng_key_shape(impl)
        problem = (
            f"names prng_impl {impl!r}, which this jax does not know (registered: "
            f"{sorted(manifest_check.PRNG_KEY_SHAPES)} and any made with "
            f"jax.extend.random.define_prng_impl)"
            if key_shape is None
            else manifest_check.prng_problem(impl, e.shape, e.dtype, key_shape)
        )
        if problem:
            raise ManifestError(
                f"{where}: entry {key!r} {problem}. The manifest is damaged, or was written with "
                f"a PRNG implementation this program has not registered; nothing was read."
            )


@functools.cache
def _prng_key_shape(impl: str) -> tuple[int, ...] | None:
    """The key data shape of jax's PRNG ``impl`` (traced, nothing runs); ``None`` if unknown."""
    try:
        out = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))
    except (ValueError, TypeError, KeyError):
        return None
    return tuple(out.shape)
