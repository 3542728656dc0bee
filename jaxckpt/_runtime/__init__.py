"""Processes, threads and host memory.

Owns the distributed agreement of a save (``distributed``: barriers, deadlines, failure
broadcast), moving bytes between processes (``streams``: bulk bytes peer to peer through each
process's ``jax.experimental.transfer`` server, ``transfer``, or relayed by the key-value store
where there is none; ``replication``: a local part's directory over a stream), one decision for
all of them (``agreement``), preemption notices (``preemption``), the host staging arena of async saves
(``staging``), placement of host boxes onto devices (``placement``) and the library's thread
pools (``pools``, the one place threads are made).

May import: jax, numpy, ``jaxckpt._errors`` and, of the format, only ``jaxckpt._format.grid``
(the data layout's alignment, which staged buffers share with in-place reads). Nothing above
it.
"""
