"""``overlap_backward``: backward hooks that see a chunk's gradients arrive, the launcher that
starts the chunk then as a speculation (out of place, into the second generation of the state),
and the speculation's checks.

Imports ``state``, ``pipeline`` and ``kernels``.
"""
