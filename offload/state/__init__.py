"""The optimizer's host state: one record per parameter, the flat slabs (master, moments) and
their chunks, the DTensor adapter, masters, weight edits, re-binding, ``state_dict`` I/O, DCP
loading, NUMA placement; :class:`~offload.state._layout.HostLayout` holds it all.

Imports ``kernels`` and ``threads`` (and the leaf records ``offload._settings``).
"""
