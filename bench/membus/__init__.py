"""The step and its kernels against the memory bus: each benchmark times its variants in interleaved
rounds next to the read-4/write-3 streaming probe (``_stream``) and reports the ratio
(``python -m bench.membus.<name>``)."""
