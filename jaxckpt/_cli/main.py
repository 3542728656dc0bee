"""The ``jaxckpt`` command line: inspect, verify, ls, export, convert and diff checkpoints.

A thin layer over :func:`jaxckpt.metadata` and storage reading; it never touches a device.
Exit status: 0 success, 1 damage found (``verify``, or a bad chunk met while exporting) or,
for ``diff``, checkpoints that differ, 2 a usage error or a path that holds no checkpoint (one line on stderr, no traceback)::

    jaxckpt inspect PATH [--json] [-v]     keys, shapes, dtypes, chunk grids, bytes
    jaxckpt verify PATH [--json]           read every chunk, check every checksum
    jaxckpt ls DIR [--all] [--json]        a run's steps: status, tiers, sizes, metrics
    jaxckpt export PATH OUT.safetensors    host-side copy (or OUT.npz); --keys to pick
    jaxckpt convert SRC DST                Orbax / safetensors / jaxckpt -> a jaxckpt checkpoint
    jaxckpt diff A B [--json]              what differs (exit 0 equal, 1 different)

PATH and SRC may also be an Orbax checkpoint or safetensors weights (see docs/migration.md).

This module is the parser and the dispatch; the commands live in ``_cli_inspect`` (inspect,
ls), ``_cli_verify`` (verify), ``_cli_export`` (export, convert) and ``_cli_diff`` (diff), their shared output
helpers in ``_cli_text``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxckpt._errors import CheckpointError, CorruptChunkError, ManifestError
from jaxckpt._version import __version__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status.

    Example:
      >>> import jax.numpy as jnp, jaxckpt, tempfile
      >>> d = tempfile.mkdtemp() + "/c"
      >>> jaxckpt.save(d, {"w": jnp.zeros((4, 2))})
      >>> from jaxckpt._cli.main import main
      >>> main(["verify", d])  # doctest: +ELLIPSIS
      OK: ...
      0
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or argparse's own usage error (already printed)
        return int(e.code or 0)
    from jaxckpt._cli.text import UsageError, for_cli, one_line  # numpy: not for --version

    try:
        status: int = args.run(args)  # the subcommand's run_* function
        return status
    except (UsageError, CheckpointError, OSError) as e:
        damaged = isinstance(e, (CorruptChunkError, ManifestError)) and args.command != "diff"
        code = 1 if damaged else 2  # diff: 1 means "different"; an error is never that
        print(f"jaxckpt {args.command}: error: {for_cli(one_line(e))}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print(f"jaxckpt {args.command}: interrupted", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxckpt",
        description="Inspect, verify, list, export, convert and diff checkpoints. PATH and SRC may be "
        "a jaxckpt checkpoint, an Orbax checkpoint or safetensors weights (a .safetensors file, "
        "a folder of them, or model.safetensors.index.json), as a local path or a file://, "
        "memory://, s3:// or gs:// URL.",
        epilog="Run `jaxckpt COMMAND --help` for a command's options. Exit status: 0 success, "
        "1 damage found (diff: checkpoints that differ), 2 a usage error or a path without a "
        "checkpoint.",
    )
    p.add_argument("--version", action="version", version=f"jaxckpt {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    c = sub.add_parser("inspect", help="keys, shapes, dtypes, chunk grids and bytes")
    c.add_argument("path", metavar="PATH")
    c.add_argument("--json", action="store_true", help="print the listing as JSON")
    c.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also show where each packed array lies in its pack",
    )
    c.set_defaults(run=_run_inspect)
    c = sub.add_parser("verify", help="read every chunk and check its checksum")
    c.add_argument("path", metavar="PATH")
    c.add_argument("--json", action="store_true", help="print the result as JSON")
    c.add_argument("--progress", action="store_true", help="show progress on stderr")
    c.set_defaults(run=_run_verify)
    _add_ls(sub)
    c = sub.add_parser("export", help="copy arrays to OUT.safetensors or OUT.npz on this host")
    c.add_argument("path", metavar="PATH")
    c.add_argument("out", metavar="OUT", type=Path)
    c.add_argument("--keys", nargs="+", metavar="KEY", help="only these keys or key prefixes")
    c.add_argument("--force", action="store_true", help="replace OUT if it exists")
    c.add_argument("--progress", action="store_true", help="show progress on stderr")
    c.set_defaults(run=_run_export)
    c = sub.add_parser("convert", help="write an Orbax / safetensors / jaxckpt source as jaxckpt")
    c.add_argument("src", metavar="SRC")
    c.add_argument("dst", metavar="DST")
    c.add_argument("--overwrite", action="store_true", help="replace a checkpoint at DST")
    c.add_argument("--progress", action="store_true", help="show progress on stderr from the start")
    c.add_argument(
        "--max-chunk-bytes",
        type=_positive_bytes,
        metavar="N",
        help="largest chunk written (default 64 MiB; smaller for restores on many hosts)",
    )
    c.set_defaults(run=_run_convert)
    _add_diff(sub)
    return p


def _add_ls(sub: Any) -> None:
    c = sub.add_parser("ls", help="a run's steps: status, tiers, sizes, metrics, marks")
    c.add_argument("path", metavar="DIR")
    c.add_argument("--all", action="store_true", help="include hidden (temporary) directories")
    c.add_argument("--json", action="store_true", help="print the listing as JSON")
    c.add_argument(
        "--best",
        metavar="METRIC[:max]",
        help="mark the best committed step by this metric (lowest; :max for highest)",
    )
    c.add_argument(
        "--local", metavar="LOCAL_DIR", help="the manager's local_directory: show local tiers"
    )
    c.set_defaults(run=_run_ls)


def _add_diff(sub: Any) -> None:
    c = sub.add_parser("diff", help="what differs between two checkpoints (0 equal, 1 different)")
    c.add_argument("a", metavar="A")
    c.add_argument("b", metavar="B")
    c.add_argument("--json", action="store_true", help="print the differences as JSON")
    c.add_argument("--progress", action="store_true", help="show progress on stderr")
    c.set_defaults(run=_run_diff)


# Each command's module is imported when it runs, not with the parser: `--version`, `inspect`
# and `ls` never import jax (tests/test_import.py), the others import what they use.
def _run_inspect(args: argparse.Namespace) -> int:
    from jaxckpt._cli.inspect import run_inspect

    return run_inspect(args)


def _run_ls(args: argparse.Namespace) -> int:
    from jaxckpt._cli.inspect import run_ls

    return run_ls(args)


def _run_verify(args: argparse.Namespace) -> int:
    from jaxckpt._cli.verify import run_verify

    return run_verify(args)


def _run_export(args: argparse.Namespace) -> int:
    from jaxckpt._cli.export import run_export

    return run_export(args)


def _run_convert(args: argparse.Namespace) -> int:
    from jaxckpt._cli.export import run_convert

    return run_convert(args)


def _run_diff(args: argparse.Namespace) -> int:
    from jaxckpt._cli.diff import run_diff

    return run_diff(args)


def _positive_bytes(text: str) -> int:
    """A byte count on the command line: a positive integer (argparse reports the rest)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive number of bytes (e.g. 8388608)"
        )
    return n


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


__all__ = ["main"]
