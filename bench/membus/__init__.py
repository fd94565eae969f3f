"""The step and its kernels against the memory bus (``python -m bench.membus.<name>``): each benchmark
times its variants in interleaved rounds (``_harness``, the one timing loop, statistics and command
line they share) next to the read-4/write-3 streaming probe (``_stream``) and reports the ratios."""
