"""``jaxckpt diff A B``: what differs between two checkpoints (exit 0 equal, 1 different)."""

from __future__ import annotations

import argparse

from jaxckpt._cli.text import json_text, plural, progress_arg
from jaxckpt._sources.diff import CheckpointDiff, diff


def run_diff(args: argparse.Namespace) -> int:
    result = diff(args.a, args.b, progress=progress_arg(args.progress))
    if args.json:
        print(json_text(result.to_json()))
    else:
        for line in diff_lines(result):
            print(line)
    return 0 if result.equal else 1


def diff_lines(r: CheckpointDiff) -> list[str]:
    """The text of ``jaxckpt diff``: one line per key that differs, then a summary line."""
    lines = [f"only in A  {k}" for k in r.only_a]
    lines += [f"only in B  {k}" for k in r.only_b]
    lines += [f"changed    {k}  {a} -> {b}" for k, (a, b) in r.changed.items()]
    lines += [f"value      {k}  {a!r} -> {b!r}" for k, (a, b) in r.values.items()]
    for d in r.differing:
        lines.append(
            f"differs    {d.key}  {d.differing_chunks} of {plural(d.chunks, 'chunk')}, "
            f"{plural(d.differing, 'element')}, max abs {d.max_abs:.4g}, max rel {d.max_rel:.4g}"
        )
    skipped = sum(d.skipped for d in r.arrays.values())
    known = f"; {plural(skipped, 'chunk')} known equal without reading" if skipped else ""
    verdict = "EQUAL" if r.equal else "DIFFERENT"
    lines.append(f"{verdict}: {r.a} vs {r.b}: {r.summary()}{known}")
    return lines
