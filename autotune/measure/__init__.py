"""What is tuned and how a step is measured: the search space of named discrete knobs
(``_space``), a candidate's raw samples and the unpaired noise rule (``_measurement``), and the
paired comparison every decision rests on (``_paired``).

Imports nothing else of ``autotune``.
"""
