"""The thread budget of the CPU step: this machine's topology, the local ranks' affinity
masks, the allocation rule, the plan and its reason, NUMA binding.

Imports nothing else of ``offload`` but the leaf ``_settings`` (``MAX_THREADS`` and the
environment variables of the plan).
"""
