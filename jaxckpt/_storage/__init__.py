"""Plan items <-> bytes: where checkpoints live and how their arrays are written and read.

Owns locations (``location``: the manifest's bytes, deadlines; ``urls``: path/URL -> kvstore spec),
the writer (``writer``) and the two commit protocols (``local_commit``: a staging directory
renamed into place; ``generations``: object stores, the manifest written last), the lease of a
live save (``lease``), resuming a failed save (``resume``), the ``held-by`` markers of
incremental references (``holds``), hard links of unchanged boxes (``links``), the reader
(``reader``) and in-place chunk reads (``chunkfile``), packed arrays on read (``packs``), early
write-back (``writeback``), listing/deleting checkpoints (``catalog``) and the errors about a
save's target (``messages``). The writer's call order and the ``Reader`` protocol are written
down in ``writer`` and ``reader``.

May import: tensorstore, numpy, ``jaxckpt._format``, ``jaxckpt._errors``,
``jaxckpt._runtime.pools`` and ``jaxckpt._runtime.libc`` (the C calls Python lacks). Never jax,
never ``jaxckpt._planning``.
"""
