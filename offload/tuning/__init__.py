"""The optimizer's side of ``autotune``: its search space, workload and kernel vote, the
``StepStats`` fed to the ``OnlineTuner``, and the one agreement per node shared by the
thread plan, the kernel vote and the tuner.

Imports ``threads``, ``state`` and the leaf records.
"""
