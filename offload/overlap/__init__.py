"""``overlap_backward``: backward hooks that see a chunk's gradients arrive, the launcher that
starts the chunk then as a speculation, and the speculation's backups and checks.

Imports ``state``, ``pipeline`` and ``kernels``.
"""
