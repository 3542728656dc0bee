"""Data iterators saved with a checkpoint: their states taken at the save, set back at a restore.

``jaxckpt.save(path, tree, iterators={"train": it})`` calls ``it.get_state()`` during the call
(``save_async`` too: the position saved is the one at the call, whatever the loop does next).
Each process's records (``jaxckpt._format.iterators``) travel to the coordinator with the
"written" barrier that every save makes anyway, so the manifest that commits the step holds
them all: no extra exchange, no file of their own. ``restore(..., iterators=...)`` checks
this process's record before any array is read and calls ``set_state`` with it once every
array is read and checked, then ``start_prefetch()`` where the iterator has one (as Grain
0.2.18's own checkpoint handler does): a restore that is refused on the way (a key, shape or
dtype mismatch, a damaged chunk) leaves every iterator where it was.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from jaxckpt._errors import (
    ArgumentTypeError,
    CheckpointError,
    DistributedError,
    KeyMismatchError,
    ManifestError,
)
from jaxckpt._format import iterators as _records
from jaxckpt._runtime import distributed as _distributed


class Checkpointable(Protocol):
    """What ``iterators=`` takes: Grain's ``DataLoader`` iterators and ``DatasetIterator``s,
    or any object with these two methods."""

    def get_state(self) -> Any: ...  # a JSON value, or bytes
    def set_state(self, state: Any) -> Any: ...


def capture(iterators: Mapping[str, Checkpointable] | None) -> dict[str, _records.IteratorState]:
    """Each iterator's state now, as a record (none without ``iterators``).

    Raises:
      ArgumentTypeError: ``iterators`` is not a mapping of names to iterators.
      UnsupportedLeafError: a state is neither JSON nor bytes (names the iterator).
    """
    if not iterators:
        return {}
    _check(iterators)
    return {name: _records.encode(name, it.get_state()) for name, it in iterators.items()}


def payload(records: dict[str, _records.IteratorState], rest: str) -> str:
    """What this process sends at the "written" barrier: its records, a newline, ``rest``."""
    return json.dumps({n: r.to_json() for n, r in records.items()}) + "\n" + rest


def collect(
    payloads: dict[int, str], count: int, path: str
) -> tuple[dict[str, _records.SavedIterator], dict[int, str]]:
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
    return _records.from_json(raw, path), rest


def restore_states(
    iterators: Mapping[str, Checkpointable] | None,
    saved: Mapping[str, _records.SavedIterator],
    path: str,
) -> Callable[[], None]:
    """Check that ``saved`` holds this process's state of each iterator; returns the call
    that sets them (then starts each one's prefetch), made only once the arrays are read, so
    a restore refused on the way moves no iterator.

    Raises:
      KeyMismatchError: the checkpoint holds no state of a named iterator.
      CheckpointError: saved on another number of processes, each at its own position.
    """
    if not iterators:
        return lambda: None
    _check(iterators)
    process, count = _distributed.process_index(), _distributed.process_count()
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


def _set(
    states: list[tuple[str, Checkpointable, _records.IteratorState]], process: int, path: str
) -> None:
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


def _own(
    name: str, saved: _records.SavedIterator, process: int, count: int, path: str
) -> _records.IteratorState:
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
