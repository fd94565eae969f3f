"""The tuning cache: ``TuningCache`` (``_cache``), the entry's JSON form (``_entry``, the only
place it is spelled), file primitives (``_cachefile``) and the key (``_fingerprint``).

Imports ``knobs`` and ``measure``.
"""
