"""How the local ranks agree: the ``Agreement`` protocol and its gloo implementation with
timeouts (``_agree``), what happened to a peer process (``_peers``), and ranks that are threads
of one process (``_inprocess``, re-exported by ``autotune.testing``).

Imports only ``knobs``.
"""
