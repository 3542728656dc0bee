"""The ``CheckpointManager``: a run of numbered steps, in the order docs/manager.md tells it.

``manager`` is the class (saving, its life cycle) and ``reading`` its read side (listing
steps, metrics and metadata, restoring; all a ``read_only=True`` manager uses). Both consult
``ledger``, the run's one view of every step in each tier (which steps exist, whether a step
may be saved, deleting and rolling back, restore's choice), built on ``run`` (the persistent
directory: its committed steps, restoring and deleting one; on object stores found from
``run_index``, one marker per committed step) and, with ``local_directory``,
the local tier of ``jaxckpt._tiers``. ``schedule`` decides when to save (step multiples,
``save_interval_secs``), ``retention`` which steps go (count, best, steps and time; the
metrics file, commit times, pinned steps), ``cleanup`` what dead saves left, ``options`` checks the manager's arguments. ``table`` reads
a run at a glance (``jaxckpt.run_table``, ``jaxckpt ls``) and ``run_view`` prints it.

May import: the public entry points (``jaxckpt._api``), the local tier and elastic recovery
(``jaxckpt._tiers``) and anything below them (``_planning``, ``_sources``, ``_storage``,
``_runtime``, ``_format``). Never ``jaxckpt._cli``.
"""
