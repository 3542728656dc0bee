"""The public surface is pinned: adding or removing a public name is a deliberate change."""

import inspect

import jaxckpt

PUBLIC = {
    "ArgumentTypeError", "ArrayEntry", "CheckpointChangedError", "CheckpointDiff", "CheckpointError", "CheckpointExistsError", "CheckpointManager", "CheckpointNotFoundError",
    "CorruptChunkError", "DefaultLoadPlanner", "DefaultSavePlanner", "DistributedError",
    "DtypeMismatchError", "GlobalSavePlan", "InvalidArgumentError", "KeyMismatchError", "LoadPlan", "LoadPlanner",
    "Manifest", "ManifestError", "PlanValidationError", "ReadItem", "RunTable", "SaveHandle", "SavePlan",
    "SavePlanner", "ShapeMismatchError", "UnsupportedLeafError", "ValueEntry", "WriteItem", "convert", "diff",
    "metadata", "plan_cache_info", "restore", "run_table", "save", "save_async",
}  # fmt: skip


def test_all_is_pinned():
    assert set(jaxckpt.__all__) == PUBLIC


def test_namespace_holds_only_all():
    jaxckpt.save  # noqa: B018  (the names that need jax load on first use of one: all of them)
    names = {n for n in vars(jaxckpt) if not n.startswith("_")}
    assert names == PUBLIC
    assert {n for n in dir(jaxckpt) if not n.startswith("_")} == PUBLIC


def test_every_public_name_is_documented():
    missing = []
    for name in PUBLIC:
        obj = getattr(jaxckpt, name)
        if not obj.__doc__:
            missing.append(name)
        if inspect.isclass(obj):  # and every public method or property (docs inherit)
            for attr, value in vars(obj).items():
                fn = value.fget if isinstance(value, property) else value
                if (
                    not attr.startswith("_")
                    and callable(fn)
                    and not inspect.getdoc(getattr(obj, attr))
                ):
                    missing.append(f"{name}.{attr}")
    assert not missing


def test_errors_share_one_hierarchy():
    for name in PUBLIC:
        obj = getattr(jaxckpt, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, jaxckpt.CheckpointError), name
