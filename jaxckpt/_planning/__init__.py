"""Pytrees and shardings -> plans: what to write where, and what to read for whom.

Owns tree flattening (``tree``), shard boxes of a sharding (``layout``), packing decisions
(``packing``), the global save plan with its validation and cache (``global_plan``), and the
two planner protocols with their defaults (``save_planner``, ``load_planner``: the numbered
call order is written on ``SavePlanner`` and ``LoadPlanner``).

May import: jax, numpy, ``jaxckpt._format``, ``jaxckpt._errors``, ``jaxckpt._runtime``
(placement, staging). Never tensorstore, never ``jaxckpt._storage``: storage gets array data
only through the planner's items.
"""
