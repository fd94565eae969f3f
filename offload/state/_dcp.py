"""``MasterParamLoadPlanner``: DCP's default load planner, except for the one key only we ask for.

A ``torch.optim.AdamW`` checkpoint of a bf16/fp16 model has no ``master_param`` (torch steps the
low-precision weight itself); ``CPUOffloadAdamW.state_dict()``, the template ``dcp.load`` fills,
has one per such parameter. The default planner then refuses the load ("Missing key in
checkpoint state_dict: ...master_param"), and ``allow_partial_load=True`` would also let a missing
moment or weight through, silently leaving the template's values in place. This planner drops
exactly the ``master_param`` entries the checkpoint lacks, from the state dict being loaded too,
so ``load_state_dict`` seeds those masters from the loaded weights (as for a torch state dict
loaded directly); every other missing key still raises. On a checkpoint that has the masters
(one of ours) it is the default planner.

Imported on first use (``offload.MasterParamLoadPlanner``): ``torch.distributed.checkpoint``
costs about 1 s to import.
"""

from __future__ import annotations

import logging
from typing import Any

from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

logger = logging.getLogger(__name__)

__all__ = ["MasterParamLoadPlanner"]

MASTER_KEY = "master_param"


class MasterParamLoadPlanner(DefaultLoadPlanner):
    """``dcp.load(state, checkpoint_id=..., planner=MasterParamLoadPlanner())``: a torch AdamW
    checkpoint of a bf16/fp16 model loads into ``CPUOffloadAdamW`` (see the module doc)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True, allow_partial_load=False)
        self.dropped: list[str] = []
        """The flattened keys of the masters the checkpoint lacked (seeded from the weights)."""

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is None:
            return
        saved = metadata.state_dict_metadata
        root = self.original_state_dict
        missing = [key for key, path in self.mappings.items()
                   if key not in saved and _is_master(root, path)]
        for key in missing:
            path = self.mappings.pop(key)
            del self.state_dict[key]
            parent = _walk(root, path[:-1])
            del parent[_key_of(parent, path[-1])]
        self.dropped = missing
        if missing:
            logger.info("MasterParamLoadPlanner: %d master_param entr%s not in the checkpoint "
                        "(a torch AdamW checkpoint): seeded from the loaded weights",
                        len(missing), "y" if len(missing) == 1 else "ies")


def _is_master(root: Any, path: tuple) -> bool:
    """An optimizer state's ``master_param``, in an optimizer state dict (one with param groups):
    ``(..., "state", <fqn or id>, "master_param")`` (``opt.state_dict()``,
    ``get_optimizer_state_dict``) or ``(..., "state.<fqn>.master_param")`` (flat:
    ``flatten_optimizer_state_dict=True``, torchtitan's ``OptimizersContainer``). A model weight
    that happens to be called ``master_param`` is not one: it still has to be in the checkpoint."""
    last = path[-1] if path else None
    if last == MASTER_KEY:
        if len(path) < 3 or path[-3] != "state":
            return False
        optim = _walk(root, path[:-3])
        return isinstance(optim, dict) and "param_groups" in optim
    if isinstance(last, str) and last.startswith("state.") and last.endswith("." + MASTER_KEY):
        optim = _walk(root, path[:-1])
        return isinstance(optim, dict) and any(str(k).startswith("param_groups.") for k in optim)
    return False


def _walk(node: Any, parts: tuple) -> Any:
    for part in parts:
        node = node[_key_of(node, part)]
    return node


def _key_of(parent: Any, part: Any) -> Any:
    """``flatten_state_dict`` spells every mapping key with ``str()`` (``state[0]`` is ``"0"``)."""
    if isinstance(parent, list) or part in parent:
        return part
    return next(k for k in parent if str(k) == part)
