"""The positions of data iterators in a checkpoint: one record per iterator and process.

An input pipeline resumes exactly when its iterator's state is saved with the arrays of the
same step. Any object with ``get_state()`` and ``set_state(state)`` qualifies (Grain's
``DataLoader`` iterators and ``DatasetIterator``s among them); each process has its own
position, so each process's state is one record. The records are part of the manifest, so they
are committed with the step, by the same write::

    "iterators": {"train": {"process_count": 2,
                            "states": {"0": {"utf8": "{\\"last_seen_indices\\": ...}"},
                                       "1": {"json": {"next_index": 12}}}}}

A record holds what ``get_state()`` returned: ``{"json": value}`` for a JSON value (dicts with
str keys, lists, str, int, float, bool, None; tuples are stored as lists), ``{"utf8": text}``
for bytes that are UTF-8 text (Grain's ``DataLoader`` state: JSON as bytes) and
``{"base64": text}`` for other bytes. ``set_state`` gets the value back, or the bytes. Nothing
is ever pickled; a record that is none of these is a ``ManifestError`` naming it. Readers that
predate records ignore the field (docs/format.md).

Taking and setting the states (:func:`capture` at the save, :func:`restore_states` at the
restore) lives here too, so an iterator's state is in one place. ``jaxckpt.save(path, tree,
iterators={"train": it})`` calls ``it.get_state()`` during the call (``save_async`` too: the
position saved is the one at the call, whatever the loop does next). Each process's records
travel to the coordinator with the "written" barrier that every save makes anyway
(:func:`payload`, :func:`collect`), so the manifest that commits the step holds them all: no
extra exchange, no file of their own. ``restore(..., iterators=...)`` checks this process's
record before any array is read and calls ``set_state`` with it once every array is read and
checked, then ``start_prefetch()`` where the iterator has one (as Grain 0.2.18's own
checkpoint handler does): a restore that is refused on the way (a key, shape or dtype
mismatch, a damaged chunk) leaves every iterator where it was. The callers pass this
process's number and the process count in (this layer knows no runtime).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol, cast

from jaxckpt._errors import (
    ArgumentTypeError,
    CheckpointError,
    DistributedError,
    KeyMismatchError,
    ManifestError,
    UnsupportedLeafError,
)
from jaxckpt._format.manifest_check import int_digits_over

MAX_STATE_BYTES = 1 << 20  # one record, encoded: a position, not a buffer of data
_MAX_DEPTH = 64  # nesting of a JSON state
_KINDS = ("json", "utf8", "base64")
Kind = Literal["json", "utf8", "base64"]


@dataclasses.dataclass(frozen=True)
class IteratorState:
    """One process's saved state of one iterator."""

    kind: Kind
    value: Any  # the JSON value ("json"), or the text of the bytes ("utf8", "base64")

    def state(self) -> Any:
        """What ``set_state`` gets: the JSON value, or the bytes."""
        if self.kind == "json":
            return self.value
        if self.kind == "utf8":
            return str(self.value).encode()
        return base64.b64decode(self.value, validate=True)

    def to_json(self) -> dict[str, Any]:
        return {self.kind: self.value}


@dataclasses.dataclass(frozen=True)
class SavedIterator:
    """An iterator's states in a checkpoint, by process (a whole step: all ``process_count``
    of them; a local-tier part: its own process's)."""

    process_count: int
    states: dict[int, IteratorState]

    def to_json(self) -> dict[str, Any]:
        states = {str(p): s.to_json() for p, s in sorted(self.states.items())}
        return {"process_count": self.process_count, "states": states}


def encode(name: str, state: Any) -> IteratorState:
    """``state`` (what ``get_state()`` returned) as a record.

    Raises:
      UnsupportedLeafError: ``state`` is neither bytes nor a JSON value, or is too large;
        names the iterator and where in the state.
    """
    if isinstance(state, (bytes, bytearray, memoryview)):
        raw = bytes(state)
        try:
            record = IteratorState("utf8", raw.decode("utf-8"))
        except UnicodeDecodeError:
            record = IteratorState("base64", base64.b64encode(raw).decode("ascii"))
    else:
        record = IteratorState("json", _json_value(name, state, "", 0))
    size = len(json.dumps(record.to_json(), allow_nan=False))
    if size > MAX_STATE_BYTES:
        raise UnsupportedLeafError(
            f"Iterator {name!r}: get_state() returned {size} bytes of state; jaxckpt stores "
            f"at most {MAX_STATE_BYTES} per iterator and process (a position, not data: "
            f"Grain's iterators keep a few hundred bytes). Save large buffers as arrays of "
            f"the tree instead."
        )
    return record


def _json_value(name: str, value: Any, at: str, depth: int) -> Any:
    """``value`` as plain JSON (tuples as lists), or ``UnsupportedLeafError``."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        limit = int_digits_over(int(value))
        if limit is not None:
            return _unsupported(name, value, at, f"an int of more than {limit} digits")
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return _unsupported(name, value, at, f"{value} (JSON has no nan or inf)")
        return float(value)
    if depth >= _MAX_DEPTH:
        return _unsupported(name, value, at, f"nested deeper than {_MAX_DEPTH} levels")
    if isinstance(value, (list, tuple)):
        return [_json_value(name, v, f"{at}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                what = f"a dict key {k!r} of type {type(k).__name__} (JSON keys are str)"
                return _unsupported(name, value, at, what)
            out[k] = _json_value(name, v, f"{at}[{k!r}]", depth + 1)
        return out
    return _unsupported(name, value, at, f"a {type(value).__name__}")


def _unsupported(name: str, value: Any, at: str, what: str) -> Any:
    raise UnsupportedLeafError(
        f"Iterator {name!r}: get_state() returned {what} at state{at}. jaxckpt stores an "
        f"iterator's state as JSON (dicts with str keys, lists, str, int, float, bool, None) "
        f"or as bytes, and never pickles. Make get_state() return one of those (Grain's "
        f"iterators do)."
    )


def from_json(raw: Any, where: str) -> dict[str, SavedIterator]:
    """The ``"iterators"`` field of a manifest, checked (untrusted JSON).

    Raises:
      ManifestError: naming the iterator and the process whose record is malformed.
    """
    if not isinstance(raw, dict):
        raise ManifestError(f'{where}: "iterators" must be an object. {_DAMAGED}')
    out = {}
    for name, saved in raw.items():
        count = saved.get("process_count") if isinstance(saved, dict) else None
        states = saved.get("states") if isinstance(saved, dict) else None
        if type(count) is not int or count < 1 or not isinstance(states, dict):
            raise ManifestError(
                f"{where}: iterator {name!r} needs a positive process_count and an object of "
                f"states. {_DAMAGED}"
            )
        out[name] = SavedIterator(count, {})
        for key, record in states.items():
            process = int(key) if key.isdecimal() and len(key) < 10 else -1
            if not 0 <= process < count:
                raise ManifestError(
                    f"{where}: iterator {name!r} has a state for process {key!r}, outside "
                    f"0..{count - 1}. {_DAMAGED}"
                )
            out[name].states[process] = _record(record, name, process, where)
    return out


def _record(record: Any, name: str, process: int, where: str) -> IteratorState:
    kind = next(iter(record), None) if isinstance(record, dict) and len(record) == 1 else None
    if kind not in _KINDS or (kind != "json" and not isinstance(record[kind], str)):
        raise ManifestError(
            f"{where}: the state of iterator {name!r} of process {process} is not one of "
            f'{{"json": value}}, {{"utf8": text}} or {{"base64": text}}. {_DAMAGED}'
        )
    state = IteratorState(cast(Kind, kind), record[kind])
    if kind == "base64":
        try:
            state.state()
        except (binascii.Error, ValueError) as e:
            raise ManifestError(
                f"{where}: the state of iterator {name!r} of process {process} is not "
                f"base64 ({e}). {_DAMAGED}"
            ) from e
    return state


_DAMAGED = "The manifest is damaged or was not written by jaxckpt; nothing was restored."


# Taking the states at a save, setting them at a restore


class Checkpointable(Protocol):
    """What ``iterators=`` takes: Grain's ``DataLoader`` iterators and ``DatasetIterator``s,
    or any object with these two methods."""

    def get_state(self) -> Any: ...  # a JSON value, or bytes
    def set_state(self, state: Any) -> Any: ...


def capture(iterators: Mapping[str, Checkpointable] | None) -> dict[str, IteratorState]:
    """Each iterator's state now, as a record (none without ``iterators``).

    Raises:
      ArgumentTypeError: ``iterators`` is not a mapping of names to iterators.
      UnsupportedLeafError: a state is neither JSON nor bytes (names the iterator).
    """
    if not iterators:
        return {}
    _check(iterators)
    return {name: encode(name, it.get_state()) for name, it in iterators.items()}


def payload(records: dict[str, IteratorState], rest: str) -> str:
    """What this process sends at the "written" barrier: its records, a newline, ``rest``."""
    return json.dumps({n: r.to_json() for n, r in records.items()}) + "\n" + rest


def collect(
    payloads: dict[int, str], count: int, path: str
) -> tuple[dict[str, SavedIterator], dict[int, str]]:
    """(coordinator) Every process's records by iterator, and the rest of each payload.

    Raises:
      DistributedError: the processes passed different iterator names.
    """
    rest, names, by_process = {}, {}, {}
    for p, text in payloads.items():
        head, _, rest[p] = text.partition("\n")
        by_process[p] = json.loads(head)
        names[p] = sorted(by_process[p])
    if len({tuple(n) for n in names.values()}) > 1:
        raise DistributedError(
            f"Save to {path}: the processes passed different iterators= names ({names}). "
            f"Every process passes the same names, each with its own iterator."
        )
    raw = {
        name: {"process_count": count, "states": {str(p): r[name] for p, r in by_process.items()}}
        for name in names.get(0, [])
    }
    return from_json(raw, path), rest


def restore_states(
    iterators: Mapping[str, Checkpointable] | None,
    saved: Mapping[str, SavedIterator],
    path: str,
    process: int,
    count: int,
) -> Callable[[], None]:
    """Check that ``saved`` holds this process's state of each iterator; returns the call
    that sets them (then starts each one's prefetch), made only once the arrays are read, so
    a restore refused on the way moves no iterator. ``process`` is this process's number,
    ``count`` the job's process count.

    Raises:
      KeyMismatchError: the checkpoint holds no state of a named iterator.
      CheckpointError: saved on another number of processes, each at its own position.
    """
    if not iterators:
        return lambda: None
    _check(iterators)
    states = []
    for name, it in iterators.items():
        if name not in saved:
            raise KeyMismatchError(
                f"{path} holds no state of iterator {name!r} (it holds: "
                f"{sorted(saved) or 'none'}). Pass the names it was saved with, or restore "
                f"without iterators= and start the pipeline afresh."
            )
        states.append((name, it, _own(name, saved[name], process, count, path)))
    return lambda: _set(states, process, path)


def _set(states: list[tuple[str, Checkpointable, IteratorState]], process: int, path: str) -> None:
    """Set each iterator to its state, then start its prefetch.

    Raises:
      CheckpointError: ``set_state`` refused the state (the pipeline differs from the saved
        one).
    """
    for name, it, state in states:
        try:
            it.set_state(state.state())
        except Exception as e:
            raise CheckpointError(
                f"Restoring iterator {name!r} from {path}: {type(it).__name__}.set_state "
                f"refused the state process {process} saved: {type(e).__name__}: {e}. Build "
                f"the pipeline as it was when saved (for Grain: the same data source, sampler, "
                f"shard options and worker count), then restore."
            ) from e
    for _, it, _ in states:
        start = getattr(it, "start_prefetch", None)
        try:
            if callable(start):
                start()
        except NotImplementedError:  # older Grain iterators that do not prefetch
            pass


def _own(name: str, saved: SavedIterator, process: int, count: int, path: str) -> IteratorState:
    """This process's state: its own record, or the one every process saved alike."""
    states = list(saved.states.values())
    alike = len(states) == saved.process_count and all(s == states[0] for s in states)
    if saved.process_count != count and not alike:
        raise CheckpointError(
            f"Iterator {name!r} in {path} was saved by {saved.process_count} processes, each "
            f"at its own position, and this job has {count}: a position does not carry over "
            f"to another split of the data (Grain's DataLoader state names its sampler, with "
            f"shard_index and shard_count, and refuses another), so jaxckpt does not guess. "
            f"Restore on {saved.process_count} processes, or restore without iterators= and "
            f"start the pipeline for the new split (jaxckpt.metadata(path).iterators holds "
            f"every process's state)."
        )
    state = saved.states.get(process if saved.process_count == count else 0)
    if state is None:
        raise ManifestError(
            f"{path}: iterator {name!r} has no state for process {process} of {count}. The "
            f"manifest is damaged or was not written by jaxckpt; nothing was restored."
        )
    return state


def _check(iterators: Any) -> None:
    if not isinstance(iterators, Mapping):
        raise ArgumentTypeError(
            f"iterators= maps names to iterators, e.g. {{'train': iter(loader)}}; got a "
            f"{type(iterators).__name__}."
        )
    for name, it in iterators.items():
        if not isinstance(name, str) or not name:
            raise ArgumentTypeError(f"iterators= names must be non-empty str; got {name!r}.")
        if not (
            callable(getattr(it, "get_state", None)) and callable(getattr(it, "set_state", None))
        ):
            raise ArgumentTypeError(
                f"Iterator {name!r} is a {type(it).__name__}, which has no get_state() and "
                f"set_state(). Pass the iterator (for Grain: iter(data_loader) or "
                f"iter(dataset)), not the loader or dataset."
            )
