"""Plan items <-> bytes: where checkpoints live and how their arrays are written and read.

Owns locations (``location``: path/URL -> tensorstore kvstore, the manifest's bytes), the
writer and its commit protocol (``writer``), the reader (``reader``) and in-place chunk reads
(``chunkfile``), packed arrays on read (``packs``), early write-back (``writeback``),
listing/deleting checkpoints (``catalog``) and the libc calls Python lacks (``libc``). The
writer's call order and the ``Reader`` protocol are written down in ``writer`` and ``reader``.

May import: tensorstore, numpy, ``jaxckpt._format``, ``jaxckpt._errors``,
``jaxckpt._runtime.pools``. Never jax, never ``jaxckpt._planning``.
"""
