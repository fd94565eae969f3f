"""The tuner every rank runs: ``OnlineTuner`` (``_tuner``), local rank 0's schedule of cache
lookup, probing, re-check, lock-in and watch (``_schedule``), and ``TuningSession`` for anyone's
knobs (``_session``).

Imports every other part of ``autotune`` but ``testing``.
"""
