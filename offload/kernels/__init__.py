"""AdamW on one chunk of host slabs: torch's fused CPU kernel, the native single-pass
kernel (fused-mp, ``csrc/``) and its build, and the per-tensor norm/checksum pass.

Imports nothing else of ``offload`` but the leaf ``_settings`` (where the build goes:
``extensions_dir``).
"""
