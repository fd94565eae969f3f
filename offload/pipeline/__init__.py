"""The chunked step: jobs, the operands of each kernel call, staging buffers, the host and
CUDA transports, the worker thread, the jobs of one ``step()``, its stage timings.

Imports ``state``, ``kernels``, ``threads`` and the leaf records; never ``overlap``.
"""
