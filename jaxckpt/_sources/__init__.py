"""Foreign formats behind the same ``Reader`` protocol, and conversion between formats.

``detect.open_source`` looks at a path and returns a manifest plus a reader for a jaxckpt
checkpoint, an Orbax item, step or JSON item (``orbax_step`` picks; ``orbax_metadata`` checks
the metadata, ``orbax`` opens the arrays) or safetensors weights (``safetensors``); the load
planner sees only that protocol. ``convert`` copies any of them into a jaxckpt checkpoint; ``diff`` compares two of them.

May import: ``jaxckpt._format``, ``jaxckpt._storage``, ``jaxckpt._errors``, numpy,
tensorstore, and ``jaxckpt._runtime.progress`` (the one progress display of long work). Never jax or ``jaxckpt._planning``: a source describes bytes, the planner places them.
"""
