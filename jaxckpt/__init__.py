"""jaxckpt: fast, safe checkpoints of sharded JAX state, through tensorstore zarr v3.

The errors are imported with the package; the manifest's classes and the plan items (numpy)
on first use of one of them, and every other public name (jax) on first use of one of them
(PEP 562): ``import jaxckpt`` imports neither numpy nor jax, and the command line's
``--version``, ``inspect`` and ``ls`` never import jax.
"""

import typing as _typing

from jaxckpt._errors import ArgumentTypeError as ArgumentTypeError
from jaxckpt._errors import CheckpointChangedError as CheckpointChangedError
from jaxckpt._errors import CheckpointError as CheckpointError
from jaxckpt._errors import CheckpointExistsError as CheckpointExistsError
from jaxckpt._errors import CheckpointNotFoundError as CheckpointNotFoundError
from jaxckpt._errors import CorruptChunkError as CorruptChunkError
from jaxckpt._errors import DistributedError as DistributedError
from jaxckpt._errors import DtypeMismatchError as DtypeMismatchError
from jaxckpt._errors import InvalidArgumentError as InvalidArgumentError
from jaxckpt._errors import KeyMismatchError as KeyMismatchError
from jaxckpt._errors import ManifestError as ManifestError
from jaxckpt._errors import PlanValidationError as PlanValidationError
from jaxckpt._errors import ShapeMismatchError as ShapeMismatchError
from jaxckpt._errors import UnsupportedLeafError as UnsupportedLeafError
from jaxckpt._version import __version__ as __version__

if _typing.TYPE_CHECKING:
    from jaxckpt._api.entry import SaveHandle as SaveHandle
    from jaxckpt._api.entry import save as save
    from jaxckpt._api.entry import save_async as save_async
    from jaxckpt._api.restoring import metadata as metadata
    from jaxckpt._api.restoring import restore as restore
    from jaxckpt._format.manifest import ArrayEntry as ArrayEntry
    from jaxckpt._format.manifest import Manifest as Manifest
    from jaxckpt._format.manifest import ValueEntry as ValueEntry
    from jaxckpt._format.plan import LoadPlan as LoadPlan
    from jaxckpt._format.plan import ReadItem as ReadItem
    from jaxckpt._format.plan import SavePlan as SavePlan
    from jaxckpt._format.plan import WriteItem as WriteItem
    from jaxckpt._manager.manager import CheckpointManager as CheckpointManager
    from jaxckpt._manager.run_view import RunTable as RunTable
    from jaxckpt._manager.table import run_table as run_table
    from jaxckpt._planning.global_plan import GlobalSavePlan as GlobalSavePlan
    from jaxckpt._planning.load_planner import DefaultLoadPlanner as DefaultLoadPlanner
    from jaxckpt._planning.load_planner import LoadPlanner as LoadPlanner
    from jaxckpt._planning.plan_cache import plan_cache_info as plan_cache_info
    from jaxckpt._planning.save_planner import DefaultSavePlanner as DefaultSavePlanner
    from jaxckpt._planning.save_planner import SavePlanner as SavePlanner
    from jaxckpt._sources.convert import convert as convert
    from jaxckpt._sources.diff import CheckpointDiff as CheckpointDiff
    from jaxckpt._sources.diff import diff as diff
else:
    # The thread pools' module registers with threading's shutdown when first imported, which
    # Python refuses once it is shutting down: imported now, a save made from an atexit hook
    # (before anything else of jaxckpt was used) still runs.
    import concurrent.futures.thread as _thread_pools  # noqa: F401
    import importlib as _importlib

    # name -> the module it is defined in. The manifest's classes and the plan items (numpy
    # only) are imported on first use of one of them; the others (jax) on first use of one of
    # them, all at once, with the first group.
    _LIGHT = {
        "ArrayEntry": "jaxckpt._format.manifest",
        "Manifest": "jaxckpt._format.manifest",
        "ValueEntry": "jaxckpt._format.manifest",
        "LoadPlan": "jaxckpt._format.plan",
        "ReadItem": "jaxckpt._format.plan",
        "SavePlan": "jaxckpt._format.plan",
        "WriteItem": "jaxckpt._format.plan",
    }
    _LAZY = {
        **_LIGHT,
        "SaveHandle": "jaxckpt._api.entry",
        "metadata": "jaxckpt._api.restoring",
        "restore": "jaxckpt._api.restoring",
        "save": "jaxckpt._api.entry",
        "save_async": "jaxckpt._api.entry",
        "CheckpointManager": "jaxckpt._manager.manager",
        "RunTable": "jaxckpt._manager.run_view",
        "run_table": "jaxckpt._manager.table",
        "GlobalSavePlan": "jaxckpt._planning.global_plan",
        "DefaultLoadPlanner": "jaxckpt._planning.load_planner",
        "LoadPlanner": "jaxckpt._planning.load_planner",
        "plan_cache_info": "jaxckpt._planning.plan_cache",
        "DefaultSavePlanner": "jaxckpt._planning.save_planner",
        "SavePlanner": "jaxckpt._planning.save_planner",
        "convert": "jaxckpt._sources.convert",
        "CheckpointDiff": "jaxckpt._sources.diff",
        "diff": "jaxckpt._sources.diff",
    }

    def __getattr__(name: str) -> object:
        if name not in _LAZY:
            raise AttributeError(f"module 'jaxckpt' has no attribute {name!r}")
        for each, module in (_LIGHT if name in _LIGHT else _LAZY).items():
            globals()[each] = getattr(_importlib.import_module(module), each)
        return globals()[name]

    def __dir__() -> list[str]:
        return sorted({*globals(), *_LAZY})


__all__ = [
    "ArgumentTypeError",
    "ArrayEntry",
    "CheckpointChangedError",
    "CheckpointDiff",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CorruptChunkError",
    "DefaultLoadPlanner",
    "DefaultSavePlanner",
    "DistributedError",
    "DtypeMismatchError",
    "GlobalSavePlan",
    "InvalidArgumentError",
    "KeyMismatchError",
    "LoadPlan",
    "LoadPlanner",
    "Manifest",
    "ManifestError",
    "PlanValidationError",
    "ReadItem",
    "RunTable",
    "SaveHandle",
    "SavePlan",
    "SavePlanner",
    "ShapeMismatchError",
    "UnsupportedLeafError",
    "ValueEntry",
    "WriteItem",
    "convert",
    "diff",
    "metadata",
    "plan_cache_info",
    "restore",
    "run_table",
    "save",
    "save_async",
]
