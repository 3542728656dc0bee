"""The ``CheckpointManager``: steps of a run, retention, metrics, tiers.

Builds on the public entry points (``jaxckpt._api``) and the storage catalog; the ``manager``
module is the class, ``ledger`` the run's one view of both tiers that every call of it
consults (which steps exist, whether a step may be saved, deleting and rolling back,
restore's choice), ``retention`` decides which steps go and keeps the metrics file,
``table`` reads a run at a glance (``jaxckpt.run_table``, ``jaxckpt ls``), ``tiers`` is the
optional local tier (node-local parts, their replicas, the agreement on what
to restore) and ``local_part`` one process's part as a single-process checkpoint.

May import: anything below the public face (``_api``, ``_storage``, ``_runtime``, ``_format``).
"""
