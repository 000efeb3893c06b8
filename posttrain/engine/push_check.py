"""Every weight push verified: the sampler's log-probs of a probe against the learner's.

After each push to a separate sampler (the vLLM samplers) the sampler scores a fixed probe (the
first training prompt and the sampler's greedy continuation of it, <= 32 tokens: text the model
finds likely, where bf16 log-probs are close) with its prompt log-probs at temperature 1, and
the learner scores the same ids in fp32. A mean absolute gap above `vllm_push_check`
stops the run in one line naming the sampler and the gap (`rollout/push_check_gap` is logged):
a stale tied head, a communicator that sent nothing or a half-loaded server would otherwise
go on sampling from other weights, with the importance correction quietly reweighting around
it. Cost: one prompt-only request and one learner forward of the probe per push.
More: docs/rollout.md, "Verified weight pushes".
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

PROBE_TOKENS = 32


class PushCheckError(RuntimeError):
    """The sampler's weights after a push are not the learner's."""


def probe_ids(sampler: Any, tokenizer: Any, text: str) -> list[int]:
    """The probe: `text`'s ids (no special tokens added) and the sampler's greedy continuation
    of them, at most PROBE_TOKENS new ids (at least 2 ids in all)."""
    from posttrain.rollout.hf import SamplingParams

    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"]) or [0]
    more = sampler.sample_ids([ids], SamplingParams(PROBE_TOKENS, greedy=True), sampler.stops)
    ids += list(more[0].token_ids)
    return ids if len(ids) > 1 else ids * 2


@torch.no_grad()
def learner_logprobs(model: torch.nn.Module, ids: list[int], device: Any) -> Tensor:
    """[len(ids) - 1] fp32 log p(ids[t] | ids[:t]) under `model` (eval mode, temperature 1)."""
    was_training = model.training
    model.eval()
    try:
        x = torch.tensor([ids], device=device)
        logits = model(input_ids=x).logits[0, :-1].float()  # [n-1, V]
    finally:
        model.train(was_training)
    return logits.log_softmax(-1).gather(-1, x[0, 1:, None])[:, 0].cpu()


def check_push(sampler: Any, model: torch.nn.Module, ids: list[int], bound: float,
               device: Any) -> float:
    """The mean |sampler - learner| log-prob gap over the probe; `PushCheckError` above
    `bound`."""
    sampled = torch.tensor(sampler.probe_logprobs(ids), dtype=torch.float32)  # [n-1]
    gap = float((sampled - learner_logprobs(model, ids, device)).abs().mean())
    if not gap <= bound:  # NaN too
        raise PushCheckError(
            f"rollout_engine={sampler.name}: after a weight push the sampler's log-probs differ "
            f"from the learner's by {gap:.4f} on average over {len(ids) - 1} probe tokens "
            f"(bound vllm_push_check={bound}): the push did not land (docs/rollout.md)")
    return gap
