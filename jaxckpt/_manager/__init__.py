"""The ``CheckpointManager``: steps of a run, retention, metrics.

Builds on the public entry points (``jaxckpt._api``) and the storage catalog; the ``manager``
module is the class, ``retention`` decides which steps go and keeps the metrics file.

May import: anything below the public face (``_api``, ``_storage``, ``_runtime``, ``_format``).
"""
