"""Pytrees and shardings -> plans: what to write where, and what to read for whom.

Owns tree flattening (``tree``), shard boxes of a sharding (``layout``), packing decisions
(``packing``), the global save plan with its validation (``global_plan``) and its cache
(``plan_cache``),
incremental reuse (``reuse``: which boxes a base already holds), the two planner protocols with their defaults
(``save_planner``, ``load_planner``: the numbered call order is written on ``SavePlanner`` and
``LoadPlanner``), the checks and messages that say why a restore's target does not fit what is
on disk (``mismatch``), and the sharding under which processes share the read of a box
(``shared_read``).

May import: jax, numpy, ``jaxckpt._format``, ``jaxckpt._errors``, ``jaxckpt._runtime``
(placement, staging). Never tensorstore, never ``jaxckpt._storage``: storage gets array data
only through the planner's items.
"""
