"""The one update every trainer's step runs on: sharding, normalisers, micro-batches, steps.

A trainer lists one optimizer step's items and supplies two functions; :func:`run_update`:
1. **shard**: each rank takes its items (strided, as `Dist.shard`) or keeps its rollout rows;
2. **shuffle and split**: ``epochs`` passes over a permutation of GLOBAL item ids (seeded per
   step) cut into ``mini_batches`` optimizer steps, independent of the number of ranks;
3. **normalisers**: ``counts(local items)`` summed over ranks and micro-batches; each loss is
   divided by them, so the accumulated gradient equals one pass on one process;
4. **micro-batches**: ``loss_fn(items, totals)`` -> loss, metrics, weight; ``backward()``; under
   FSDP2 ranks with fewer micro-batches run zero-gradient idle passes;
5. **merge metrics**: ``loss/*`` summed, ``*_max`` / ``*_min`` max / min, the rest weighted means;
6. **step**: gradients summed over ranks, clipped and stepped per optimizer group, schedules
   advanced, gradients zeroed; ``<group>/grad_norm`` and ``<group>/lr`` reported.
More: docs/trainers.md, "Module notes", posttrain.engine.update.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from posttrain.core.padding import PAD_COUNT
from posttrain.engine.distributed import metric_kind, reduce_values
from posttrain.engine.optim import release_freed_memory

Totals = dict[str, float]
LossFn = Callable[[list[int], Totals], tuple[Tensor, dict[str, Any], float]]
CountFn = Callable[[list[int]], dict[str, float]]


@dataclass
class OptimGroup:
    """Parameters with their own optimizer, schedule and gradient clipping."""

    name: str
    params: list[torch.nn.Parameter]
    opt: torch.optim.Optimizer
    sched: Any
    max_grad_norm: float

    @property
    def metric(self) -> str:
        return "train/grad_norm" if self.name == "policy" else f"{self.name}/grad_norm"


@dataclass
class Plan:
    """How one call of :func:`run_update` walks the step's items.

    global_ids: [n_local] each local item's position in the step's global list.
    n_global: items of the step over all ranks. lengths: [n_local] sort key for similar-length
    micro-batches (or None). seed: shuffle seed of this step (None: no shuffle).
    micro_batch_tokens: when > 0 (and `widths` given), micro-batches hold at most this many
    token positions, rows x the padded width (`token_budget_micro_batches`), in place of
    `micro_batch_size` rows. widths: [n_local] each item's (prompt, completion) tokens.
    """

    global_ids: list[int]
    n_global: int
    micro_batch_size: int
    epochs: int = 1
    mini_batches: int = 1
    lengths: list[float] | None = None
    seed: int | None = None
    micro_batch_tokens: int = 0
    widths: list[tuple[int, int]] | None = None


def shard_plan(n_global: int, dist: Any, micro_batch_size: int, **kw: Any) -> Plan:
    """A plan over a global list that every rank holds: this rank's strided share."""
    return Plan(list(range(n_global))[dist.rank::dist.world] if dist.enabled
                else list(range(n_global)), n_global, micro_batch_size, **kw)


def local_plan(n_local: int, group_size: int, dist: Any, micro_batch_size: int,
               rows: list[int] | None = None, **kw: Any) -> Plan:
    """A plan over rollout rows this rank generated: prompt `i` of this rank is global prompt
    ``i * world + rank`` (the strided share), each with `group_size` contiguous rows.
    `rows`: the rows that train, when some of the `n_local` were dropped (PPO: unscorable)."""
    ids = [((i // group_size) * dist.world + dist.rank) * group_size + i % group_size
           for i in (range(n_local) if rows is None else rows)]
    return Plan(ids, int(dist.sum(float(n_local))), micro_batch_size, **kw)


class MetricSums:
    """Accumulates micro-batch metrics under the module's rule (loss/ summed, else weighted)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.extremes: dict[str, float] = {}  # `*_max` / `*_min` keys: MAX / MIN, not means

    def add(self, metrics: dict[str, Any], weight: float) -> None:
        for k, v in metrics.items():
            v = float(v)
            kind = metric_kind(k)
            if kind in ("max", "min"):
                old = self.extremes.get(k)
                self.extremes[k] = v if old is None else reduce_values([old, v], kind)
            elif k.startswith("loss/"):
                self.sums[k] = self.sums.get(k, 0.0) + v
                self.weights[k] = 1.0
            else:
                self.sums[k] = self.sums.get(k, 0.0) + v * weight
                self.weights[k] = self.weights.get(k, 0.0) + weight

    def reduce(self, dist: Any) -> dict[str, float]:
        """The merged metrics over every rank (the same dict on each)."""
        extremes = dist.reduce_metrics(self.extremes)  # MAX / MIN over ranks
        keys = sorted(set().union(*dist.all_gather_objects(sorted(self.sums))))
        if not keys:
            return extremes
        vals = torch.tensor([[self.sums.get(k, 0.0) for k in keys],
                             [self.weights.get(k, 0.0) for k in keys]], dtype=torch.float64)
        vals = dist.sum(vals) if dist.enabled else vals
        return {**extremes, **{
            k: float(vals[0, i]) if k.startswith("loss/")
            else float(vals[0, i] / vals[1, i]) if float(vals[1, i]) > 0 else float("nan")
            for i, k in enumerate(keys)}}


def _mini_batches(plan: Plan) -> list[list[int]]:
    """Local item indices of every optimizer step, in order (epochs x mini-batches)."""
    pos = {g: i for i, g in enumerate(plan.global_ids)}
    gen = torch.Generator().manual_seed(plan.seed) if plan.seed is not None else None
    steps = []
    for _ in range(plan.epochs):
        perm = (torch.randperm(plan.n_global, generator=gen) if gen is not None
                else torch.arange(plan.n_global))
        for chunk in torch.tensor_split(perm, plan.mini_batches):
            mine = [pos[g] for g in chunk.tolist() if g in pos]
            if plan.lengths is not None:  # similar lengths together (stable)
                mine.sort(key=lambda i: plan.lengths[i])  # type: ignore[index]
            steps.append(mine)
    return steps


def token_budget_micro_batches(items: list[int], widths: list[tuple[int, int]],
                               budget: int) -> list[list[int]]:
    """`items` grouped so that each micro-batch's padded size, rows x (longest prompt +
    longest completion), is at most `budget` tokens (verl's dynamic batch size): sorted by
    (completion, prompt) width (stable), then cut greedily. An item wider than the budget gets
    a micro-batch of its own (it cannot be split). Which rows share a micro-batch never
    changes the update: each loss is divided by the whole optimizer step's counts.
    widths: (prompt tokens, completion tokens) of each item, indexed by item."""
    out: list[list[int]] = []
    p_max = 0
    for i in sorted(items, key=lambda i: (widths[i][1], widths[i][0])):
        p, c = widths[i]
        if out and (len(out[-1]) + 1) * (max(p_max, p) + c) <= budget:
            out[-1].append(i)  # completions ascending: item i's is the longest so far
            p_max = max(p_max, p)
        else:
            out.append([i])
            p_max = p
    return out


def row_widths(prompt_mask: Tensor, response_mask: Tensor) -> list[tuple[int, int]]:
    """Each row's (prompt tokens, completion tokens up to the last position that counts).
    prompt_mask: [n, P]; response_mask: [n, T]. Returns n pairs."""
    T = response_mask.shape[1]
    span = (response_mask.bool() * torch.arange(1, T + 1, device=response_mask.device)).amax(-1)
    return list(zip(prompt_mask.sum(-1).tolist(), span.tolist(), strict=True))  # [n]


def step_groups(groups: Sequence[OptimGroup], dist: Any) -> dict[str, float]:
    """Sum gradients over ranks, clip, step, schedule, zero each group; returns each group's
    pre-clip grad norm and the learning rate the step used."""
    out = {}
    for g in groups:
        dist.sync_grads(g.params)
        grads = [p for p in g.params if p.grad is not None]
        limit = g.max_grad_norm if g.max_grad_norm > 0 else float("inf")
        norm = (torch.nn.utils.clip_grad_norm_(grads, limit) if grads
                else torch.zeros(()))
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
            norm = norm.full_tensor()
        out[g.metric.replace("grad_norm", "lr")] = float(g.opt.param_groups[0]["lr"])
        if not g.opt.state and all(p.device.type == "cpu" for p in g.params):
            release_freed_memory()  # the first step allocates the optimizer's moments
        g.opt.step()
        g.sched.step()
        g.opt.zero_grad(set_to_none=True)
        out[g.metric] = float(norm)
    return out


def run_update(plan: Plan, dist: Any, counts: CountFn, loss_fn: LossFn,
               groups: Sequence[OptimGroup], idle_pass: Callable[[], None],
               before_step: Callable[[dict[str, float]], bool] | None = None,
               ) -> dict[str, float]:
    """Every optimizer step of one trainer step (see the module docstring).

    `before_step(merged metrics of the optimizer step)` may return True to stop: that step's
    gradients are dropped and no further step runs (PPO's early stop on approx KL; the
    metrics are reduced over ranks, so every rank decides alike). Returns the mean over the
    optimizer steps of their merged metrics and grad norms, plus ``train/optimizer_steps`` and
    ``perf/rank_items`` (this rank's items: averaged over ranks, the step's items / world).
    """
    history: list[dict[str, float]] = []
    stopped = False
    for mine in _mini_batches(plan):
        totals = _global_counts(counts(mine), dist)
        if not any(v > 0 for v in totals.values()):
            continue  # nothing counts in this optimizer step on any rank
        micros = (token_budget_micro_batches(mine, plan.widths, plan.micro_batch_tokens)
                  if plan.micro_batch_tokens > 0 and plan.widths is not None
                  else [mine[a:a + plan.micro_batch_size]
                        for a in range(0, len(mine), plan.micro_batch_size)])
        # under FSDP2 every rank runs as many forward/backward passes as the busiest one
        # (agreed before any pass: each pass all-gathers and reduce-scatters)
        calls = int(dist.max(float(len(micros)))) if dist.fsdp else len(micros)
        acc = MetricSums()
        for micro in micros:
            loss, metrics, weight = loss_fn(micro, totals)
            loss.backward()
            acc.add(metrics, weight)
        for _ in range(calls - len(micros)):
            idle_pass()
        merged = acc.reduce(dist)
        if before_step is not None and before_step(merged):
            for g in groups:
                g.opt.zero_grad(set_to_none=True)
            stopped = True
            break
        merged.update(step_groups(groups, dist))
        history.append(merged)
    out = _mean(history)
    out["train/optimizer_steps"] = float(len(history))
    out["perf/rank_items"] = float(len(plan.global_ids))  # this rank's share of the step
    if stopped:
        out["train/early_stopped"] = 1.0
    return out


def _global_counts(local: dict[str, float], dist: Any) -> Totals:
    keys = sorted(local)
    if not dist.enabled:
        return {k: float(local[k]) for k in keys}
    vals = dist.sum(torch.tensor([float(local[k]) for k in keys], dtype=torch.float64))
    return {k: float(vals[i]) for i, k in enumerate(keys)}


def _mean(rows: list[dict[str, float]]) -> dict[str, float]:
    """Over the optimizer steps of one call: the mean of each key, the MAX / MIN of extremes."""
    keys = sorted(set().union(*rows)) if rows else []
    return {k: reduce_values([r[k] for r in rows if k in r], metric_kind(k)) for k in keys}


def padded_step(step_fn: Callable[[int], dict[str, float]], step: int,
                dist: Any) -> dict[str, float]:
    """``step_fn(step)``'s metrics plus ``perf/pad_fraction``: padded / all positions of the
    differentiated forward passes it ran (`posttrain.core.padding`), summed over ranks (the
    same value on each); 0 where it ran none."""
    PAD_COUNT.take()  # the count starts with the step
    metrics = step_fn(step)
    padded, total = PAD_COUNT.take()
    both = dist.sum(torch.tensor([padded, total], dtype=torch.float64))
    metrics["perf/pad_fraction"] = float(both[0] / both[1]) if float(both[1]) > 0 else 0.0
    return metrics
