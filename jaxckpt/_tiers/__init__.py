"""The local tier and elastic recovery: a step's parts on node-local disks, and how they come back.

Below the manager, above storage and the runtime. ``local_tier`` is the tier a
``CheckpointManager`` with ``local_directory`` keeps (``LocalTier``: saving each process's
part, replicating it to peers, retention, the agreement on what to restore); ``local_part``
is one process's part as a single-process checkpoint, ``local_disk`` what one disk holds,
``local_run`` which run a local directory belongs to. ``tier_choice`` is the restore
decision (a pure function of what each process holds); when it picks a step saved for
another layout or process count, ``elastic_restore`` carries out the elastic restore in its
numbered steps: ``elastic`` plans who reads which saved box and sends which piece to whom (a
pure function), ``elastic_moves`` reads, streams and places the boxes.

May import: the public entry points (``jaxckpt._api``), ``jaxckpt._planning``,
``jaxckpt._sources``, ``jaxckpt._storage``, ``jaxckpt._runtime``, ``jaxckpt._format`` and
``jaxckpt._errors``. Never ``jaxckpt._manager`` (the run that uses this tier) or
``jaxckpt._cli``.
"""
