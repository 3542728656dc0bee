"""What a checkpoint is: the on-disk vocabulary every layer shares.

Owns the manifest (``manifest``: the ``Manifest``, its JSON in and out, format versions;
``entries``: the frozen entry dataclasses; ``manifest_check``: what a manifest on disk may hold,
every field of untrusted JSON checked, and the limits save shares; ``dtypes``: the dtype names a
checkpoint stores and their carriers), storage names (``names``: the ``arrays/...`` paths keys
become, staging names), the plan items that planners hand to storage (``plan``:
``WriteItem``/``ReadItem``/``SavePlan``/``LoadPlan``) and the chunk-grid arithmetic both sides
agree on (``grid``).

May import: numpy, ml_dtypes and ``jaxckpt._errors``. Never jax, never tensorstore: whatever
reads a checkpoint can use this vocabulary without either.
"""
