"""The public entry points: ``save``, ``save_async``, ``restore``, ``metadata``.

``entry`` holds the four calls and ``SaveHandle``: each is a short pipeline, planner (tree ->
plan) then storage (plan -> tensorstore), so a reader can follow ``save()`` to the byte written
in three hops. Beside it, the glue that carries a save out where it needs planning, storage
and the runtime at once: ``staged`` (``save_async``'s staging: all at once, or streaming
through a ring within ``max_host_bytes``) and ``incremental`` (a save against a base: its
boxes hashed, linked or referenced instead of written); ``reports`` (what a save or restore
reports when it ends: log lines, ``jax.monitoring`` events, stragglers).

May import: ``jaxckpt._planning``, ``jaxckpt._sources``, ``jaxckpt._storage``,
``jaxckpt._runtime``, ``jaxckpt._format`` and ``jaxckpt._errors``. Never ``jaxckpt._tiers``,
``jaxckpt._manager`` or ``jaxckpt._cli``: those are built on these calls.
"""
