"""The optimizer's host state: one record per parameter, the flat slabs (master, moments) and
their chunks, the DTensor adapter, masters, weight edits, re-binding, ``state_dict`` I/O, DCP
loading, NUMA placement; :class:`~offload.state._layout.HostLayout` holds it all. Beside it,
``_clip``: gradient clipping and GradScaler's arguments read into the step (the norm terms of the
gradients, the coefficient the kernel applies), over the records and the DTensor adapter.

Imports ``kernels`` and ``threads`` (and the leaf records ``offload._settings``).
"""
