"""Processes, threads and host memory.

Owns the distributed agreement of a save (``distributed``: barriers, deadlines, failure
broadcast; ``kvstore``: the coordination service's key-value store, counted), moving bytes between processes (``streams``: bulk bytes peer to peer through each
process's ``jax.experimental.transfer`` server, ``transfer``, or relayed by the key-value store
where there is none; ``replication``: a local part's directory over a stream), one decision for
all of them (``agreement``; ``shared_restore``: a restore across processes fails on all or
none; ``collective``: a collective call made alone says so), the ``jax.monitoring`` events and a save's timings across processes
(``events``), preemption notices (``preemption``), the host staging arenas of
async saves (``staging``) and the bounded buffer a budgeted one streams through (``ring``),
placement of host boxes onto devices (``placement``), the library's thread pools (``pools``, the
one place threads are made) and the C calls Python lacks (``libc``).

May import: jax, numpy, ``jaxckpt._errors`` and, of the format, only ``jaxckpt._format.grid``
(the data layout's alignment, which staged buffers share with in-place reads). Nothing above
it.
"""
