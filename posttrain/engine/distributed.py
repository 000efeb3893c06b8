"""PyTorch distributed for every trainer: process group, sharding helpers, reductions, FSDP2.

Started by ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``...); without it everything here
is a no-op. Backend: one group ``cpu:gloo,cuda:nccl`` when the run uses CUDA, each rank on the
GPU of its ``LOCAL_RANK``; gloo alone on the CPU.

Data parallelism (default): the model replicated, gradients summed across ranks by one all-reduce
of the flattened gradients at each optimizer step, not in ``backward`` (RL steps interleave
generation and ranks may run different numbers of micro-batches: DDP's hooks would deadlock).
Losses are divided by GLOBAL token / sequence counts (:meth:`Dist.sum`), so the summed gradient
is exactly the full-batch gradient. ``fsdp: true``: FSDP2 (``fully_shard``, one group per decoder
layer plus the root), reduce-scatter summing; generation gathers the weights once per decode
loop. Start-up, bf16 and sharded checkpoints: `posttrain.engine.fsdp`.
More: docs/distributed.md, "Module notes", posttrain.engine.distributed.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from posttrain.core.device import process_group_backend, resolve_device
from posttrain.models.bf16_copy import decoder_layers

WEIGHT = "_weight/"
"""A step metric ``k`` may come with ``metrics[WEIGHT + k]``: this rank's weight of it (its
token or sample count), making the mean over ranks a weighted one (`weighted`)."""


def weighted(metrics: dict[str, float], weight: float) -> dict[str, float]:
    """`metrics` (this rank's means over `weight` tokens or samples) with their weights."""
    return {**metrics, **{WEIGHT + k: float(weight) for k in metrics}}


def metric_kind(key: str, counts: frozenset[str] = frozenset()) -> str:
    """How a logged metric combines over micro-batches and ranks: ``"sum"`` (a per-rank count:
    a key in `counts`, or under a prefix in it that ends with ``/``), ``"max"`` / ``"min"``
    (keys ending in ``_max`` / ``_min``) or ``"mean"`` (every other key; weighted when it
    comes with a weight, `weighted`)."""
    if key in counts or any(p.endswith("/") and key.startswith(p) for p in counts):
        return "sum"
    if key.endswith("_max"):
        return "max"
    if key.endswith("_min"):
        return "min"
    return "mean"


def reduce_values(vals: list[float], kind: str) -> float:
    """`vals` (one per rank or per optimizer step) combined by `kind`; NaN when empty."""
    if not vals:
        return float("nan")
    if kind == "sum":
        return sum(vals)
    if kind == "max":
        return max(vals)
    if kind == "min":
        return min(vals)
    return sum(vals) / len(vals)


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
            _CREATED.append(dist.group.WORLD)

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

    def reduce_metrics(self, metrics: dict[str, float],
                       counts: frozenset[str] = frozenset()) -> dict[str, float]:
        """This rank's step metrics -> the global ones, by kind (`metric_kind`): `counts`
        summed, `*_max` / `*_min` the MAX / MIN, every other key the mean over the ranks that
        have it, weighted where it comes with a weight (a value every rank computed from
        gathered data stays as it is)."""
        weights = {k[len(WEIGHT):]: metrics[k] for k in metrics if k.startswith(WEIGHT)}
        metrics = {k: v for k, v in metrics.items() if not k.startswith(WEIGHT)}
        if not self.enabled:
            return metrics
        keys = sorted(set().union(*self._gather_objects(sorted(metrics))))
        rows = self._gather_objects([(metrics.get(k), weights.get(k, 1.0)) for k in keys])
        out = {}
        for i, k in enumerate(keys):
            pairs = [(float(r[i][0]), float(r[i][1])) for r in rows if r[i][0] is not None]
            kind = metric_kind(k, counts)
            if kind == "mean" and k in weights:
                total = sum(w for _, w in pairs)
                out[k] = (sum(v * w for v, w in pairs if w) / total if total > 0
                          else float("nan"))
            else:
                out[k] = reduce_values([v for v, _ in pairs], kind)
        return out

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order."""
        return self._gather_objects(obj) if self.enabled else [obj]

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    # ---- models ------------------------------------------------------------------------------
    def wrap(self, model: torch.nn.Module, fsdp: bool, device: torch.device | None = None,
             bf16: bool = False) -> torch.nn.Module:
        """Shard `model` with FSDP2 when `fsdp`, else leave it replicated (see module doc).

        FSDP2 (`posttrain.engine.fsdp.shard`): shards on `device` (default: CUDA when
        available, else the CPU); ranks that built the model on ``meta`` get rank 0's weights;
        `bf16`: the decoder layers' bf16 mixed precision (fp32 reductions and root group).
        """
        if not self.enabled:
            return model
        if not fsdp:
            self.broadcast_params(model)
            return model
        from posttrain.engine.fsdp import on_meta, shard

        self.fsdp = True
        if device is None:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        shard(model, decoder_layers(model), device, bf16, self.any(on_meta(model)))
        return model

    def slow_barrier(self) -> None:
        """A barrier with `fsdp.CHECKPOINT_TIMEOUT` (on a gloo group made at the first call, by
        every rank): ranks waiting for rank 0 to write a checkpoint or `final/`."""
        if self.enabled:
            dist.barrier(group=self.slow_group())

    def slow_group(self) -> Any:
        """The gloo group of every rank with `fsdp.CHECKPOINT_TIMEOUT` (None without torchrun)."""
        if not self.enabled:
            return None
        if getattr(self, "_slow_group", None) is None:
            from posttrain.engine.fsdp import CHECKPOINT_TIMEOUT

            self._slow_group = dist.new_group(backend="gloo", timeout=CHECKPOINT_TIMEOUT)
        return self._slow_group

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


_CREATED: list[Any] = []
"""The default process group when posttrain created it: the only one it destroys (a colocated
vLLM sampler creates its own when there is none, and its finalizer destroys that one)."""


def close_process_group(finished: bool) -> None:
    """Leave torchrun's process group cleanly (a no-op when it was never started).

    The FSDP2 modules and DTensors that hold the group are collected first, while the
    interpreter is fully alive, and after a finished run the ranks meet once more, so no rank
    shuts its sockets while the other still talks and no gloo worker outlives the group into
    interpreter teardown (a rank aborts there otherwise, now and then: 'terminate called without
    an active exception'). After an error there is no meeting: the other rank may be inside a
    collective this one never joins.
    """
    if dist.is_available() and dist.is_initialized() and dist.group.WORLD in _CREATED:
        gc.collect()
        if finished:
            dist.barrier()
        dist.destroy_process_group()
        _CREATED.clear()
        gc.collect()
