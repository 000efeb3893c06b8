"""Sampler test doubles, registered through `posttrain.rollout.sampler.register_sampler`.

    from tests.rollout.doubles import shifted_hf
    monkeypatch.setitem(SAMPLERS, "hf", shifted_hf(0.1))   # or register_sampler("hf", ...)
    GRPOTrainer(cfg).train()  # rollouts' `logprobs` are the hf sampler's + 0.1 on counted tokens
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.rollout.record import Rollout
from posttrain.rollout.sampler import SAMPLERS, Sampler


class Wrapped:
    """A sampler that forwards to `inner` and changes its rollouts with `edit` (training role
    only: held-out evaluation is left as it is); `calls` records every generate's keywords."""

    name = "hf"

    def __init__(self, inner: Sampler, edit: Any) -> None:
        self.inner, self.edit = inner, edit
        self.runs_policy = inner.runs_policy
        self.calls: list[dict[str, Any]] = []
        self.raw_logprobs: list[torch.Tensor] = []  # the inner sampler's, before `edit`

    def generate(self, prompts: list[str], **kw: Any) -> Rollout:
        self.calls.append({"n_prompts": len(prompts), **kw})
        rollout = self.inner.generate(prompts, **kw)
        self.raw_logprobs.append(rollout.logprobs.clone())
        return self.edit(rollout)

    def update_weights(self, model: torch.nn.Module, weights_version: int) -> None:
        self.inner.update_weights(model, weights_version)

    def sleep(self) -> None:
        self.inner.sleep()

    def wake(self) -> None:
        self.inner.wake()

    def close(self) -> None:
        self.inner.close()


def shifted_hf(shift: float, built: list[Wrapped] | None = None, real: Any = None) -> Any:
    """A factory for `rollout_engine: hf` whose training sampler adds `shift` to the sampler's
    log-probs of the counted tokens (a known sampler/learner gap); `built` collects the
    samplers it makes; `real` is the factory wrapped (default: the registered hf one)."""
    real = real or SAMPLERS["hf"]

    def add(r: Rollout) -> Rollout:
        r.logprobs = r.logprobs + shift * r.response_mask.float()
        return r

    def factory(cfg: Any, tokenizer: Any, *, role: str = "eval", **kw: Any) -> Sampler:
        inner = real(cfg, tokenizer, role=role, **kw)
        if role != "train":
            return inner
        sampler = Wrapped(inner, add)
        if built is not None:
            built.append(sampler)
        return sampler

    return factory
