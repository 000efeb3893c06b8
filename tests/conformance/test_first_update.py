"""The first update of every RL trainer starts at ratio 1 and KL 0, in fp32 and bf16 autocast.

Before any update the policy is the sampler, the old policy and the reference: the first
optimizer step's ratios must be 1 and every KL estimate 0 (< 1e-5). Old log-probs, reference
log-probs and the learner's log-probs all come from the one policy forward, so this holds in
every precision (under bf16 autocast a second, different forward would show up here). Two
mini-batches per step make the trainers keep old log-probs instead of using the detached
current ones.
"""

from __future__ import annotations

import pytest

from tests.conformance.conftest import RL, build, case_keys

PRECISIONS = {"fp32": {}, "bf16_autocast": {"autocast_bf16": True},
              "fp32_packed": {"packing": True},  # every forward packed (docs/performance.md)
              "bf16_packed": {"autocast_bf16": True, "packing": True}}


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
@pytest.mark.parametrize("case", RL)
def test_first_update_has_ratio_one_and_zero_kl(world, tmp_path, case, precision):
    keys = case_keys(world, case, tmp_path, num_iterations=1, ppo_epochs=1, mini_batches=2,
                     kl_coef=0.1, **PRECISIONS[precision])
    trainer = build(case, keys)
    seen: list[dict[str, float]] = []
    optimize = trainer.optimize

    def recording(plan, counts, loss_fn, groups=None, before_step=None):  # noqa: ANN001, ANN202
        def record(merged: dict[str, float]) -> bool:
            seen.append(dict(merged))
            return before_step(merged) if before_step else False

        return optimize(plan, counts, loss_fn, groups, record)

    trainer.optimize = recording
    trainer.model.train()
    metrics = trainer.step(1)
    first = seen[0]
    assert abs(first["policy/ratio_max"] - 1.0) < 1e-5, first
    assert abs(first["policy/ratio_min"] - 1.0) < 1e-5, first
    assert abs(first["policy/approx_kl"]) < 1e-5 and first["policy/clipfrac"] == 0.0
    if "tools" in keys:  # the multi-turn case: tool answers really are in the sequences
        assert metrics["agent/tool_calls"] > 0 and metrics["agent/tool_token_share"] > 0
    kls = {k: v for k, v in {**metrics, **first}.items()
           if k.startswith("kl/") and k != "kl/coef"}
    assert kls, sorted(metrics)
    for k, v in kls.items():
        assert abs(v) < 1e-5, (k, v)


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_first_online_dpo_update_starts_at_the_reference(world, tmp_path, precision):
    """Online DPO's analogue: before any update the policy is the frozen reference, so every
    pair's implicit rewards and their margin are 0 (the two forwards are one forward)."""
    keys = case_keys(world, "online_dpo", tmp_path, **PRECISIONS[precision])
    trainer = build("online_dpo", keys)
    trainer.model.train()
    metrics = trainer.step(1)
    assert metrics["pairs/trained"] > 0, metrics
    for k in ("rewards/chosen", "rewards/rejected", "rewards/margin"):
        assert abs(metrics[k]) < 1e-5, (k, metrics[k])
    assert metrics["rewards/accuracy"] == 0.0  # ties count as wrong
