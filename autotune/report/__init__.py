"""What a run leaves behind and how it is read: the trace files (``_trace``), the plot
(``_plot``), one directory per run (``_runs``) and ``python -m autotune`` (``_cli``).

Imports ``knobs`` and ``cache``.
"""
