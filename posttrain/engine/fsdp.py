"""FSDP2 start-up, mixed precision and sharded checkpoints (used by `Dist` and the base trainer).

Start-up: rank 0 loads the weights on the CPU, the other ranks build the model on ``meta``;
`shard` applies ``fully_shard`` (one group per decoder layer plus the root), allocates each rank's
shards and fills them from rank 0 (``set_model_state_dict(..., broadcast_from_rank0=True)``;
buffers broadcast). Mixed precision (`bf16_compute`, CUDA): layers all-gather in bf16 and
reduce-scatter in fp32; the root group (embeddings, final norm, LM head) keeps fp32; the sharded
fp32 parameters are AdamW's master weights. Checkpoints: weights and AdamW state to ``sharded/``
(``torch.distributed.checkpoint``, each rank its shards); ``model/`` and ``final/`` by rank 0
from ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` (weights only; the
optimizer is never gathered). Waits for the writers run on a gloo group with
`CHECKPOINT_TIMEOUT`.
More: docs/distributed.md, "Module notes", posttrain.engine.fsdp.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SHARDED = "sharded"
"""The checkpoint sub-directory of the sharded (DCP) weights and optimizer state."""
CHECKPOINT_TIMEOUT = datetime.timedelta(minutes=60)
"""How long ranks wait for each other around a checkpoint write (rank 0 writes `model/` and
`final/` alone); the default process group's timeout (10 min for NCCL) is too short at 7B."""


def mixed_precision(bf16: bool) -> Any:
    """The decoder layers' ``MixedPrecisionPolicy``: bf16 parameters, fp32 gradient reductions
    (None: fp32 throughout, today's behaviour)."""
    if not bf16:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def on_meta(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def shard(model: torch.nn.Module, layers: list[torch.nn.Module], device: torch.device,
          bf16: bool, any_meta: bool) -> None:
    """``fully_shard`` `model` in place (each of `layers`, then the root) on a 1-D mesh of
    every rank on `device`'s type; when a rank built it on ``meta`` (`any_meta`, the same on
    every rank) the shards are allocated on `device` and filled from rank 0's weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    full = model.state_dict() if any_meta and dist.get_rank() == 0 else {}
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = mixed_precision(bf16)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True,
                    **({"mp_policy": mp} if mp is not None else {}))
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    for mod in model.modules():  # sum gradients (as data parallel), with plain SUM comms
        if hasattr(mod, "set_gradient_divide_factor"):
            mod.set_gradient_divide_factor(1.0)  # type: ignore[operator]
            mod.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    if not any_meta:
        return
    if on_meta(model):
        model.to_empty(device=device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                               broadcast_from_rank0=True))
    for buf in model.buffers():  # non-persistent buffers are not in the state dict
        moved = buf.to(device)
        dist.broadcast(moved, src=0)
        buf.copy_(moved)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The sharded model's full weights on rank 0's CPU (an empty dict on the other ranks);
    every rank must call."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))


def save_sharded(model: torch.nn.Module, opt: torch.optim.Optimizer, path: Path,
                 group: Any) -> None:
    """Each rank writes its shards of `model` and `opt` under `path` (every rank calls)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, opt_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=str(path),
             process_group=group)


def load_sharded(model: torch.nn.Module, opt: torch.optim.Optimizer, path: Path,
                 group: Any) -> None:
    """Inverse of :func:`save_sharded`: each rank reads its share (every rank calls)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, opt_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": opt_sd}
    dcp.load(state, checkpoint_id=str(path), process_group=group)
    set_state_dict(model, opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
