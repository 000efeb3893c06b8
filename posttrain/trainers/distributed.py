"""PyTorch distributed for every trainer: process group, sharding helpers, reductions, FSDP2.

Started by ``torchrun`` (it sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``...);
without it everything here is a no-op and a trainer runs as one process. Backend: NCCL when
the run uses CUDA: one process group ``cpu:gloo,cuda:nccl`` (CPU tensors take gloo, CUDA tensors
NCCL), each rank on the GPU of its ``LOCAL_RANK``; gloo alone on the CPU.

Data parallelism (the default) replicates the model on every rank and sums gradients across
ranks with one all-reduce of the flattened gradients at each optimizer step (the gradient
``DistributedDataParallel`` computes with ``no_sync`` over the micro-batches and a synchronised
last one). It is done at the optimizer step instead of inside ``backward`` because RL steps
interleave generation with training and ranks may run different numbers of micro-batches;
DDP's per-backward hooks would deadlock there. Losses are divided by GLOBAL token / sequence
counts (:meth:`Dist.sum`), so the summed gradient is exactly the full-batch gradient.

``fsdp: true`` shards parameters, gradients and optimizer state with FSDP2
(:func:`torch.distributed.fsdp.fully_shard`, one group per decoder layer plus the root); its
reduce-scatter sums (divide factor 1) for the same reason. Generation under FSDP2 gathers the
weights once for the whole decode loop (ranks may decode different numbers of tokens).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from posttrain.core.device import process_group_backend, resolve_device


class Dist:
    """This process's place in the run: rank, world size, and the collectives trainers use."""

    def __init__(self, device: str = "auto") -> None:
        """`device`: config key `device`; under torchrun the rank's own device
        (`posttrain.core.device.process_device`) and one process group for both kinds of
        tensor (`process_group_backend`: gloo for CPU tensors, NCCL for CUDA ones)."""
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.fsdp = False
        self.device = resolve_device(device)
        if self.world > 1 and not dist.is_initialized():
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group(process_group_backend(self.device))

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, items: list[Any]) -> list[Any]:
        """This rank's share of a global list: items rank, rank + world, ... (strided)."""
        return items[self.rank :: self.world] if self.enabled else items

    def sum(self, value: float | torch.Tensor) -> Any:
        """Sum over ranks (a float comes back as a float, a tensor as a tensor)."""
        if not self.enabled:
            return value
        t = torch.as_tensor(value, dtype=torch.float64).clone()
        t = self._all_reduce(t, dist.ReduceOp.SUM)
        if isinstance(value, torch.Tensor):
            return t.to(value.dtype).to(value.device)
        return float(t)

    def max(self, value: float) -> float:
        """Largest value over ranks (peak memory)."""
        if not self.enabled:
            return value
        return float(self._all_reduce(torch.tensor(float(value), dtype=torch.float64),
                                      dist.ReduceOp.MAX))

    def any(self, flag: bool) -> bool:
        """True on every rank when it is True on any rank."""
        if not self.enabled:
            return flag
        return bool(self._all_reduce(torch.tensor(float(flag)), dist.ReduceOp.MAX) > 0)

    def mean_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Every metric averaged over ranks (keys missing on a rank count as absent there)."""
        if not self.enabled:
            return metrics
        keys = sorted(set().union(*self._gather_objects(sorted(metrics))))
        vals = torch.tensor([float(metrics.get(k, 0.0)) for k in keys], dtype=torch.float64)
        cnt = torch.tensor([float(k in metrics) for k in keys], dtype=torch.float64)
        both = self._all_reduce(torch.stack([vals, cnt]), dist.ReduceOp.SUM)
        return {k: float(both[0, i] / both[1, i]) for i, k in enumerate(keys)}

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order."""
        return self._gather_objects(obj) if self.enabled else [obj]

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()

    # ---- models ------------------------------------------------------------------------------
    def wrap(self, model: torch.nn.Module, fsdp: bool) -> torch.nn.Module:
        """Shard `model` with FSDP2 when `fsdp`, else leave it replicated (see module doc)."""
        if not self.enabled:
            return model
        if not fsdp:
            self.broadcast_params(model)
            return model
        from torch.distributed.fsdp import fully_shard

        self.fsdp = True
        for layer in _decoder_layers(model):
            fully_shard(layer, reshard_after_forward=True)
        fully_shard(model, reshard_after_forward=True)
        for mod in model.modules():  # sum gradients (as data parallel), with plain SUM comms
            if hasattr(mod, "set_gradient_divide_factor"):
                mod.set_gradient_divide_factor(1.0)  # type: ignore[operator]
                mod.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        return model

    def broadcast_params(self, model: torch.nn.Module) -> None:
        """Rank 0's weights on every rank (they are loaded identically; this makes it certain)."""
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)

    def sync_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the gradients of `params` over ranks (data parallel; FSDP2 already did)."""
        if not self.enabled or self.fsdp:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat = self._all_reduce(flat, dist.ReduceOp.SUM)
        offset = 0
        for p, g in zip(params, grads, strict=True):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(p).to(p.dtype)
            offset += n

    @contextlib.contextmanager
    def gathered(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """Full weights for a stretch of forward passes without collectives (generation)."""
        if not self.fsdp:
            yield model
            return
        mods = [m for m in model.modules() if hasattr(m, "unshard")]
        for m in mods:
            m.set_reshard_after_forward(False)  # type: ignore[operator]
            m.unshard()  # type: ignore[operator]
        try:
            yield model
        finally:
            for m in mods:
                m.reshard()  # type: ignore[operator]
                m.set_reshard_after_forward(True)  # type: ignore[operator]

    # ---- internals -------------------------------------------------------------------------
    def _all_reduce(self, t: torch.Tensor, op: Any) -> torch.Tensor:
        """All-reduce `t` in place on its own device (the process group sends CPU tensors to
        gloo, CUDA tensors to NCCL); every caller passes a tensor of its own."""
        dist.all_reduce(t, op=op)
        return t

    def _gather_objects(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face causal LM (`model.model.layers` and the like)."""
    for mod in model.modules():
        layers = getattr(mod, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
            return list(layers)
    return []


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer,
               fsdp: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Unsharded (model, optimizer) state dicts on the CPU; under FSDP2 every rank must call."""
    if not fsdp:
        return model.state_dict(), opt.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(model, opt, options=opts)


def load_full_state(model: torch.nn.Module, opt: torch.optim.Optimizer, model_sd: dict[str, Any],
                    opt_sd: dict[str, Any], fsdp: bool) -> None:
    """Inverse of :func:`full_state` (every rank loads the same full state; FSDP2 shards it)."""
    if not fsdp:
        model.load_state_dict(model_sd)
        opt.load_state_dict(opt_sd)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=opt_sd,
                   options=StateDictOptions(full_state_dict=True))
