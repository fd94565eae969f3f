"""Local rank 0's decisions in paired rounds: a probing session (``_probe``), the lock-in rules
(``_decide``), the re-check of a cached choice (``_check``), the watch after lock-in
(``_watch``), and the records rank 0 broadcasts (``_records``).

Imports ``_config`` and ``measure``.
"""
