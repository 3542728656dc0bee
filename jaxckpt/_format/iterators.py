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
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
from typing import Any, Literal, cast

from jaxckpt._errors import ManifestError, UnsupportedLeafError
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
