"""What a checkpoint is: the on-disk vocabulary every layer shares.

Owns the manifest (``manifest``: frozen entry dataclasses, JSON in and out, format versions,
dtype names), storage names (``names``: the ``arrays/...`` paths keys become, staging names),
the plan items that planners hand to storage (``plan``: ``WriteItem``/``ReadItem``/
``SavePlan``/``LoadPlan``) and the chunk-grid arithmetic both sides agree on (``grid``).

May import: numpy, ml_dtypes and ``jaxckpt._errors``. Never jax, never tensorstore: whatever
reads a checkpoint can use this vocabulary without either.
"""
